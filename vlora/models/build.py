"""The model a model argument names, built with its weights: the engine's one call to the model side.

The argument is a local path, a Hub id, ``random:<preset>`` (seeded random weights of a known shape) or a
named model such as ``demo:smollm2-llava``; ``config.json``'s ``model_type`` picks the builder from the
registry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlora.models.lmm import build_random_lmm, is_random_lmm
from vlora.models.loader import build_random_decoder, is_random_spec, resolve_model_dir
from vlora.models.registry import architecture_of, check_supported


@dataclass
class LoadedModel:
    model: object               # DecoderLM
    max_model_len: int
    vision: object | None       # an LMM's VisionModel; None for text-only models
    model_dir: Path | None      # where its files (tokenizer) are; None for random:<preset> models


def load_model(spec, dtype, device, max_model_len: int | None, max_images: int, max_pixels: int,
               seed: int = 0, cut=None, tokenizer: str | None = None) -> LoadedModel:
    """Build the model that ``spec`` names, with its weights, on ``device``. ``cut``: see
    :func:`~vlora.models.loader.build_random_decoder` (random decoders only; others are built whole).
    ``tokenizer``: a model argument whose tokenizer a random decoder is given (``ModelConfig.tokenizer``): its
    vocabulary grows to cover that tokenizer's."""
    if is_random_spec(spec):             # shapes of a known model, seeded random weights (benchmarks)
        if is_random_lmm(spec):
            return LoadedModel(*build_random_lmm(spec, dtype, device, max_model_len, max_images, max_pixels, seed),
                               None)
        vocab = None if tokenizer is None else len(load_tokenizer(resolve_model_dir(tokenizer)) or ())
        return LoadedModel(*build_random_decoder(spec, dtype, device, max_model_len, seed, cut, min_vocab=vocab),
                           None, None)
    from transformers import AutoConfig

    model_dir = resolve_model_dir(spec)
    arch = check_supported(architecture_of(json.loads((model_dir / "config.json").read_text(encoding="utf-8"))),
                           str(spec or model_dir))
    hf_config = AutoConfig.from_pretrained(model_dir)
    if arch.kind == "decoder":
        model, max_len = arch.build()(model_dir, dtype, device, max_model_len, hf_config=hf_config)
        return LoadedModel(model, max_len, None, model_dir)
    model, max_len, vision = arch.build()(model_dir, hf_config, dtype, device, max_model_len, max_images, max_pixels)
    return LoadedModel(model, max_len, vision, model_dir)


def load_tokenizer(model_dir: Path):
    """The Hugging Face tokenizer of ``model_dir``, or None when it has none (random weights, bare checkpoints)."""
    from transformers import AutoTokenizer

    has_tok = any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    return AutoTokenizer.from_pretrained(model_dir) if has_tok else None
