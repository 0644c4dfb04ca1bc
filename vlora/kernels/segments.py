"""The per-iteration segment metadata the batched LoRA kernels take (``kernels/atmm.py``).

A segment is a run of consecutive token rows that one adapter (and, in mixed
mode, a second one) applies to; ``vlora/lora/batch.py`` builds the segments
and ``vlora/lora/device_store.py`` this metadata from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentMeta:
    """Per-iteration segment metadata for the kernels, on the device. Built once, shared by all layers."""

    starts: torch.Tensor              # [S] int32, first row
    lens: torch.Tensor                # [S] int32, rows
    ranks: torch.Tensor               # [S] int32, r_s (rank of each slice)
    scales: torch.Tensor              # [S] float32
    max_len: int                      # host int: longest segment (sizes the grid)
    num_rows: int                     # host int: rows covered by segments (picks the tile config)
    pair_ranks: torch.Tensor | None = None    # [S] int32: rank of each segment's second adapter (0: none)
    pair_scales: torch.Tensor | None = None   # [S] float32: its scale
