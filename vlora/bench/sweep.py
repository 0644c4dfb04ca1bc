"""``vlora bench``: one engine, a workload swept over rates (or skewness) and mode policies, one report.

Every (policy, point) run starts from unmerged weights with a fresh orchestrator
on the same engine and adapters, so the policies differ only in their
decisions. The report (``report.md``) has a table of the BENCHMARKS.md metrics
per run, the gap of each policy to V-LoRA's, the plot of average token latency
against the swept value per policy, and the mode timeline of one V-LoRA run.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vlora.bench import workloads as W
from vlora.bench.harness import RunResult, run_workload
from vlora.engine.admission import SLO
from vlora.engine.orchestrator import Orchestrator
from vlora.kernels import compiles

POLICIES = ("vlora", "unmerged", "merged-only", "dlora")


@dataclass(frozen=True)
class SweepConfig:
    workload: str = "synthetic"      # synthetic | retrieval | video | dynamic | multiturn | trace
    points: tuple[float, ...] = (1.0, 2.0, 4.0)   # rates (req/s), skewness values, or video streams
    sweep: str = "rate"              # what points are: rate | skewness | streams
    rate: float = 2.0                # the rate when sweeping skewness
    skewness: float | None = None    # fixed skewness when sweeping rate (None: the workload's own popularity)
    policies: tuple[str, ...] = POLICIES
    duration_s: float = 20.0
    num_adapters: int = 8
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    input_range: tuple[int, int] = (8, 256)
    output_range: tuple[int, int] = (8, 128)
    trace: str | None = None
    ttft_slo_s: float | None = None  # applied to every request: early abort + SLO attainment in the report
    seed: int = 0
    warmup_requests: int = 16        # served once per policy before anything is timed (compiles, graphs, merges)
    repeats: int = 1                 # runs of every (point, policy), each on the workload of its own seed


def make_workload(cfg: SweepConfig, point: float) -> list[W.RequestSpec]:
    rate = point if cfg.sweep == "rate" else cfg.rate
    skew = point if cfg.sweep == "skewness" else cfg.skewness
    n = cfg.num_adapters
    if cfg.workload == "synthetic":
        shares = W.skewed_shares(n, skew) if skew else None
        return W.synthetic(n, 1.0, 1.0, rate, cfg.duration_s, cfg.input_range, cfg.output_range, cfg.seed, shares)
    if cfg.workload == "retrieval":
        return W.visual_retrieval(rate, cfg.duration_s, n, skew, cfg.seed)
    if cfg.workload == "video":
        streams = int(point) if cfg.sweep == "streams" else max(1, int(rate))
        return W.video_analytics(streams, cfg.duration_s, n, seed=cfg.seed)
    if cfg.workload == "dynamic":
        half = cfg.duration_s / 2
        return W.dynamic_popularity([(half, max(1, n // 2)), (half, n)], n, rate, seed=cfg.seed,
                                    input_range=cfg.input_range, output_range=cfg.output_range)
    if cfg.workload == "multiturn":
        return W.multi_turn(max(1, int(rate * cfg.duration_s / 3)), 3, rate, n, seed=cfg.seed)
    if cfg.workload == "trace":
        if not cfg.trace:
            raise ValueError("the trace workload needs a trace file")
        return W.load_trace(cfg.trace)
    raise ValueError(f"unknown workload {cfg.workload!r}")


def register_random_adapters(engine, cfg: SweepConfig, tmp: Path, log=None) -> list[str]:
    """``cfg``'s random adapters written to ``tmp`` and registered (those not registered yet); their names.
    ``log``: told how long writing and registering took."""
    from vlora.lora.adapter import ModelShape
    from vlora.lora.random_adapter import write_random_adapter

    mc = engine.model.cfg
    ins, outs = mc.lora_in_out()
    shape = ModelShape(engine.model_name, mc.num_layers, ins, outs)
    names = W.adapter_names(cfg.num_adapters)
    new = [(i, n) for i, n in enumerate(names) if n not in engine.adapters.names()]
    t0 = time.perf_counter()
    paths = {n: write_random_adapter(tmp / n, shape, cfg.ranks[i % len(cfg.ranks)], seed=cfg.seed + i, std=0.01,
                                      dtype=engine.dtype, device=engine.device)
             for i, n in new}
    t1 = time.perf_counter()
    for _, n in new:
        engine.adapters.register(n, paths[n])
    if log is not None and new:
        log(f"{len(new)} random adapters written in {t1 - t0:.1f} s, registered in {time.perf_counter() - t1:.1f} s")
    return names


def same_start(engine, names: list[str]) -> None:
    """Every timed run starts from the same state: nothing merged, no restore record kept (a merge of the
    adapter a previous run unmerged last would reuse its record and cost a fraction of a first merge), the
    sweep's adapters in the pool (in the same order, when they all fit). Without this the first policy of a
    point paid the adapter loads the later ones found done."""
    engine.unmerge_adapter()
    for name in names:
        engine.runner.modes.forget(name)
    store = engine.adapters.store
    if store is not None:
        store.ensure([engine.adapters.get(n) for n in names], set())


def run_sweep(engine, cfg: SweepConfig, progress: bool = True, log=print) -> list[dict]:
    sc = engine.config.scheduler
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = register_random_adapters(engine, cfg, Path(tmp))
        slo = SLO(ttft_s=cfg.ttft_slo_s) if cfg.ttft_slo_s else None
        # every decode graph now: captured lazily, they landed in whichever policy's timed run first met a
        # batch size (the first policy's, mostly); only vlora mixes
        engine.runner.capture_graphs(mixed="vlora" in cfg.policies)
        if cfg.warmup_requests:         # the first timed run must not pay for Triton compiles and graph captures
            warm = [dataclasses.replace(s, arrival_s=0.0) for s in make_workload(cfg, cfg.points[0])
                    if math.isfinite(s.arrival_s)][:cfg.warmup_requests]
            for policy in cfg.policies:
                same_start(engine, names)
                engine.orchestrator = Orchestrator(policy, sc.starvation_s, sc.max_num_seqs)
                run_workload(engine, warm, seed=cfg.seed)
        same_start(engine, names)
        costs = engine.profile_modes() if {"vlora", "dlora"} & set(cfg.policies) else None
        if costs is not None:
            log(f"mode costs measured on this GPU: {costs.as_dict()}")
        for rep in range(cfg.repeats):
            seed = cfg.seed + rep
            for point in cfg.points:
                specs = make_workload(dataclasses.replace(cfg, seed=seed), point)
                k = rep % len(cfg.policies)             # each repeat starts with another policy
                for policy in cfg.policies[k:] + cfg.policies[:k]:
                    same_start(engine, names)
                    engine.orchestrator = Orchestrator(policy, sc.starvation_s, sc.max_num_seqs, costs)
                    mark = compiles.snapshot()
                    res: RunResult = run_workload(engine, specs, seed=seed, slo=slo,
                                                  max_wall_s=cfg.duration_s * 4 + 30, progress=progress)
                    res.label = {"policy": policy, cfg.sweep: point, "repeat": rep}
                    m = res.metrics(cfg.ttft_slo_s) | compiles.since(mark)   # kernel builds inside the timed run
                    m["timeline"] = res.iterations
                    m["switch_times"] = res.switches
                    rows.append(m)
                    log(f"{policy:12s} {cfg.sweep}={point:g} #{rep}: avg token latency "
                        f"{_fmt(m['avg_token_latency_s'], 1e3)} ms, TTFT p50 {_fmt(m['ttft_p50_s'], 1e3)} ms, "
                        f"{m['finished']}/{m['requests']} finished, {m['rejected']} rejected, modes "
                        f"{m['mode_share']}, kernel builds {m['compiles']} ({m['compile_s']} s)")
    return rows


def _fmt(x, scale=1.0, digits=1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def write_report(rows: list[dict], cfg: SweepConfig, out: Path, meta: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k not in ("timeline", "switch_times")} for r in rows]
    (out / "results.json").write_text(json.dumps({"config": cfg.__dict__, "meta": meta, "runs": rows}, indent=1,
                                                 default=str))
    key = cfg.sweep
    lines = [f"# vlora bench: {cfg.workload} workload, {cfg.num_adapters} adapters", "",
             f"{meta.get('date')}, {meta.get('device')}, model {meta.get('model')}; {cfg.duration_s:g} s per run; "
             f"policies {', '.join(cfg.policies)}; swept {key} over {', '.join(f'{p:g}' for p in cfg.points)}.", "",
             f"| policy | {key} | run | avg token latency ms | TTFT p50 / p90 ms | TPOT p50 ms | tok/s | finished | "
             "rejected | switches (mean ms) | iterations per mode |", "|" + "---|" * 11]
    for r in slim:
        share = ", ".join(f"{m} {v:.0%}" for m, v in r["mode_share"].items())
        lines.append(f"| {r['policy']} | {r[key]:g} | {r.get('repeat', 0)} | {_fmt(r['avg_token_latency_s'], 1e3, 2)} | "
                     f"{_fmt(r['ttft_p50_s'], 1e3)} / {_fmt(r['ttft_p90_s'], 1e3)} | {_fmt(r['tpot_p50_s'], 1e3, 2)} | "
                     f"{_fmt(r['throughput_tok_s'])} | {r['finished']}/{r['requests']} | {r['rejected']} | "
                     f"{r['switches']} ({_fmt(r['switch_ms_mean'], 1, 2)}) | {share} |")
    gaps = _gaps(slim, key)
    if gaps:
        lines += ["", "Average token latency of V-LoRA's policy relative to each other policy, over all runs of a "
                  "point (total latency / total tokens; negative: V-LoRA is faster; per run in brackets):", ""]
        lines += [f"- {key}={p:g}: " + ", ".join(f"vs {pol} {g:+.1%}" + (f" ({', '.join(f'{x:+.1%}' for x in each)})"
                                                                    if len(each) > 1 else "")
                                                 for pol, (g, each) in gs.items())
                  for p, gs in gaps.items()]
    costs = meta.get("mode_costs")
    if costs:
        steps = costs["step_ms"]
        sizes = sorted({int(b) for t in steps.values() for b in t})
        lines += ["", f"Mode costs measured on this GPU before the runs (decode iteration, CUDA-graph replay, ms; "
                  f"switches: first merge {costs['merge_ms']:.1f}, merge with the record reused "
                  f"{costs['reuse_ms']:.1f}, unmerge {costs['unmerge_ms']:.1f} ms):", "",
                  "| mode | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|" + "---|" * (len(sizes) + 1)]
        for mode, t in steps.items():
            t = {int(b): v for b, v in t.items()}
            lines.append(f"| {mode} | " + " | ".join(f"{t[b]:.2f}" if b in t else "-" for b in sizes) + " |")
    if _plot(rows, cfg, out):
        lines += ["", "![latency](latency.png)", "", "![modes](modes.png)"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _pooled(rows: list[dict]) -> float | None:
    """Average token latency over several runs: their total latency over their total tokens."""
    done = [r for r in rows if r["avg_token_latency_s"]]
    tokens = sum(r["tokens"] for r in done)
    return sum(r["avg_token_latency_s"] * r["tokens"] for r in done) / tokens if tokens else None


def _gaps(rows: list[dict], key: str) -> dict:
    """point -> policy -> (gap of V-LoRA's pooled average token latency, the gaps of each repeat)."""
    out = {}
    for p in sorted({r[key] for r in rows}):
        at = [r for r in rows if r[key] == p]
        by = {pol: [r for r in at if r["policy"] == pol] for pol in dict.fromkeys(r["policy"] for r in at)}
        v = _pooled(by.get("vlora", []))
        if not v:
            continue
        gs = {}
        mine = {r.get("repeat", 0): r["avg_token_latency_s"] for r in by["vlora"]}
        for pol, rs in by.items():
            x = _pooled(rs)
            if pol == "vlora" or not x:
                continue
            each = [mine[r.get("repeat", 0)] / r["avg_token_latency_s"] - 1 for r in rs
                    if r["avg_token_latency_s"] and mine.get(r.get("repeat", 0))]
            gs[pol] = (v / x - 1, each)
        out[p] = gs
    return out


def _plot(rows: list[dict], cfg: SweepConfig, out: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = cfg.sweep
    fig, ax = plt.subplots(figsize=(6, 4))
    for pol in cfg.policies:
        mine = [r for r in rows if r["policy"] == pol]
        pts = [(p, _pooled([r for r in mine if r[key] == p])) for p in sorted({r[key] for r in mine})]
        pts = [(p, v) for p, v in pts if v]
        if pts:
            ax.plot([p for p, _ in pts], [1e3 * v for _, v in pts], marker="o", label=pol)
    ax.set_xlabel(key)
    ax.set_ylabel("average token latency (ms)")
    ax.set_title(f"{cfg.workload}, {cfg.num_adapters} adapters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
    runs = [r for r in rows if r["policy"] == "vlora" and r["timeline"]] or [r for r in rows if r["timeline"]]
    fig, ax = plt.subplots(figsize=(8, 2.6))
    if runs:
        r = runs[-1]
        levels = {"unmerged": 0, "mixed": 1, "merged": 2}
        ts = [t for t, _, _ in r["timeline"]]
        ax.step(ts, [levels[m] for _, m, _ in r["timeline"]], where="post", lw=0.8)
        ax.set_yticks(list(levels.values()), list(levels))
        ax.set_xlabel("time (s)")
        ax.set_title(f"mode per iteration: {r['policy']}, {key}={r[key]:g}")
    fig.tight_layout()
    fig.savefig(out / "modes.png", dpi=110)
    plt.close(fig)
    return True


def default_meta(engine) -> dict:
    import torch

    dev = engine.device
    meta = {"date": dt.date.today().isoformat(), "model": engine.model_name,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    if engine.mode_costs is not None:
        meta["mode_costs"] = engine.mode_costs.as_dict()
    return meta
