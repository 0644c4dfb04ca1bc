"""The one entry point for LoRA math in a forward pass.

``add_lora`` applies the iteration's batched LoRA delta to a packed projection's
output. On CPU it runs the torch reference; the Triton ATMM kernel plugs in here
for CUDA tensors, behind the same signature.
"""

from __future__ import annotations

import torch

from vlora.kernels.reference import lora_add_
from vlora.lora.batch import LoRABatch


def add_lora(y: torch.Tensor, x: torch.Tensor, lora: LoRABatch | None, layer: int, group: str) -> torch.Tensor:
    """y[rows of segment] += scaling * (x @ A) @ B for every segment's adapter; returns y.

    Shape: x [T, in]; y [T, out_packed] (the base projection's output, updated in place).
    """
    if lora is not None:
        lora_add_(y, x, lora, layer, group)
    return y
