"""Builders for tiny checkpoints and adapters, shared by the tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_model(root: Path, model_type: str = "llama", name: str = "tiny-llama", seed: int = 0, **overrides):
    """Save a random HF checkpoint of a tiny config; return (dir, hf_model)."""
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[model_type]
    torch.manual_seed(seed)
    cfg = cls[0](**{**TINY, **overrides})
    model = perturb_norms_and_biases(cls[1](cfg).eval())
    path = root / name
    model.save_pretrained(path)
    return path, model


def make_peft_adapter(base_model, path: Path, rank: int, seed: int, targets=ALL_TARGETS, alpha: int | None = None,
                      use_rslora: bool = False, **kw):
    """Save a PEFT LoRA adapter with random (non-zero) A and B; return the path."""
    import copy

    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank,     # targets: module names, or one regex
                          target_modules=targets if isinstance(targets, str) else list(targets),
                          init_lora_weights=False, use_rslora=use_rslora, **kw)
    pm = peft.get_peft_model(copy.deepcopy(base_model), cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    pm.save_pretrained(path)
    return path


def perturb_norms_and_biases(model):
    """Random (seeded by the caller) norm weights around 1 and small biases, so parity tests see them."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith(".bias"):
                p.normal_(0, 0.02)
    return model


def prefill_logits(eng, seqs) -> list[torch.Tensor]:
    """Logits of every prompt position of fresh ``seqs`` (Sequences), all prefilled in one engine iteration."""
    from vlora.engine.scheduler import ScheduledSeq

    scheduled = []
    for seq in seqs:
        seq.blocks = eng.allocator.allocate(-(-seq.num_tokens // eng.block_size))
        scheduled.append(ScheduledSeq(seq, 0, seq.num_tokens))
    if eng.adapters.store is not None:             # kernel path: the adapters must be in the pool
        eng.adapters.store.ensure([s.seq.adapter for s in scheduled if s.seq.adapter is not None], set())
    ordered = eng.runner.order(tuple(scheduled))
    with torch.inference_mode():
        eng.runner.encode_images(ordered)
        fb = eng.runner.prepare(ordered)
        logits = eng.model.compute_logits(eng.model(fb, eng.runner.kv_cache))
    rows, out = 0, {}
    for s in ordered:
        out[s.seq.request_id] = logits[rows:rows + s.num_tokens]
        rows += s.num_tokens
        eng.allocator.free(s.seq.blocks)
    return [out[seq.request_id] for seq in seqs]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def still_alive(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still running after up to ``timeout`` s (a bounded wait for them to end, not a timing
    check)."""
    import time

    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
