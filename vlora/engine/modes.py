"""Inference modes (V-LoRA §4.4, Fig. 13): merged, unmerged and mixed (deLoRA).

* unmerged: no adapter in the base weights; every request's adapter runs through
  the batched LoRA op.
* merged: one adapter folded into the base weights (exact swift merge); its
  requests cost nothing extra. Or, where the pool keeps a merged copy of the
  adapter's projections (:mod:`vlora.lora.merge_copy`), the layers read that
  copy: switching to and from it is a pointer change, and the base weights are
  never written.
* mixed: an adapter is merged while requests of other adapters (and of the base
  model) are in the batch: they add their own adapter and subtract the merged
  one, in the same LoRA launch (each of their segments carries the merged
  adapter as a second pair, at minus its scaling), or, with
  ``LoRALaunch.mixed="two"``, in a second LoRA pass over their rows.

The outputs of a request are the same whatever mode serves it (tested); which
mode to use is the scheduler's decision (Alg. 1), the mechanics live here.
"""

from __future__ import annotations

import enum
import time
from typing import NamedTuple

from vlora.lora.batch import LoRABatch, LoRASegment, PackedAdapter
from vlora.lora.merge import MergeRecord, group_widths, merge_, stage_factors, stage_from_pool, unmerge_
from vlora.lora.merge_copy import MergedCopies, MergedCopy
from vlora.models.decoder import DecoderLM


class Mode(enum.Enum):
    UNMERGED = "unmerged"
    MERGED = "merged"
    MIXED = "mixed"


class ShardWeights(NamedTuple):
    """What merges fold into when it is a shard of the model rather than the whole decoder: the shard's
    configuration (its heads and MLP columns) and its stacked packed projections (a tensor-parallel rank's)."""

    cfg: object
    stacked: dict


