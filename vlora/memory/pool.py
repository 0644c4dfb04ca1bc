"""The unified memory pool (S-LoRA §5): one buffer of fixed-size pages for KV blocks and adapter weights.

A page holds one KV block of every layer: ``[L, 2 (k, v), block_size, Hkv, D]``
elements. The KV cache is the pages viewed as ``[num_pages, L, 2, block_size,
Hkv, D]``; layer ``l``'s K is ``kv[:, l, 0]`` (blocks one page apart, the
kernels take that stride). An adapter takes as many whole pages as its packed
A and B need, as one run of consecutive pages (taken from the high end, while KV
blocks come from the low end), so every matrix is contiguous and the LoRA
kernels read it through offsets into the flat buffer ``buf``, where it is. There is no split
between the two uses: a page is free, a KV block, or part of an adapter. A merged copy of an adapter's
projections (``vlora/lora/merge_copy.py``) takes runs of pages the same way (``reserve_run``): it is a cache
that gives its pages back when KV needs them.

The last page is a scratch block no one owns (CUDA-graph padding rows write
their KV there). ``adapter_limit`` turns the pool into the baseline of the
memory benchmark: two fixed pools, at most that many pages for adapters and
the rest for KV, neither giving way to the other. The pool keeps the KV
allocator interface the scheduler uses (``allocate``, ``free``, ``num_free``,
``num_blocks``).
"""

from __future__ import annotations

import mmap

import torch

from vlora.memory.kv_cache import OutOfBlocks


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed flat buffer. In host memory it is an anonymous mapping: the kernel hands out zero pages as they
    are first touched, so the pool takes resident memory only for the pages KV and adapters have used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel)


