"""A merged copy of one adapter's projections in unified-pool pages: merged mode without writing the base weights.

The in-place merge (:mod:`vlora.lora.merge`) writes ``W + ΔW`` over the base weights and undoes it on the way
back (restore record, an unmerge pass over every touched weight). When the pool has pages to spare, the merged
weights of the adapter the policy merges can instead live in pages of their own: each packed projection group
the adapter touches gets one run of consecutive pages holding its stacked ``[L, out, in]`` merged weights. They
are computed once, by the same merge the in-place path runs, on a copy of the base weights, so they hold the
same bits as an in-place merge (tested); the base weights are only read. Switching between merged and unmerged
mode is then pointing the layers at the copy or back at the base weights (:class:`~vlora.engine.modes.ModeSwitcher`):
exact by construction, and no device work.

A group's copy is one contiguous run because the GEMMs and the merge kernel read a weight as one strided
tensor; splitting a layer's weight over scattered pages would need a gather per projection per step. Runs come
from the high end of the pool, as adapters' do, while KV blocks come from the low end (docs/decisions.md,
'Merged copy in pool pages').

The copy is a cache. The policy asks for one only while the pool has room beyond the KV its requests may still
need (:mod:`vlora.engine.orchestrator`); the pool's reclaimers drop it first when KV or an adapter load needs
pages (:mod:`vlora.memory.manager`), and the layers then read the base weights again (unmerged mode: outputs do
not depend on the mode). At most one copy is held.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from vlora.lora.batch import PackedAdapter
from vlora.lora.merge import merge_
from vlora.memory.kv_cache import OutOfBlocks


@dataclass(eq=False)
class MergedCopy:
    """One adapter's merged weights in pool pages."""

    adapter: PackedAdapter
    weights: dict[str, torch.Tensor]                 # group -> [L, out, in] merged weights (views of pool pages)
    params: dict[str, list[nn.Parameter]] = field(default_factory=dict)   # group -> each layer's weight
    key: tuple = ()                                  # where it sits: ((group, flat offset), ...); the decode
    #                                                  graphs keep one set per key (their weight addresses)
    pages: int = 0


def touched_groups(adapter: PackedAdapter, weights: dict[str, torch.Tensor]) -> list[str]:
    """The packed groups of ``weights`` that some layer of ``adapter`` has LoRA on (the others stay the base's)."""
    present = {g for groups in adapter.layers for g in groups}
    return [g for g in weights if g in present]


class MergedCopies:
    """The merged copy held in the pool's pages, if any: made on request when it fits, dropped for KV."""

    def __init__(self, pool):
        self.pool = pool
        self.copy: MergedCopy | None = None
        self.before_drop: list = []          # callables(copy): e.g. the mode switcher points the layers back
        self.num_made = 0
        self.num_dropped = 0                 # dropped for pages (KV, adapter loads) or replaced by another
        self.last_make_s = 0.0

    @staticmethod
    def _name(group: str) -> str:
        return f"merged-copy:{group}"

    def pages_for(self, weights: dict[str, torch.Tensor], groups=None) -> int:
        """Pages a copy of ``groups`` (default: every group of ``weights``) takes."""
        pe = self.pool.page_elems
        return sum(-(-weights[g].numel() // pe) for g in (weights if groups is None else groups))

    def fits(self, weights: dict[str, torch.Tensor], keep_free: int) -> bool:
        """Whether a copy of every group would leave ``keep_free`` pages free, counting the pages of the copy
        held now (a new copy replaces it). Counts pages only: a run of them may still be missing."""
        held = 0 if self.copy is None else self.copy.pages
        return self.pool.num_free + held - self.pages_for(weights) >= keep_free

    def make(self, adapter: PackedAdapter, weights: dict[str, torch.Tensor], widths: dict[str, tuple[int, ...]],
             staged: dict | None = None, keep_free: int = 0) -> MergedCopy | None:
        """Merge ``adapter`` into a copy of the base ``weights`` (group -> [L, out, in]) in pool pages, replacing
        the copy held now; None when the copy would leave fewer than ``keep_free`` pages free (the copy held now
        stays) or a group finds no run of pages (nothing is held then). ``staged``: the adapter's stacked factors (:func:`~vlora.lora.merge.
        stage_factors`), as the in-place merge takes them. The weights are written on the current stream."""
        groups = touched_groups(adapter, weights)
        need = self.pages_for(weights, groups)
        held = 0 if self.copy is None else self.copy.pages
        if not groups or self.pool.adapter_limit is not None or self.pool.num_free + held - need < keep_free:
            return None                          # the copy held now stays
        self.drop()
        t0 = time.perf_counter()
        offsets = {}
        try:
            for g in groups:
                offsets[g] = self.pool.reserve_run(self._name(g), weights[g].numel())
        except OutOfBlocks:
            for g in offsets:
                self.pool.release_run(self._name(g))
            return None
        buf = self.pool.buf
        copy = MergedCopy(adapter, {}, key=tuple(sorted(offsets.items())), pages=need)
        for g in groups:
            base = weights[g]
            dest = buf[offsets[g]:offsets[g] + base.numel()].view(base.shape)
            dest.copy_(base)
            # the in-place merge's own path, one group at a time (its restore record, not needed here, is freed
            # before the next group's is made): the same kernels on the same inputs write the same bits
            part = None if staged is None else {k: v for k, v in staged.items() if k[0] == g}
            merge_({g: dest}, {g: widths[g]}, adapter, staged=part)
            copy.weights[g] = dest
            copy.params[g] = [nn.Parameter(dest[i], requires_grad=False) for i in range(dest.shape[0])]
        self.copy = copy
        self.num_made += 1
        self.last_make_s = time.perf_counter() - t0
        return copy

    def drop(self) -> None:
        """Give the copy's pages back (the layers are pointed back at the base weights first)."""
        copy = self.copy
        if copy is None:
            return
        for hook in self.before_drop:
            hook(copy)
        self.copy = None
        for g in copy.weights:
            self.pool.release_run(self._name(g))
        self.num_dropped += 1

    def drop_adapter(self, name: str) -> None:
        """Drop the copy if it is adapter ``name``'s (the adapter is being unregistered)."""
        if self.copy is not None and self.copy.adapter.name == name:
            self.drop()

    # -- a source of pages for the pool (vlora/memory/manager.py) ----------------------------------
    def reclaim(self, pages: int) -> None:
        """KV (or an adapter load) needs ``pages``: the copy goes, whatever it holds (it is all or nothing)."""
        if pages > 0:
            self.drop()

    def reclaimable(self) -> int:
        return 0 if self.copy is None else self.copy.pages
