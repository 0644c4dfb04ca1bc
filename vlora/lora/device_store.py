"""Adapters in the unified pool, loaded on demand from host memory (the kernel path of the LoRA op).

Every registered adapter lives in host memory (pinned on CUDA, for asynchronous
copies). :class:`AdapterStore` brings an adapter into pool pages when a request
needs it, on a side stream whose copy overlaps the running iteration (the
iteration that uses it waits on the copy's event, the host never does), and
releases the least recently used adapters no running request needs when pages
are short. The ATMM kernels read each adapter where it sits in the pool
through its :class:`Placement` offsets, so an iteration never copies adapter
weights.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from contextlib import nullcontext

import torch

from vlora.kernels.segments import SegmentMeta
from vlora.lora.batch import GROUPS, GroupOffsets, KernelGroupMeta, LoRABatch, LoRALaunch, LoRASegment, PackedAdapter
from vlora.memory.kv_cache import OutOfBlocks
from vlora.memory.pinned import pin_in_place, pinned_empty, piece_slices

ALIGN = 16        # elements: every A and B starts on a 16-element boundary (vectorised kernel loads)


def aligned(n: int) -> int:
    """``n`` elements rounded up to the pool's alignment of an adapter matrix."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class HostAdapter:
    """An adapter's matrices in host memory, in pool order and pool layout."""

    flat: torch.Tensor            # every matrix back to back, each starting on an ALIGN boundary
    sizes: list[int]              # elements per matrix


def matrices(adapter: PackedAdapter) -> list[torch.Tensor]:
    """The adapter's matrices in pool order: per layer and group, A^T ([R, in]) then each present slice's B."""
    out = []
    for groups in adapter.layers:
        for name in GROUPS:
            gw = groups.get(name)
            if gw is not None:
                out.append(gw.a.T.contiguous().reshape(-1))
                out.extend(sl.b.reshape(-1) for sl in gw.slices)
    return out


def host_layout(adapter: PackedAdapter, alloc=torch.zeros) -> HostAdapter:
    """The adapter's matrices in one flat host buffer, from ``alloc(numel, dtype=)`` (zero-filled: the alignment
    padding is copied too, so it is defined), laid out exactly as the pool lays them out (back to back, each
    ALIGN-aligned), so that a load is one copy per 4 MiB piece rather than one per matrix."""
    mats = matrices(adapter)
    sizes = [m.numel() for m in mats]
    flat = alloc(sum(aligned(n) for n in sizes), dtype=mats[0].dtype)
    pos = 0
    for m, n in zip(mats, sizes):
        flat[pos:pos + n].copy_(m)
        pos += aligned(n)
    return HostAdapter(flat, sizes)


def least_recent(order, protected) -> str | None:
    """The adapter the LRU policy gives up: the first of ``order`` (least recently used first) outside
    ``protected`` (in use), or None."""
    return next((n for n in order if n not in protected), None)