class ModeSwitcher:
    def __init__(self, model: DecoderLM | ShardWeights, pool=None):
        """``model``: the decoder whose weights merges fold into, or a rank's :class:`ShardWeights` (merged
        copies need the decoder's layers); ``pool``: the unified pool (kernel path): merges stage an adapter's
        factors from where it sits."""
        cfg = model.cfg
        self.model = model
        self.pool = pool
        self.weights = model.stacked
        self.widths = group_widths(cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size)
        self.record: MergeRecord | None = None
        self.kept: MergeRecord | None = None      # the last unmerged adapter's record, for its next merge
        self.num_reused = 0
        self.num_switches = 0
        self.last_switch_s = 0.0            # the last switch, of any kind
        self.last_device_switch_s = 0.0     # the last switch that ran on the device (merge, unmerge, copy made)
        self._staged: dict[str, tuple[PackedAdapter, dict]] = {}     # fused path: factors of recent merges
        self.copies: MergedCopies | None = None     # merged copies in pool pages (None: in-place merges only)
        self.on_copy = False                 # the layers read the resident copy's weights
        self.num_copy_switches = 0           # switches that were pointer changes
        self.last_copy_switch_s = 0.0
        self._base_params: dict | None = None    # group -> each layer's base weight parameter

    def keep_copies(self, copies: MergedCopies) -> None:
        """Merge into copies in ``copies``' pool pages when asked to (:meth:`merge`'s ``copy_keep_free``). Needs
        the model's layers (their weights are pointed at the copy)."""
        self.copies = copies
        copies.before_drop.append(self._dropping)

    @property
    def merged(self) -> PackedAdapter | None:
        if self.on_copy:
            return self.copies.copy.adapter
        return None if self.record is None else self.record.adapter

    def merge(self, adapter: PackedAdapter, copy_keep_free: int | None = None) -> float:
        """Make ``adapter`` the merged one (another merged one leaves first); returns seconds taken. Its resident
        merged copy, if any, is pointed at; else, with ``copy_keep_free`` (and copies kept), a copy is made if it
        leaves that many pool pages free; else it is folded into the base weights."""
        if self.merged is adapter:
            return 0.0
        t0 = time.perf_counter()
        resident = None if self.copies is None else self.copies.copy
        if resident is not None and resident.adapter is adapter:
            if self.record is None:
                self._point(resident)
                return self._pointed(t0)
            self._unmerge_keeping_record()      # another adapter merged in place: its unmerge is device work
            self._point(resident)
            return self._switched(t0)
        if self.on_copy:
            self._point(None)
        if copy_keep_free is not None and self.copies is not None:
            if self.record is not None:
                self._unmerge_keeping_record()
            made = self.copies.make(adapter, self.weights, self.widths, self._factors(adapter), copy_keep_free)
            if made is not None:
                self._point(made)
                return self._switched(t0)
        if self.record is not None:
            self._unmerge_keeping_record()
        reuse, self.kept = self.kept, None
        if reuse is not None and reuse.adapter is not adapter:
            reuse = None                              # freed before the new record is made: one record at most
        self.record = merge_(self.weights, self.widths, adapter, staged=self._factors(adapter), reuse=reuse)
        self.num_reused += self.record is reuse
        return self._switched(t0)

    def _factors(self, adapter: PackedAdapter) -> dict | None:
        """Device copies of the adapter's stacked factors. Read from the pool when the adapter is there (strided
        device copies: nothing is kept beyond the merge record's own); else gathered on the host, and then
        kept for the 4 most recently merged adapters."""
        if not next(iter(self.weights.values())).is_cuda:
            return None
        if self.pool is not None:
            staged = stage_from_pool(adapter, self.pool.buf, self.weights, self.widths)
            if staged is not None:
                return staged
        hit = self._staged.pop(adapter.name, None)
        staged = hit[1] if hit is not None and hit[0] is adapter else stage_factors(adapter, self.weights,
                                                                                    self.widths)
        self._staged[adapter.name] = (adapter, staged)
        while len(self._staged) > 4:
            self._staged.pop(next(iter(self._staged)))
        return staged

    def unmerge(self) -> float:
        """Back to the base weights, bit for bit; returns seconds taken. From a merged copy: the layers are
        pointed back at the base weights, which were never written (the copy stays resident). In place: the
        record is kept, so merging the same adapter next writes only the weights (``merge_``'s ``reuse``);
        merging another frees it first, so at most one record is held, as while an adapter is merged."""
        if self.on_copy:
            t0 = time.perf_counter()
            self._point(None)
            return self._pointed(t0)
        if self.record is None:
            return 0.0
        t0 = time.perf_counter()
        self._unmerge_keeping_record()
        return self._switched(t0)

    def _unmerge_keeping_record(self) -> None:
        unmerge_(self.weights, self.widths, self.record)
        self.kept, self.record = (self.record if self.record.kernel else None), None

    def forget(self, name: str) -> None:
        """Drop what is kept of adapter ``name`` (its record, its staged factors, its merged copy): it is being
        unregistered."""
        if self.kept is not None and self.kept.adapter.name == name:
            self.kept = None
        self._staged.pop(name, None)
        if self.copies is not None:
            self.copies.drop_adapter(name)

    def _point(self, copy: MergedCopy | None) -> None:
        """Make every layer read ``copy``'s weights for the groups it holds and the base weights for the others
        (None: the base weights everywhere). The decode graphs read ``model.weights_key`` to replay the graphs
        captured over the same weights (vlora/engine/cuda_graphs.py)."""
        layers = self.model.layers
        if self._base_params is None:
            self._base_params = {g: [getattr(layer, g).weight for layer in layers] for g in self.weights}
        for g, base in self._base_params.items():
            params = base if copy is None or g not in copy.params else copy.params[g]
            for layer, p in zip(layers, params):
                getattr(layer, g).weight = p
        self.on_copy = copy is not None
        self.model.weights_key = None if copy is None else copy.key

    def _dropping(self, copy: MergedCopy) -> None:
        """The pool takes ``copy``'s pages back: if the layers read it, they read the base weights again (an
        unmerged mode; outputs do not depend on the mode)."""
        if self.on_copy:
            self._point(None)

    def _pointed(self, t0: float) -> float:
        """A switch that was a pointer change: no device work to wait for."""
        self.num_switches += 1
        self.num_copy_switches += 1
        self.last_switch_s = self.last_copy_switch_s = time.perf_counter() - t0
        return self.last_copy_switch_s

    def _switched(self, t0: float) -> float:
        first = next(iter(self.weights.values()))
        if first.is_cuda:
            import torch

            torch.cuda.synchronize(first.device)
        self.num_switches += 1
        self.last_switch_s = self.last_device_switch_s = time.perf_counter() - t0
        return self.last_switch_s

    def mode_for(self, adapters: list[PackedAdapter | None]) -> Mode:
        """The mode an iteration over requests of ``adapters`` runs in."""
        if self.merged is None:
            return Mode.UNMERGED
        return Mode.MERGED if all(a is self.merged for a in adapters) else Mode.MIXED

    def segments(self, runs: list[tuple[int, int, PackedAdapter | None]], launches: str = "one"):
        """The iteration's LoRA segments from its (start, end, adapter-or-None) row runs: (segments, segments
        of a second pass). See :func:`mode_segments`."""
        return mode_segments(runs, self.merged, launches)


def mode_segments(runs: list[tuple[int, int, PackedAdapter | None]], merged: PackedAdapter | None,
                  launches: str = "one") -> tuple[list[LoRASegment], list[LoRASegment]]:
    """(segments, segments of a second pass) for rows ``runs`` with ``merged`` in the base weights. Unmerged:
    every row its adapter. Mixed, ``launches="one"``: rows of another adapter carry the merged one as a second
    pair at minus its scaling, base-model rows subtract it alone, its own rows get nothing; ``"two"``: the same
    sums as a first pass of the own adapters and a second that subtracts the merged one."""
    if merged is None:
        return LoRABatch.segments_of(runs), []
    if launches == "one":
        return LoRABatch.mixed_segments_of(runs, merged), []
    own = [(s, e, None if a is merged else a) for s, e, a in runs]
    minus = [(s, e, merged) for s, e, a in runs if a is not merged]
    return LoRABatch.segments_of(own), LoRABatch.segments_of(minus, scale=-merged.scaling)
