"""Paged KV cache: fixed-size blocks in one tensor, handed out by a free-list allocator.

The unified pool (KV + adapters in one paged buffer) replaces this allocator's
backing store later; the engine only sees ``allocate``/``free``/``num_free``.
"""

from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """No free KV block; the scheduler preempts instead of crashing."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def make_room(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def kv_cache_tensor(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[L, 2 (k, v), num_blocks, block_size, Hkv, D], zero-filled."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def blocks_for_memory(gib: float, num_layers: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype) -> int:
    per_block = num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return max(1, int(gib * (1 << 30)) // per_block)
