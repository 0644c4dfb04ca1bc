"""KV-cache sizing and the error the pool raises when it runs out of pages.

KV blocks are pages of the unified pool (``vlora/memory/pool.py``); the
scheduler sees ``allocate`` / ``free`` / ``make_room`` / ``num_free`` there.
"""

from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """No free page; the scheduler preempts instead of crashing."""


def blocks_for_memory(gib: float, num_layers: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype) -> int:
    per_block = num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return max(1, int(gib * (1 << 30)) // per_block)