class AdapterStore:
    def __init__(self, pool, device: torch.device):
        self.pool = pool
        self.device = device
        self.resident: OrderedDict[str, PackedAdapter] = OrderedDict()     # least recently used first
        self._host: dict[str, HostAdapter] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._protected: set[str] = set()
        self.keep: set[str] = set()               # adapters an ensure() in progress wants: not to be evicted
        pool.reclaimers.append(self.reclaim)
        pool.reclaimable.append(self.reclaimable)
        self.on_evict: list = []                  # callables(name): e.g. drop the KV cached under it
        # the matrices this process keeps of an adapter (tensor parallelism: rank 0's slices); None: all of them
        self.view = None
        self.num_loads = 0
        self.num_evictions = 0
        self.bytes_loaded = 0

    @property
    def buf(self) -> torch.Tensor:
        return self.pool.buf

    def add(self, adapter: PackedAdapter, host: HostAdapter | None = None) -> None:
        """Keep the adapter's matrices ready for copies (``host``: made beforehand by :meth:`host_copy`)."""
        self._host[adapter.name] = host if host is not None else self.host_copy(adapter)

    def host_copy(self, adapter: PackedAdapter) -> HostAdapter:
        """The adapter's matrices (this process's share of them: :attr:`view`) in the pool's layout
        (:func:`host_layout`), pinned on CUDA. Changes nothing here: safe on any thread."""
        # registered in pieces: this runs on a loader's thread while the engine serves (pinned.PIECE_BYTES)
        alloc = (lambda n, dtype: pinned_empty(n, dtype, pieces=True)) if self.device.type == "cuda" else torch.zeros
        return host_layout(adapter if self.view is None else self.view(adapter), alloc)

    def pinned(self, host: HostAdapter) -> HostAdapter:
        """``host`` (a layout read elsewhere, :func:`host_layout`) ready for asynchronous copies: on CUDA its
        buffer page-locked where it is when it can be (:func:`~vlora.memory.pinned.pin_in_place`), else copied
        into pinned memory. Safe on any thread."""
        if self.device.type != "cuda":
            return host
        flat = pin_in_place(host.flat)
        if flat is None:
            flat = pinned_empty(host.flat.numel(), host.flat.dtype, pieces=True)
            flat.copy_(host.flat)
        return HostAdapter(flat, host.sizes)

    def remove(self, name: str) -> None:
        if name in self.resident:
            self.evict(name)
        if self.stream is not None and name in self._host:
            self.stream.synchronize()      # a load from its host buffer may still be reading it: not freed before
        self._host.pop(name, None)

    def host_bytes(self) -> int:
        """Host memory the registered adapters' matrices take."""
        return sum(h.flat.numel() * h.flat.element_size() for h in self._host.values())

    @property
    def capacity(self) -> int:
        """Most pages an adapter can have (the adapter pool of fixed pools, else the whole pool)."""
        return self.pool.num_pages if self.pool.adapter_limit is None else self.pool.adapter_limit

    def pages_needed(self, adapter: PackedAdapter | HostAdapter) -> int:
        """Pool pages a registered adapter (or a host copy not yet added) takes."""
        host = adapter if isinstance(adapter, HostAdapter) else self._host[adapter.name]
        return self.pool.pages_for(host.sizes, ALIGN)

    def load(self, adapter: PackedAdapter) -> bool:
        """Copy the adapter into free pages; False when there are not enough."""
        host = self._host[adapter.name]
        try:
            offs = self.pool.place_adapter(adapter.name, host.sizes, ALIGN)
        except OutOfBlocks:
            return False
        buf = self.pool.buf
        if self.stream is not None:     # the pages may still be read or written by queued work: after it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with ctx:
            dst = buf[offs[0]:offs[0] + host.flat.numel()]
            for piece in piece_slices(host.flat.numel(), host.flat.dtype):   # one copy per registered piece
                dst[piece].copy_(host.flat[piece], non_blocking=True)
            if self.stream is not None:
                adapter.placement.ready = torch.cuda.Event()
                adapter.placement.ready.record(self.stream)
        adapter.placement.offsets = self._offsets(adapter, iter(offs))
        adapter.placement.epoch += 1
        self.resident[adapter.name] = adapter
        self.num_loads += 1
        self.bytes_loaded += sum(host.sizes) * host.flat.element_size()
        return True

    def evict(self, name: str) -> None:
        adapter = self.resident.pop(name)
        if adapter.placement.ready is not None:      # a copy still in flight must land before the pages are reused
            torch.cuda.current_stream(self.device).wait_event(adapter.placement.ready)
        self.pool.release_adapter(name)
        adapter.placement.offsets = None
        adapter.placement.ready = None
        self.num_evictions += 1
        for hook in self.on_evict:
            hook(name)

    @property
    def protected(self) -> set[str]:
        """Adapters in use this iteration (running requests, the merged one): never evicted, and their pages
        are not the KV's (the pool is told)."""
        return self._protected

    @protected.setter
    def protected(self, names: set[str]) -> None:
        self._protected = self.pool.pinned = set(names)

    def reclaim(self, pages: int) -> None:
        """Evict least recently used adapters outside ``protected`` until ``pages`` pages are freed (KV needs
        them) or none is left to evict."""
        freed = 0
        for name in [n for n in self.resident if n not in self.protected]:
            if freed >= pages:
                return
            freed += len(self.pool.adapter_pages[name])
            self.evict(name)

    def reclaimable(self) -> int:
        """Pages of resident adapters that :meth:`reclaim` could evict now."""
        return sum(len(self.pool.adapter_pages[n]) for n in self.resident if n not in self.protected)

    def ensure(self, wanted: list[PackedAdapter], protect: set[str]) -> set[str]:
        """Make ``wanted`` resident in priority order, evicting least recently used adapters that are neither
        protected nor wanted earlier in the list; returns the names resident afterwards among ``wanted``.
        The current stream is made to wait for the copies of the ones it gets."""
        ok: set[str] = set()
        keep = self.keep = set(protect) | {a.name for a in wanted if a.name in self.resident}
        try:
            return self._ensure(wanted, keep, ok)
        finally:
            self.keep = set()

    def _ensure(self, wanted: list[PackedAdapter], keep: set[str], ok: set[str]) -> set[str]:
        for a in wanted:
            if a.name in ok:
                continue
            keep.add(a.name)
            if a.name not in self.resident and not self.load(a):
                need = self.pages_needed(a)
                for reclaim in self.pool.reclaimers:      # cached KV first (not other adapters: below)
                    if getattr(reclaim, "__self__", None) is not self and self.pool.adapter_limit is None:
                        reclaim(need)
                while not self.load(a):
                    victim = least_recent(self.resident, keep)
                    if victim is None:
                        break
                    self.evict(victim)
            if a.name in self.resident:
                self.resident.move_to_end(a.name)
                ok.add(a.name)
                if a.placement.ready is not None:     # once: later work on this stream is ordered after it
                    torch.cuda.current_stream(self.device).wait_event(a.placement.ready)
                    a.placement.ready = None
        return ok

    def prefetch(self, wanted: list[PackedAdapter], keep_free_pages: int) -> None:
        """Load adapters queued requests will need while pages are spare (no eviction, no waiting)."""
        for a in wanted:
            if a.name in self.resident:
                continue
            if self.pool.num_free - self.pages_needed(a) < keep_free_pages:
                return
            self.load(a)

    def _offsets(self, adapter: PackedAdapter, offs) -> dict[str, GroupOffsets]:
        return group_offsets(adapter, offs, self.pool.buf.device)


