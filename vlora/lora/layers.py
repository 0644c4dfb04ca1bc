"""The one entry point for LoRA math in a forward pass.

``add_lora`` applies the iteration's batched LoRA delta to a packed projection's
output: the Triton ATMM kernels when the batch carries device metadata (CUDA),
the torch reference otherwise (CPU).
"""

from __future__ import annotations

import torch

from vlora.kernels.reference import lora_add_
from vlora.lora.batch import LoRABatch


def add_lora(y: torch.Tensor, x: torch.Tensor, lora: LoRABatch | None, layer: int, group: str) -> torch.Tensor:
    """y[rows of segment] += scaling * (x @ A) @ B for every segment's adapter; returns y.

    Shape: x [T, in]; y [T, out_packed] (the base projection's output, updated in place).
    """
    while lora is not None:                 # the batch, then its second pass (mixed mode), if any
        if lora.kernel is None:
            lora_add_(y, x, lora, layer, group)
        else:
            from vlora.kernels.atmm import lora_expand, lora_shrink

            k = lora.kernel[group]
            # the adapter buffer aligns every A and B to 16 elements, and ranks are >= 8
            v = lora_shrink(x, lora.buffer, k.a_off[layer], k.rtot[layer], lora.meta, k.r_max, k.shrink_cfg,
                            aligned=True)
            lora_expand(y, v, lora.buffer, k.b_off[layer], k.vcol[layer], k.widths, lora.meta, k.expand_cfg,
                        aligned=True, max_rank=k.r_max // len(k.widths))
        lora = lora.extra
    return y
