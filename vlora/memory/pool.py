"""The unified memory pool (S-LoRA §5): one buffer of fixed-size pages for KV blocks and adapter weights.

A page holds one KV block of every layer: ``[L, 2 (k, v), block_size, Hkv, D]``
elements. The KV cache is the pages viewed as ``[num_pages, L, 2, block_size,
Hkv, D]``; layer ``l``'s K is ``kv[:, l, 0]`` (blocks one page apart, the
kernels take that stride). An adapter takes as many whole pages as its packed
A and B need and each matrix sits inside one page, so the LoRA kernels read it
through offsets into the flat buffer ``buf``, where it is. There is no split
between the two uses: a page is free, a KV block, or part of an adapter.

The last page is a scratch block no one owns (CUDA-graph padding rows write
their KV there). The pool keeps the KV allocator interface the scheduler uses
(``allocate``, ``free``, ``num_free``, ``num_blocks``).
"""

from __future__ import annotations

import torch

from vlora.memory.kv_cache import OutOfBlocks


class UnifiedPool:
    def __init__(self, num_pages: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.page_elems = num_layers * 2 * block_size * num_kv_heads * head_dim
        self.num_pages = num_pages                       # usable pages; one scratch page follows them
        self.buf = torch.zeros((num_pages + 1) * self.page_elems, dtype=dtype, device=device)
        self.kv = self.buf.view(num_pages + 1, *self.page_shape)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.kv_pages = 0
        self.adapter_pages: dict[str, list[int]] = {}

    # -- the KV allocator interface -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} pages, {len(self._free)} free")
        self.kv_pages += n
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self.kv_pages -= len(pages)
        self._free.extend(reversed(pages))

    # -- adapters ---------------------------------------------------------------------------------
    def pages_for(self, sizes: list[int]) -> int:
        """Pages that matrices of ``sizes`` elements take (each 16-aligned, none across a page boundary)."""
        spots = self._place(sizes)
        return spots[-1][0] + 1 if spots else 0

    def _place(self, sizes: list[int], align: int = 16) -> list[tuple[int, int]]:
        """(page index in the adapter's list, offset) of each matrix; pages are filled in order."""
        out, page, used = [], 0, 0
        for n in sizes:
            n = -(-n // align) * align
            if n > self.page_elems:
                raise ValueError(f"a matrix of {n} elements does not fit a page of {self.page_elems}")
            if used + n > self.page_elems:
                page, used = page + 1, 0
            out.append((page, used))
            used += n
        return out

    def place_adapter(self, name: str, sizes: list[int]) -> list[int]:
        """Reserve pages for adapter ``name``'s matrices; returns each matrix's flat offset in ``buf``."""
        spots = self._place(sizes)
        need = spots[-1][0] + 1 if spots else 0
        if need > len(self._free):
            raise OutOfBlocks(f"adapter {name!r} needs {need} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(need)]
        self.adapter_pages[name] = pages
        return [pages[p] * self.page_elems + off for p, off in spots]

    def release_adapter(self, name: str) -> None:
        self._free.extend(reversed(self.adapter_pages.pop(name)))

    def check(self) -> None:
        """Invariants (tests): every page is exactly one of free / KV / one adapter's."""
        adapter = [p for ps in self.adapter_pages.values() for p in ps]
        assert len(set(self._free)) == len(self._free) and len(set(adapter)) == len(adapter)
        assert not set(self._free) & set(adapter)
        assert len(self._free) + len(adapter) + self.kv_pages == self.num_pages
        assert all(0 <= p < self.num_pages for p in self._free + adapter)
