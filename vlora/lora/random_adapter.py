"""Write a PEFT-format LoRA adapter with seeded random weights.

Used for speed benchmarks (shapes decide speed) and for the quick-start demo
until trained demo adapters exist; the answers they give are the base model's,
nudged at random, not a learned skill.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vlora.lora.adapter import LORA_TARGETS, ModelShape

_PARENT = {m: "self_attn" if m in LORA_TARGETS[:4] else "mlp" for m in LORA_TARGETS}


def write_random_adapter(path: str | Path, shape: ModelShape, rank: int, seed: int, std: float = 0.02,
                         alpha: float | None = None, targets: tuple[str, ...] = LORA_TARGETS,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Path:
    """Save ``adapter_config.json`` + ``adapter_model.safetensors`` for ``shape``; returns the path. ``device``:
    where the weights are drawn (a seed gives other weights on a GPU than on the CPU); 32 adapters of a 7B model
    were written in 5-6 s drawn on an H200, 197 s drawn on its busy host's CPU (2026-11-28)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for m in targets:
            key = f"base_model.model.model.layers.{layer}.{_PARENT[m]}.{m}"
            for part, rows, cols in (("A", rank, shape.in_features[m]), ("B", shape.out_features[m], rank)):
                w = torch.randn(rows, cols, generator=g, device=device) * std
                tensors[f"{key}.lora_{part}.weight"] = w.to(dtype).cpu()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": list(targets),
              "base_model_name_or_path": shape.name, "bias": "none", "use_rslora": False,
              "task_type": "CAUSAL_LM", "lora_dropout": 0.0}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
