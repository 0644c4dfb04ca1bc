"""The architectures vlora serves: ``config.json``'s ``model_type`` -> the function that builds it, in one place.

Builders are named by module and function and imported only when used, so this module imports nothing of
vlora at load time: the model files import the loader, the loader consults the registry, and no module
imports one that imports it back. ``load_model`` turns a model argument (a path, a Hub id, ``random:<preset>``
or a named model such as ``demo:smollm2-llava``) into the built model.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Architecture:
    kind: str           # "decoder": vlora's DecoderLM; "lmm": a decoder plus a vision side
    module: str
    builder: str        # decoder: f(model_dir, dtype, device, max_model_len, hf_config=...) -> (model, max_len);
    #                     lmm: f(model_dir, hf_config, dtype, device, max_model_len, max_images, max_pixels)
    #                          -> (model, max_len, vision)

    def build(self):
        return getattr(importlib.import_module(self.module), self.builder)


_DECODER = Architecture("decoder", "vlora.models.loader", "build_decoder")
ARCHITECTURES: dict[str, Architecture] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _DECODER,
    "gemma3_text": _DECODER,
    "phi3": _DECODER,
    "llava": Architecture("lmm", "vlora.models.lmm", "build_llava"),
    "qwen2_vl": Architecture("lmm", "vlora.models.qwen2_vl", "build_qwen2_vl"),
}
# language models that exist only inside an LMM's checkpoint (Qwen2-VL's: Qwen2 with M-RoPE)
TEXT_ONLY_INSIDE = ("qwen2_vl_text",)
# model arguments that name a model vlora builds itself: name -> (module, function returning its directory)
NAMED_MODELS = {"demo:smollm2-llava": ("vlora.models.demo_lmm", "demo_lmm_dir")}


class UnsupportedArchitecture(ValueError):
    """A config.json whose model_type vlora has no builder for."""


def architecture_of(config: dict) -> str | None:
    return config.get("model_type")


def check_supported(model_type: str | None, where: str) -> Architecture:
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise UnsupportedArchitecture(f"{where}: model_type {model_type!r} is not supported (supported: "
                                      f"{', '.join(sorted(ARCHITECTURES))})")
    return arch


def is_decoder_type(model_type: str) -> bool:
    """Whether vlora's DecoderLM takes this (possibly inner) language model config."""
    return ARCHITECTURES.get(model_type) is _DECODER or model_type in TEXT_ONLY_INSIDE


def is_lmm_type(model_type: str | None) -> bool:
    arch = ARCHITECTURES.get(model_type)
    return arch is not None and arch.kind == "lmm"


def named_model_dir(spec) -> Path | None:
    """The directory of a named model (built on first use), or None when ``spec`` names none."""
    if not isinstance(spec, str) or spec not in NAMED_MODELS:
        return None
    module, fn = NAMED_MODELS[spec]
    return getattr(importlib.import_module(module), fn)()


@dataclass
class LoadedModel:
    model: object               # DecoderLM
    max_model_len: int
    vision: object | None       # an LMM's VisionModel; None for text-only models
    model_dir: Path | None      # where its files (tokenizer) are; None for random:<preset> models


def load_model(spec, dtype, device, max_model_len: int | None, max_images: int, max_pixels: int,
               seed: int = 0) -> LoadedModel:
    """Build the model that ``spec`` names, with its weights, on ``device``."""
    from vlora.models.loader import build_random_decoder, is_random_spec, resolve_model_dir

    if is_random_spec(spec):             # shapes of a known model, seeded random weights (benchmarks)
        from vlora.models.lmm import build_random_lmm, is_random_lmm

        if is_random_lmm(spec):
            return LoadedModel(*build_random_lmm(spec, dtype, device, max_model_len, max_images, max_pixels, seed),
                               None)
        return LoadedModel(*build_random_decoder(spec, dtype, device, max_model_len, seed), None, None)
    import json

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
