"""Inference modes (V-LoRA §4.4, Fig. 13): merged, unmerged and mixed (deLoRA).

* unmerged: no adapter in the base weights; every request's adapter runs through
  the batched LoRA op.
* merged: one adapter folded into the base weights (exact swift merge); its
  requests cost nothing extra.
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

from vlora.lora.batch import LoRABatch, LoRASegment, PackedAdapter
from vlora.lora.merge import MergeRecord, group_widths, merge_, stage_factors, stage_from_pool, unmerge_
from vlora.models.decoder import DecoderLM


class Mode(enum.Enum):
    UNMERGED = "unmerged"
    MERGED = "merged"
    MIXED = "mixed"


class ModeSwitcher:
    def __init__(self, model: DecoderLM, pool=None):
        """``pool``: the unified pool (kernel path): merges stage an adapter's factors from where it sits."""
        cfg = model.cfg
        self.pool = pool
        self.weights = model.stacked
        self.widths = group_widths(cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size)
        self.record: MergeRecord | None = None
        self.kept: MergeRecord | None = None      # the last unmerged adapter's record, for its next merge
        self.num_reused = 0
        self.num_switches = 0
        self.last_switch_s = 0.0
        self._staged: dict[str, tuple[PackedAdapter, dict]] = {}     # fused path: factors of recent merges

    @property
    def merged(self) -> PackedAdapter | None:
        return None if self.record is None else self.record.adapter

    def merge(self, adapter: PackedAdapter) -> float:
        """Fold ``adapter`` into the base weights (unmerging another first); returns seconds taken."""
        if self.merged is adapter:
            return 0.0
        t0 = time.perf_counter()
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
        """Restore the base weights bit for bit; returns seconds taken. The record is kept: merging the same
        adapter next writes only the weights (``merge_``'s ``reuse``); merging another frees it first, so at
        most one record is held, as while an adapter is merged."""
        if self.record is None:
            return 0.0
        t0 = time.perf_counter()
        self._unmerge_keeping_record()
        return self._switched(t0)

    def _unmerge_keeping_record(self) -> None:
        unmerge_(self.weights, self.widths, self.record)
        self.kept, self.record = (self.record if self.record.kernel else None), None

    def forget(self, name: str) -> None:
        """Drop what is kept of adapter ``name`` (its record, its staged factors): it is being unregistered."""
        if self.kept is not None and self.kept.adapter.name == name:
            self.kept = None
        self._staged.pop(name, None)

    def _switched(self, t0: float) -> float:
        first = next(iter(self.weights.values()))
        if first.is_cuda:
            import torch

            torch.cuda.synchronize(first.device)
        self.num_switches += 1
        self.last_switch_s = time.perf_counter() - t0
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
