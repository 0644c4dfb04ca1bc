"""Paired comparison of the inference-mode policies: common random numbers, interleaved runs, t-intervals.

Every policy replays the same seeded trace of a setting (same arrivals, lengths and adapters: common random
numbers), so that what differs between two runs of a seed is the policy and the run's noise; the order of the
policies rotates with the seed (ABCD, BCDA, ...), so that no policy always runs first or last. Per setting the
difference of V-LoRA's average token latency to each baseline is taken seed by seed, and its mean gets a 95%
t-interval over the seeds: a policy is worse than another only where the whole interval says so.

A spread check (:func:`repeat_runs`) runs one policy several times on one trace and records beside each run what
can make runs of one trace differ: kernel builds inside the run, allocator growth and retries, garbage-collector
pauses, adapter loads and evictions, KV swaps and preemptions, merge switches, and how late each request was
sent against its trace arrival.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from vlora.bench import workloads as W
from vlora.bench.harness import run_workload
from vlora.bench.sweep import SweepConfig, same_start, make_workload
from vlora.engine.orchestrator import Orchestrator
from vlora.kernels import compiles

BASELINES = ("unmerged", "merged-only", "dlora")
FIXED = ("unmerged", "merged-only")          # the fixed policies V-LoRA's must not lose to
# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class Setting:
    """One workload of the comparison: ``name`` is skew<share>, retrieval or video."""

    name: str
    adapters: int

    @property
    def label(self) -> str:
        return f"{self.name}/{self.adapters}"


@dataclass(frozen=True)
class TraceShape:
    """What the traces are made of besides the setting and the seed."""

    duration_s: float = 8.0
    rate: float = 6.0                    # synthetic (skew) settings: requests per second
    retrieval_rate: float = 4.0          # retrieval: requests per second
    video_streams: int = 8               # video: streams, one chunk a second each
    input_range: tuple[int, int] = (8, 256)
    output_range: tuple[int, int] = (8, 128)


def make_trace(setting: Setting, seed: int, shape: TraceShape) -> list[W.RequestSpec]:
    """The seeded trace of ``setting``: the same for every policy that replays it."""
    base = SweepConfig(duration_s=shape.duration_s, num_adapters=setting.adapters, seed=seed,
                       input_range=shape.input_range, output_range=shape.output_range)
    if setting.name.startswith("skew"):
        skew = float(setting.name.removeprefix("skew"))
        return make_workload(replace(base, workload="synthetic", sweep="skewness", rate=shape.rate), skew)
    if setting.name == "retrieval":
        return make_workload(replace(base, workload="retrieval", sweep="rate"), shape.retrieval_rate)
    if setting.name == "video":
        return make_workload(replace(base, workload="video", sweep="streams"), shape.video_streams)
    raise ValueError(f"unknown setting {setting.name!r} (skew<share>, retrieval, video)")


def trace_digest(specs: list[W.RequestSpec]) -> str:
    """A short hash of a trace: equal for the runs that replayed the same one."""
    return hashlib.sha256(repr(specs).encode()).hexdigest()[:12]


def rotation(policies: tuple[str, ...], k: int) -> tuple[str, ...]:
    """The order of the ``k``-th seed: ABCD, BCDA, CDAB, ..."""
    k %= len(policies)
    return policies[k:] + policies[:k]


def t_interval(xs: list[float]) -> tuple[float, float, float] | None:
    """(mean, low, high): the 95% t-interval of the mean of ``xs``; None below two values."""
    n = len(xs)
    if n < 2:
        return None
    mean = statistics.fmean(xs)
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * statistics.stdev(xs) / math.sqrt(n)
    return mean, mean - half, mean + half


class _Probe:
    """Counters that explain why runs of one trace differ, read before and after a run."""

    def __init__(self, engine):
        self.engine = engine
        self.before = self._read()

    def _read(self) -> dict:
        e = self.engine
        out = {"preemptions": e.scheduler.num_preemptions}
        store = e.adapters.store
        if store is not None:
            out |= {"adapter_loads": store.num_loads, "adapter_evictions": store.num_evictions}
        sw = e.swapper
        if sw is not None:
            out |= {"kv_swapped_out": sw.swapped_out, "kv_swapped_in": sw.swapped_in}
        modes = e.runner.modes
        if getattr(modes, "copies", None) is not None:        # --merged-copy
            out |= {"copies_made": modes.copies.num_made, "copies_dropped": modes.copies.num_dropped,
                    "copy_switches": modes.num_copy_switches}
        if e.device.type == "cuda":
            import torch

            st = torch.cuda.memory_stats(e.device)
            out |= {"alloc_retries": st.get("num_alloc_retries", 0),
                    "alloc_segments": st.get("segment.all.allocated", 0),
                    "reserved_mb": st.get("reserved_bytes.all.current", 0) / 2**20}
        return out

    def since(self) -> dict:
        after = self._read()
        return {k: round(after[k] - self.before[k], 3) for k in after}


def mixed_launch_costs(engine, reps: int = 10) -> dict | None:
    """Decode iterations replayed from the CUDA graphs per batch bucket (ms): merged, unmerged, and mixed in one
    launch and in two (``LoRALaunch.mixed``), as the start-up profile times them. None without graphs."""
    from vlora.engine.mode_costs import profile_steps

    graphs, store = engine.runner.graphs, engine.adapters.store
    if graphs is None or store is None or len(engine.adapters.names()) < 2:
        return None
    adapters = sorted((engine.adapters.get(n) for n in engine.adapters.names()[:9]), key=lambda a: -a.rank)
    store.ensure(adapters, set())
    buckets = [b for b in graphs.buckets if b <= engine.config.scheduler.max_num_seqs] or graphs.buckets[:1]
    saved, out = graphs.launch, {}
    try:
        for launches in ("one", "two"):
            graphs.launch = replace(saved, mixed=launches)
            steps = profile_steps(graphs, adapters, buckets, reps)
            for mode, table in steps.items():
                name = f"mixed-{launches}" if mode.value == "mixed" else mode.value
                out.setdefault(name, {}).update({b: round(1e3 * t, 4) for b, t in table.items()})
    finally:
        graphs.launch = saved
    return out


def run_policy(engine, names: list[str], policy: str, specs: list[W.RequestSpec], seed: int, costs,
               max_wall_s: float, legacy: bool = False, sampling: dict | None = None) -> dict:
    """One timed run of ``policy`` on ``specs`` from the same start as every other (nothing merged, no restore
    record kept, the setting's adapters in the pool); its metrics and what explains its spread. ``legacy``: as
    runs were made before (restore records kept from earlier runs, the collector not frozen), to measure the
    difference; ``sampling``: every request's sampling fields (None: greedy)."""
    sc = engine.config.scheduler
    if legacy:
        engine.unmerge_adapter()
        if engine.adapters.store is not None:
            engine.adapters.store.ensure([engine.adapters.get(n) for n in names], set())
    else:
        same_start(engine, names)
    engine.orchestrator = Orchestrator(policy, sc.starvation_s, sc.max_num_seqs, costs)
    probe, mark = _Probe(engine), compiles.snapshot()
    res = run_workload(engine, specs, seed=seed, max_wall_s=max_wall_s, freeze_gc=not legacy, sampling=sampling)
    m = res.metrics()
    built = compiles.since(mark)
    m |= {"policy": policy, "seed": seed, "trace": trace_digest(specs), "compiles": built["compiles"],
          "compile_s": built["compile_s"], "switch_times": res.switches} | probe.since()
    return m


def repeat_runs(engine, names, policy, specs, seed, costs, k, max_wall_s, log=print, legacy: bool = False,
                sampling: dict | None = None) -> dict:
    """``policy`` ``k`` times on one trace: each run's metrics and counters, and the spread of the average token
    latency (coefficient of variation, max/min), timed from when requests were due and from when they were sent.
    ``legacy``: runs as they were made before (:func:`run_policy`)."""
    runs = []
    for i in range(k):
        runs.append(run_policy(engine, names, policy, specs, seed, costs, max_wall_s, legacy, sampling))
        log(f"  repeat {i + 1}/{k}{' (legacy)' if legacy else ''}: {policy} avg token latency "
            f"{1e3 * (runs[-1]['avg_token_latency_s'] or 0):.2f} ms, GC {runs[-1]['gc_pause_s'] * 1e3:.1f} ms, "
            f"late p99 {1e3 * (runs[-1]['late_p99_s'] or 0):.1f} ms, builds {runs[-1]['compiles']}")
    spread = {}
    for key, suffix in (("avg_token_latency_s", ""), ("avg_token_latency_from_send_s", "_from_send")):
        lat = [r[key] for r in runs if r[key]]
        if len(lat) >= 2:
            spread |= {f"mean_ms{suffix}": 1e3 * statistics.fmean(lat), f"sd_ms{suffix}": 1e3 * statistics.stdev(lat),
                       f"cv{suffix}": statistics.stdev(lat) / statistics.fmean(lat),
                       f"max_over_min{suffix}": max(lat) / min(lat) - 1}
    return {"policy": policy, "trace": trace_digest(specs), "runs": runs, "spread": spread, "legacy": legacy}


def paired_table(rows: list[dict], policies: tuple[str, ...]) -> list[dict]:
    """Per setting: each policy's mean latency and, for each baseline, the seed-by-seed relative difference of
    V-LoRA's average token latency (vlora / baseline - 1) with its 95% t-interval and a verdict; the best fixed
    policy; mode shares and switches of V-LoRA's runs."""
    out = []
    for label in dict.fromkeys(r["setting"] for r in rows):
        at = [r for r in rows if r["setting"] == label and r["avg_token_latency_s"]]
        lat = {(r["policy"], r["seed"]): r["avg_token_latency_s"] for r in at}
        entry = {"setting": label, "seeds": len({r["seed"] for r in at}),
                 "mean_ms": {p: 1e3 * statistics.fmean(v) for p in policies
                             if (v := [x for (q, _), x in lat.items() if q == p])}}
        fixed = [p for p in FIXED if p in entry["mean_ms"]]
        entry["best_fixed"] = min(fixed, key=entry["mean_ms"].get) if fixed else None
        entry["vs"] = {}
        for base in (p for p in policies if p != "vlora"):
            diffs = [lat[("vlora", s)] / lat[(base, s)] - 1 for (p, s) in lat if p == "vlora" and (base, s) in lat]
            ci = t_interval(diffs)
            verdict = ("-" if ci is None else "vlora worse" if ci[1] > 0 else "vlora better" if ci[2] < 0
                       else "no difference resolved")
            entry["vs"][base] = {"diffs": diffs, "ci": ci, "verdict": verdict}
        mine = [r for r in at if r["policy"] == "vlora"]
        shares: dict[str, float] = {}
        for r in mine:
            for mode, v in r["mode_share"].items():
                shares[mode] = shares.get(mode, 0.0) + v / len(mine)
        entry["vlora_mode_share"] = shares
        entry["vlora_switches"] = statistics.fmean(r["switches"] for r in mine) if mine else None
        times = [1e3 * s for r in mine for _, s in r["switch_times"]]
        entry["vlora_switch_ms"] = ((statistics.median(times), max(times)) if times else None)
        # what cheaper switches (a merged copy kept: a pointer change) could save at most, as a share of the run
        entry["vlora_switch_share"] = (statistics.fmean(sum(s for _, s in r["switch_times"]) / r["duration_s"]
                                                        for r in mine) if mine else None)
        out.append(entry)
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def write_report(out: Path, meta: dict, spread: list[dict], rows: list[dict], policies: tuple[str, ...]) -> None:
    """results.json (every run), report.md (spread checks, paired table) and paired.png."""
    out.mkdir(parents=True, exist_ok=True)
    table = paired_table(rows, policies) if rows else []
    (out / "results.json").write_text(json.dumps({"meta": meta, "spread": spread, "runs": rows, "paired": table},
                                                 indent=1, default=str))
    lines = [f"# Paired policy comparison ({meta.get('device')}, {meta.get('model')})", "",
             f"{meta.get('date')}; traces of {meta['shape']['duration_s']:g} s; policies {', '.join(policies)}, "
             "interleaved (the order rotates with the seed); every policy replays the same trace per seed.", "",
             f"Commit {meta.get('commit') or 'not recorded'}; decoding {_decoding(meta.get('sampling'))}; "
             "merged copies "
             f"{'kept in free pool pages (--merged-copy)' if meta.get('merged_copy') else 'off (merges in place)'}"
             + (f"; {len(meta['parts'])} invocations merged (the settings split between them)" if meta.get("parts")
                else "") + ".", ""]
    costs = meta.get("mixed_launch_ms")
    if costs:
        sizes = sorted({int(b) for t in costs.values() for b in t})
        lines += ["## A decode iteration per mode (CUDA-graph replay, ms)", "",
                  "| batch | " + " | ".join(costs) + " |", "|" + "---|" * (len(costs) + 1)]
        for b in sizes:
            lines.append(f"| {b} | " + " | ".join(f"{t[b]:.3f}" if b in t else "-"
                                                  for t in ({int(k): v for k, v in c.items()}
                                                            for c in costs.values())) + " |")
        lines.append("")
    for check in spread or []:
        s = check.get("spread") or {}
        how = ("as runs were made before: records kept across runs, collector not frozen" if check.get("legacy")
               else "each run from the same start, collector frozen")
        lines += [f"## Spread of one policy on one trace ({check['policy']}, {check['setting']}, "
                  f"{len(check['runs'])} runs; {how})", ""]
        if s:
            lines += [f"Average token latency {s['mean_ms']:.2f} ms, sd {s['sd_ms']:.2f} ms (CV {100 * s['cv']:.1f}%), "
                      f"max/min {_pct(s['max_over_min'])}; timed from when requests were sent (as before): CV "
                      f"{100 * s.get('cv_from_send', 0):.1f}%, max/min {_pct(s.get('max_over_min_from_send'))}.", ""]
        lines += ["| run | avg token latency ms (from send) | kernel builds | GC pauses (full) ms | "
                  "late mean / p99 ms | alloc retries / new segments | switches | adapter loads | preemptions |",
                  "|" + "---|" * 9]
        for i, r in enumerate(check["runs"]):
            lines.append(f"| {i} | {1e3 * (r['avg_token_latency_s'] or 0):.2f} "
                         f"({1e3 * (r['avg_token_latency_from_send_s'] or 0):.2f}) | {r['compiles']} | "
                         f"{1e3 * r['gc_pause_s']:.1f} ({r['gc_full_collections']}) | "
                         f"{1e3 * (r['late_mean_s'] or 0):.1f} / {1e3 * (r['late_p99_s'] or 0):.1f} | "
                         f"{r.get('alloc_retries', '-')} / {r.get('alloc_segments', '-')} | {r['switches']} | "
                         f"{r.get('adapter_loads', '-')} | {r['preemptions']} |")
        lines.append("")
    if table:
        bases = [p for p in policies if p != "vlora"]
        lines += ["## V-LoRA's policy against each baseline", "",
                  "Relative difference of the average token latency, vlora / baseline - 1, mean over seeds with its "
                  "95% t-interval (negative: V-LoRA faster).", "",
                  "| setting | seeds | " + " | ".join(f"{p} ms" for p in policies) + " | "
                  + " | ".join(f"vs {b}" for b in bases)
                  + " | best fixed | V-LoRA modes | V-LoRA switches (median / max ms) | switch time, share of run |",
                  "|" + "---|" * (2 + len(policies) + len(bases) + 4)]
        for e in table:
            cells = []
            for b in bases:
                v = e["vs"][b]
                ci = v["ci"]
                cells.append("-" if ci is None else f"{_pct(ci[0])} [{_pct(ci[1])}, {_pct(ci[2])}] {v['verdict']}")
            modes = ", ".join(f"{m} {v:.0%}" for m, v in sorted(e["vlora_mode_share"].items()))
            sw = e["vlora_switch_ms"]
            lines.append(f"| {e['setting']} | {e['seeds']} | "
                         + " | ".join(f"{e['mean_ms'].get(p, float('nan')):.2f}" for p in policies) + " | "
                         + " | ".join(cells) + f" | {e['best_fixed']} | {modes} | "
                         + f"{_fmt_n(e['vlora_switches'])} ({'-' if sw is None else f'{sw[0]:.1f} / {sw[1]:.1f}'}) | "
                         + ("-" if e["vlora_switch_share"] is None else f"{100 * e['vlora_switch_share']:.2f}%") + " |")
        if _plot(table, bases, out / "paired.png"):
            lines += ["", "![paired differences](paired.png)"]
    if meta.get("stopped"):
        lines += ["", f"Stopped early: {meta['stopped']}."]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _decoding(sampling: str | None) -> str:
    return {"chat": "sampled (temperature 0.8, top_p 0.95, top_k 50)", "greedy": "greedy"}.get(sampling, "greedy")


def _fmt_n(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _plot(table: list[dict], bases: list[str], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(table)), 3.6))
    width = 0.8 / max(1, len(bases))
    for j, b in enumerate(bases):
        xs, ys, lo, hi = [], [], [], []
        for i, e in enumerate(table):
            ci = e["vs"][b]["ci"]
            if ci is not None:
                xs.append(i + (j - (len(bases) - 1) / 2) * width)
                ys.append(100 * ci[0])
                lo.append(100 * (ci[0] - ci[1]))
                hi.append(100 * (ci[2] - ci[0]))
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=f"vs {b}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(table)), [e["setting"] for e in table], rotation=30, ha="right")
    ax.set_ylabel("V-LoRA vs baseline, % (95% CI)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


class Clock:
    """Elapsed time of the invocation and an estimate of what is left, from the runs so far."""

    def __init__(self, total_runs: int, t0: float | None = None):
        """``t0``: when the invocation started (``time.monotonic()``; None: now)."""
        self.t0 = time.monotonic() if t0 is None else t0
        self.total = total_runs
        self.done = 0
        self.run_s: list[float] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def ran(self, seconds: float) -> str:
        self.done += 1
        self.run_s.append(seconds)
        left = (self.total - self.done) * statistics.fmean(self.run_s)
        return f"[{self.done}/{self.total}, {self.elapsed():.0f} s, ~{left:.0f} s left]"

    def next_run_s(self, default: float) -> float:
        return max(self.run_s) if self.run_s else default