class UnifiedPool:
    def __init__(self, num_pages: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, adapter_limit: int | None = None):
        self.page_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.page_elems = num_layers * 2 * block_size * num_kv_heads * head_dim
        self.num_pages = num_pages                       # usable pages; one scratch page follows them
        self.buf = zeros((num_pages + 1) * self.page_elems, dtype, device)
        self.kv = self.buf.view(num_pages + 1, *self.page_shape)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.kv_pages = 0
        self.adapter_pages: dict[str, list[int]] = {}
        self.reserved: dict[str, list[int]] = {}     # runs of pages held by other owners (merged copies)
        self.pinned: set[str] = set()     # adapters that must stay this iteration (their pages are not KV's)
        self.wanted: set[str] = set()     # adapters loaded for waiting requests: pinned only once the running
        #                                   sequences have their pages (see :meth:`pin_wanted`)
        if adapter_limit is not None and not 0 <= adapter_limit <= num_pages:
            raise ValueError(f"adapter_limit must be in [0, {num_pages}], got {adapter_limit}")
        self.adapter_limit = adapter_limit               # None: one unified pool
        self.reclaimers: list = []   # callables(pages) freeing idle pages, tried in order (cached KV, idle adapters)
        self.reclaimable: list = []  # callables() -> pages the reclaimers could free now (without freeing them;
        #                              make_room frees nothing when their sum falls short)

    # -- the KV allocator interface -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Pages KV could have at most now: all but those of adapters that must stay (a sequence longer than
        this can never run and is finished instead of preempting everyone)."""
        if self.adapter_limit is not None:
            return self.num_pages - self.adapter_limit
        return self.num_pages - sum(len(p) for n, p in self.adapter_pages.items() if n in self.pinned)

    @property
    def num_free(self) -> int:
        """Pages KV can take now."""
        if self.adapter_limit is not None:
            return min(len(self._free), self.num_pages - self.adapter_limit - self.kv_pages)
        return len(self._free)

    @property
    def num_adapter_pages(self) -> int:
        return sum(len(p) for p in self.adapter_pages.values())

    def make_room(self, n: int, partial: bool = False) -> bool:
        """Whether ``n`` pages can be had, releasing idle pages (cached KV, then idle adapters) if needed. When
        the reclaimers could not free enough (:meth:`available`), nothing is released: a caller that gives up
        (an admission that waits, a running sequence about to preempt another) would otherwise have emptied the
        prefix cache for nothing, and every queued turn of a chat recomputed its history. ``partial``: release
        what can be released anyway (the caller uses whatever it gets)."""
        if n <= self.num_free:
            return True
        if not partial and n > self.available():
            return False
        for reclaim in self.reclaimers:
            if n <= self.num_free:
                break
            reclaim(n - self.num_free)
        return n <= self.num_free

    def available(self) -> int:
        """Pages KV could have now, counting what the reclaimers could free (an estimate; nothing moves)."""
        return self.num_free + sum(f() for f in self.reclaimable)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} pages, {self.num_free} free")
        self.kv_pages += n
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self.kv_pages -= len(pages)
        self._free.extend(pages)
        self._free.sort(reverse=True)                    # pop() hands out the lowest free page

    def pin_wanted(self) -> set[str]:
        """Pin the adapters loaded for waiting requests (:attr:`wanted`) that are still resident, before
        admissions; returns those a running sequence's pages took meanwhile (their requests wait). Running
        sequences come first: were the waiting requests' adapters pinned before they grew, a running sequence
        that fits the pool could find it full of them and be finished "length"."""
        kept = {n for n in self.wanted if n in self.adapter_pages}
        self.pinned |= kept                 # in place: the adapter store shares the set
        return self.wanted - kept

    # -- adapters ---------------------------------------------------------------------------------
    def pages_for(self, sizes: list[int], align: int = 16) -> int:
        """Pages that matrices of ``sizes`` elements take, packed back to back (each 16-element aligned)."""
        return -(-sum(-(-n // align) * align for n in sizes) // self.page_elems)

    def _highest_run(self, n: int) -> int | None:
        """First page of the highest run of ``n`` consecutive free pages (KV takes pages from the low end,
        adapters from the high end, so the two rarely break each other's runs)."""
        free = set(self._free)
        run = 0
        for p in range(self.num_pages - 1, -1, -1):
            run = run + 1 if p in free else 0
            if run == n:
                return p
        return None

    def place_adapter(self, name: str, sizes: list[int], align: int = 16) -> list[int]:
        """Reserve a run of consecutive pages for adapter ``name``'s matrices (so a matrix larger than a page
        stays contiguous for the kernels); returns each matrix's flat offset in ``buf``."""
        need = max(1, self.pages_for(sizes, align))
        if self.adapter_limit is not None and self.num_adapter_pages + need > self.adapter_limit:
            raise OutOfBlocks(f"adapter {name!r} needs {need} pages, the adapter pool has "
                              f"{self.adapter_limit - self.num_adapter_pages} left")
        pages = self._take_run(need, f"adapter {name!r}")
        self.adapter_pages[name] = pages
        offs, pos = [], pages[0] * self.page_elems
        for n in sizes:
            offs.append(pos)
            pos += -(-n // align) * align
        return offs

    def release_adapter(self, name: str) -> None:
        self._free.extend(self.adapter_pages.pop(name))
        self._free.sort(reverse=True)                    # pop() keeps handing out the lowest page

    def _take_run(self, need: int, what: str) -> list[int]:
        first = self._highest_run(need)
        if first is None:
            raise OutOfBlocks(f"{what} needs {need} consecutive pages, {len(self._free)} free")
        pages = list(range(first, first + need))
        taken = set(pages)
        self._free = [p for p in self._free if p not in taken]
        return pages

    # -- other runs of pages (merged copies) ------------------------------------------------------
    def reserve_run(self, name: str, numel: int) -> int:
        """Reserve the highest run of consecutive free pages that holds ``numel`` elements, under ``name``;
        returns its flat offset in ``buf``. Raises :class:`OutOfBlocks` when no run is long enough (nothing is
        reclaimed for it: the owner asks only when the pool has room)."""
        if name in self.reserved:
            raise ValueError(f"pages are already reserved under {name!r}")
        pages = self._take_run(max(1, -(-numel // self.page_elems)), repr(name))
        self.reserved[name] = pages
        return pages[0] * self.page_elems

    def release_run(self, name: str) -> None:
        self._free.extend(self.reserved.pop(name))
        self._free.sort(reverse=True)

    @property
    def num_reserved_pages(self) -> int:
        return sum(len(p) for p in self.reserved.values())

    def check(self) -> None:
        """Invariants (tests): every page is exactly one of free / KV / one adapter's / one reserved run's."""
        adapter = [p for ps in self.adapter_pages.values() for p in ps]
        owned = adapter + [p for ps in self.reserved.values() for p in ps]
        assert len(set(self._free)) == len(self._free) and len(set(owned)) == len(owned)
        assert not set(self._free) & set(owned)
        assert len(self._free) + len(owned) + self.kv_pages == self.num_pages
        assert all(0 <= p < self.num_pages for p in self._free + owned)
        if self.adapter_limit is not None:
            assert len(adapter) <= self.adapter_limit and self.kv_pages <= self.num_pages - self.adapter_limit
