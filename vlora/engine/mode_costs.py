"""What each inference mode costs on this GPU, measured at start-up: decode iterations and mode switches.

V-LoRA's policy (Alg. 1) weighs an iteration in each mode and the switch between
them. Costs learnt online from the iterations the policy happens to run leave it
blind where it stops choosing a mode: a few slow iterations make a mode look
dear, the policy no longer runs it, and nothing measures it again
(docs/decisions.md, 'Mode costs profiled at start-up'). So the engine times the
modes once, before serving, on the same CUDA graphs the decode iterations
replay:

* one decode iteration per batch-size bucket and graph kind: no LoRA kernels
  (MERGED: the merged adapter's requests alone), one LoRA pass over rows of
  distinct adapters (UNMERGED), and that pass with the merged adapter
  subtracted from the rows of the others, in the same launch or in a second
  pass as the engine runs it (MIXED: one row of the merged adapter, the others
  of distinct adapters);
* the switches: a first merge (restore record written), an unmerge, and a
  merge of the adapter unmerged last (its record reused); with merged copies
  kept (``cache.merged_copy``), making a copy and a switch to or from it.

Timing replays whose rows write their KV to the scratch slot and read one
position of block 0 changes no sequence's state.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from vlora.engine.modes import Mode, ModeSwitcher, mode_segments
from vlora.lora.batch import PackedAdapter


@dataclass
class ModeCosts:
    """Seconds of one decode iteration per mode and batch-size bucket, and of each kind of switch."""

    step_s: dict[Mode, dict[int, float]] = field(default_factory=dict)
    merge_s: float = 0.0            # a first merge: weights and the restore record written
    reuse_s: float = 0.0            # a merge of the adapter unmerged last (its record reused)
    unmerge_s: float = 0.0
    make_s: float = 0.0             # making a merged copy in pool pages (0.0: not measured)
    copy_s: float = 0.0             # a switch to or from a resident merged copy (a pointer change)

    def step(self, mode: Mode, n: int) -> float:
        """An iteration of ``n`` requests in ``mode``: the smallest measured bucket that holds them (the
        largest when none does); 0.0 when the mode was not measured."""
        table = self.step_s.get(mode)
        if not table:
            return 0.0
        sizes = sorted(table)
        return table[next((b for b in sizes if b >= n), sizes[-1])]

    def as_dict(self) -> dict:
        return {"step_ms": {m.value: {b: round(s * 1e3, 4) for b, s in t.items()} for m, t in self.step_s.items()},
                "merge_ms": round(self.merge_s * 1e3, 3), "reuse_ms": round(self.reuse_s * 1e3, 3),
                "unmerge_ms": round(self.unmerge_s * 1e3, 3), "make_copy_ms": round(self.make_s * 1e3, 3),
                "copy_switch_ms": round(self.copy_s * 1e3, 4)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (run to completion), after one untimed call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_steps(graphs, adapters: list[PackedAdapter], buckets: list[int], reps: int = 10) -> dict[Mode, dict]:
    """Decode iterations per mode and bucket, timed as the graph replays the engine runs (host preparation
    included). ``adapters``: resident in the pool, at least two; the first is the merged one, and the rows take
    the others in turn."""
    if len(adapters) < 2:
        raise ValueError("profiling the modes needs at least two resident adapters")
    merged, others = adapters[0], adapters[1:]
    out: dict[Mode, dict[int, float]] = {m: {} for m in Mode}
    for b in buckets:
        rows = dict(ids=[0] * b, positions=[0] * b, slots=[graphs.scratch_slot] * b, tables=[[0]] * b, counts=[1] * b,
                    lens=[1] * b)
        runs = [(i, i + 1, others[i % len(others)]) for i in range(b)]
        own, _ = mode_segments(runs, None)
        if b > 1:                                        # MIXED: row 0 is the merged adapter's (when b > 1)
            runs[0] = (0, 1, merged)
        mixed, minus = mode_segments(runs, merged, graphs.launch.mixed)
        out[Mode.MERGED][b] = _time(lambda: graphs.run(**rows, segments=[]), graphs.device, reps)
        out[Mode.UNMERGED][b] = _time(lambda: graphs.run(**rows, segments=own), graphs.device, reps)
        out[Mode.MIXED][b] = _time(lambda: graphs.run(**rows, segments=mixed, minus=minus), graphs.device, reps)
    return out


def profile_switches(modes: ModeSwitcher, adapter: PackedAdapter, reps: int = 3) -> tuple[float, float, float]:
    """(first merge, unmerge, merge with the record reused) seconds, medians of ``reps`` cycles after one untimed
    cycle (kernel builds the start-up did not do); the weights are restored bit for bit after each."""
    def cycle() -> tuple[float, float, float, float]:
        modes.forget(adapter.name)          # no record kept: a first merge
        return modes.merge(adapter), modes.unmerge(), modes.merge(adapter), modes.unmerge()

    cycle()
    runs = [cycle() for _ in range(reps)]
    return (statistics.median(r[0] for r in runs), statistics.median(u for r in runs for u in (r[1], r[3])),
            statistics.median(r[2] for r in runs))


def profile_copy(modes: ModeSwitcher, adapter: PackedAdapter, reps: int = 3) -> tuple[float, float]:
    """(making a merged copy of ``adapter``, a switch to or from it) seconds, medians of ``reps``; the copy is
    dropped after. (0.0, 0.0) without merged copies or when the pool has no run of pages for one."""
    copies = modes.copies
    if copies is None or modes.merged is not None:
        return 0.0, 0.0
    makes, switches = [], []
    for _ in range(reps):
        copies.drop()
        makes.append(modes.merge(adapter, copy_keep_free=0))
        if copies.copy is None:                  # no room: it merged in place
            modes.unmerge()
            return 0.0, 0.0
        switches += [modes.unmerge(), modes.merge(adapter, copy_keep_free=0)]
        modes.unmerge()
    copies.drop()
    return statistics.median(makes), statistics.median(switches)


def profile_modes(runner, adapters: list[PackedAdapter], max_batch: int, reps: int = 10) -> ModeCosts:
    """Every measurement above on ``runner``'s graphs and weights (``adapters`` resident in the pool)."""
    graphs = runner.graphs
    if graphs is None:
        raise ValueError("profiling the modes needs the decode CUDA graphs")
    buckets = [b for b in graphs.buckets if b <= max(1, max_batch)] or graphs.buckets[:1]
    steps = profile_steps(graphs, adapters, buckets, reps)
    merge_s, unmerge_s, reuse_s = profile_switches(runner.modes, adapters[0])
    make_s, copy_s = profile_copy(runner.modes, adapters[0])
    return ModeCosts(steps, merge_s, reuse_s, unmerge_s, make_s, copy_s)