def group_offsets(adapter: PackedAdapter, offs, device: torch.device) -> dict[str, GroupOffsets]:
    """The kernels' per-group offset tables of ``adapter`` whose matrices (pool order) start at ``offs``; the
    same tables as host lists go to ``adapter.placement.host``."""
    table: dict[str, list] = {g: ([], [], [], []) for g in GROUPS}
    for groups in adapter.layers:
        for name, modules in GROUPS.items():
            a_off, rtot, b_off, vcol = table[name]
            gw = groups.get(name)
            if gw is None:
                a_off.append(0), rtot.append(0)
                b_off.append([-1] * len(modules)), vcol.append([0] * len(modules))
                continue
            a_off.append(next(offs)), rtot.append(gw.a.shape[1])
            row_b, row_v = [-1] * len(modules), [0] * len(modules)
            for sl in gw.slices:
                row_b[sl.index], row_v[sl.index] = next(offs), sl.rank_start
            b_off.append(row_b), vcol.append(row_v)
    adapter.placement.host = table
    return {g: GroupOffsets(torch.tensor(a, dtype=torch.int64, device=device),
                            torch.tensor(rt, dtype=torch.int32, device=device),
                            torch.tensor(b, dtype=torch.int64, device=device),
                            torch.tensor(v, dtype=torch.int32, device=device))
            for g, (a, rt, b, v) in table.items()}


def build_kernel_batch(segs: list[LoRASegment], buffer: AdapterStore, widths: dict[str, tuple[int, ...]],
                       in_features: dict[str, int], table, device: torch.device,
                       launch: LoRALaunch = LoRALaunch()) -> LoRABatch:
    """Segment metadata + per-group offset tables, once per iteration, for every layer's kernels. Segments with a
    second adapter (``LoRASegment.pair``) get its offsets as the groups' ``pair`` tables (where a segment has
    none, its own adapter's stand in, unread: its pair rank is 0)."""
    lens = [s.end - s.start for s in segs]
    paired = any(s.pair is not None for s in segs)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)        # noqa: E731
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)      # noqa: E731
    meta = SegmentMeta(
        starts=i32([s.start for s in segs]), lens=i32(lens), ranks=i32([s.adapter.rank for s in segs]),
        scales=f32([s.scale for s in segs]), max_len=max(lens), num_rows=sum(lens),
        pair_ranks=i32([0 if s.pair is None else s.pair.rank for s in segs]) if paired else None,
        pair_scales=f32([s.pair_scale for s in segs]) if paired else None)
    rank1 = max(s.adapter.rank for s in segs)
    rank2 = max((s.pair.rank for s in segs if s.pair is not None), default=0)
    kernel = {}
    for g in GROUPS:
        ns = len(GROUPS[g])
        r_max = ns * (rank1 + rank2)
        own = _stacked([s.adapter.offsets[g] for s in segs])
        pair = _stacked([(s.pair or s.adapter).offsets[g] for s in segs]) if paired else None
        kernel[g] = KernelGroupMeta(
            own.a_off, own.rtot, own.b_off, own.vcol, r_max=r_max, widths=widths[g],
            shrink_cfg=table.get("shrink", meta.num_rows, len(segs), in_features[g], r_max),
            expand_cfg=table.get("expand", meta.num_rows, len(segs), sum(widths[g]), max(rank1, rank2)),
            pair=pair, max_rank=max(rank1, rank2))
    return LoRABatch(tuple(segs), meta, kernel, buffer.buf, launch=launch)


def _stacked(offs: list[GroupOffsets]) -> GroupOffsets:
    """Per-segment offsets [L] / [L, NS] as per-layer rows [L, S] / [L, S, NS]."""
    return GroupOffsets(*(torch.stack(parts, dim=1) for parts in zip(*((o.a_off, o.rtot, o.b_off, o.vcol)
                                                                       for o in offs))))
