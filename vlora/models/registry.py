"""The architectures vlora serves: ``config.json``'s ``model_type`` -> the function that builds it, in one place.

Builders are named by module and function and imported only when used, so this module imports nothing of
vlora: the model files import the loader, the loader consults the registry, and no module imports one that
imports it back. ``vlora.models.build.load_model`` turns a model argument into the built model.
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
    "qwen3_moe": _DECODER,
    "gemma3_text": _DECODER,
    "phi3": _DECODER,
    "llava": Architecture("lmm", "vlora.models.lmm", "build_llava"),
    "qwen2_vl": Architecture("lmm", "vlora.models.qwen2_vl", "build_qwen2_vl"),
    "qwen2_5_vl": Architecture("lmm", "vlora.models.qwen2_5_vl", "build_qwen2_5_vl"),
    "qwen3_vl": Architecture("lmm", "vlora.models.qwen3_vl", "build_qwen3_vl"),
}
# language models that exist only inside an LMM's checkpoint (Qwen2-VL's, Qwen2.5-VL's: Qwen2 with M-RoPE;
# Qwen3-VL's: Qwen3 with interleaved M-RoPE)
TEXT_ONLY_INSIDE = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
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
