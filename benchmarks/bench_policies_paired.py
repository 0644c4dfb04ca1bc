"""Do the inference-mode policies differ beyond noise? Paired runs on common traces, with confidence intervals.

One invocation:

1. builds the engine (every engine option of ``vlora serve`` is accepted), registers random adapters of ranks
   ``--ranks`` (as many as the largest ``--adapters``), captures every decode graph (the mixed kind too), serves
   ``--warmup-requests`` requests under each policy (compiles, captures, first merges happen there) and profiles
   the modes, all before anything is timed; then times a decode iteration per batch bucket merged, unmerged and
   mixed, in one launch and in two (GPU only);
2. the spread check (``--repeat K``): ``--repeat-policy`` K times on one trace (``--repeat-setting``, seed 0),
   each run with what can explain its spread (kernel builds, GC pauses, allocator retries, adapter loads,
   switches, preemptions, how late requests were sent against their trace arrival); ``--spread-before`` first
   repeats it as runs were made before, and both report the latency timed from the send as well;
3. the grid: for each seed, each setting of ``--settings`` x ``--adapters``, every policy of ``--policies`` on
   that seed's trace (the same arrivals, lengths and adapters for every policy), the order rotating with the
   seed. Seeds are the outer loop, so a run stopped by ``--max-wall-s`` leaves every setting with the seeds done.

Writes results.json, report.md (the spread table; per setting each policy's mean, V-LoRA's paired difference
to each baseline with a 95% t-interval, the best fixed policy, V-LoRA's mode shares and switch times) and
paired.png to ``--out`` after every seed, so a run cut short still leaves its results.

    # H100, one device call of at most ~9 min: spread check + reduced grid (stops cleanly at --max-wall-s)
    python benchmarks/bench_policies_paired.py --out results/paired --repeat 4 --repeat-setting skew0.7/8 \\
        --settings skew0.5,skew0.9,video --adapters 8 --seeds 4 --duration 6 --max-wall-s 520
    # CPU dry run on a tiny model (what the test runs)
    python benchmarks/bench_policies_paired.py --dry-run --out /tmp/paired
    # one report of invocations that split the settings between GPUs (benchmarks/gpu_paired.sh)
    python benchmarks/bench_policies_paired.py --merge results/a results/b --out results/paired
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from vlora.bench.harness import run_workload
from vlora.bench.paired import (Clock, Setting, TraceShape, make_trace, mixed_launch_costs, repeat_runs, rotation,
                                run_policy, write_report)
from vlora.bench.sweep import POLICIES, SweepConfig, register_random_adapters, same_start
from vlora.cli import _add_config_args, _engine_config
from vlora.engine.orchestrator import Orchestrator

GPU_DEFAULTS = dict(model="random:llama-2-7b", kv_cache_memory_gb=40.0, max_num_seqs=64, max_num_batched_tokens=8192,
                    max_lora_rank=64, policy="vlora")
# what chat clients send (../shared/BENCHMARKS.md); greedy decoding is what no user runs
SAMPLING = {"chat": {"temperature": 0.8, "top_p": 0.95, "top_k": 50}, "greedy": None}
DRY_DEFAULTS = dict(model="random:tiny-llama", device="cpu", num_blocks=512, max_num_seqs=16, policy="vlora",
                    settings="skew0.9", adapters="4", seeds=2, duration=0.5, repeat=2, repeat_setting="skew0.9/4",
                    warmup_requests=4, input_range="4,24", output_range="2,6", ranks="8,16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json, report.md and paired.png")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="write one report to --out from the results.json of these directories (runs of one "
                        "configuration whose settings were split between invocations), then stop")
    p.add_argument("--sampling", choices=tuple(SAMPLING), default="chat",
                   help="decoding of every request: chat (temperature 0.8, top_p 0.95, top_k 50) or greedy")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny random model on the CPU, short traces, two seeds: checks the pipeline, measures "
                        "nothing")
    p.add_argument("--settings", default="skew0.3,skew0.5,skew0.7,skew0.9,retrieval,video",
                   help="comma-separated: skew<share of the top adapter>, retrieval, video")
    p.add_argument("--adapters", default="8,32", help="comma-separated adapter counts; each setting runs with each")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated; vlora is compared to the others")
    p.add_argument("--seeds", type=int, default=5, help="seeds (traces) per setting; the t-interval needs 2 or more")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first seed: an invocation that adds seeds to an earlier one's (joined with --merge)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per trace")
    p.add_argument("--rate", type=float, default=6.0, help="requests per second of the skew settings")
    p.add_argument("--retrieval-rate", type=float, default=4.0, help="requests per second of the retrieval setting")
    p.add_argument("--video-streams", type=int, default=8, help="streams of the video setting (a chunk a second each)")
    p.add_argument("--input-range", default="8,256", help="prompt tokens of the skew settings, min,max")
    p.add_argument("--output-range", default="8,128", help="output tokens of the skew settings, min,max")
    p.add_argument("--ranks", default="8,16,32,64", help="ranks of the random adapters, assigned in turn")
    p.add_argument("--repeat", type=int, default=0, help="spread check: runs of one policy on one trace (0: none)")
    p.add_argument("--repeat-policy", default="unmerged", help="the policy of the spread check")
    p.add_argument("--repeat-setting", default="skew0.7/8", help="the spread check's setting/adapters (seed 0)")
    p.add_argument("--spread-before", action="store_true",
                   help="run the spread check first as runs were made before (restore records kept across runs, "
                        "the collector not frozen), then as now")
    p.add_argument("--no-grid", action="store_true", help="the spread check only")
    p.add_argument("--warmup-requests", type=int, default=16, help="requests served per policy before any timing")
    p.add_argument("--mixed-launch", choices=("one", "two"), default=None,
                   help="mixed mode's LoRA: segments paired with the merged adapter in one launch, or a second pass "
                        "(default: the engine's, one launch on one GPU)")
    p.add_argument("--max-wall-s", type=float, default=None,
                   help="stop before a seed's runs would end past this many seconds of the invocation")
    _add_config_args(p)
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    dry = "--dry-run" in (sys.argv[1:] if argv is None else argv)
    p.set_defaults(**{k: v for k, v in (DRY_DEFAULTS if dry else GPU_DEFAULTS).items()})
    return p.parse_args(argv)


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def _setting(text: str, default_adapters: int) -> Setting:
    name, _, n = text.partition("/")
    return Setting(name, int(n) if n else default_adapters)


def _commit() -> str | None:
    """The commit measured: $VLORA_COMMIT where the checkout's history is not the code's (a copied tree), else git's."""
    if os.environ.get("VLORA_COMMIT"):
        return os.environ["VLORA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _arg(argv: list[str] | None, flag: str) -> str:
    argv = argv or []
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else "?"


def merge(dirs: list[str], out: Path) -> int:
    """One report of several invocations of one configuration (the same policies and engine options)."""
    parts = [json.loads((Path(d) / "results.json").read_text()) for d in dirs]
    policies = tuple(parts[0]["meta"]["policies"])
    if any(tuple(p["meta"]["policies"]) != policies for p in parts):
        raise SystemExit("--merge: the invocations compared different policies")
    # a part that is itself a merge brings its own parts
    keys = ("argv", "device", "date", "warmup_s", "stopped", "commit")
    meta = dict(parts[0]["meta"], parts=[q for p in parts for q in p["meta"].get("parts") or
                                         [{k: p["meta"].get(k) for k in keys}]])
    meta.pop("stopped", None)
    # which invocation stopped: a later part may have added the seeds it left (the seeds column counts them all)
    stopped = [f"{_arg(q['argv'], '--out')} ({_arg(q['argv'], '--settings')}): {q['stopped']}"
               for q in meta["parts"] if q.get("stopped")]
    if stopped:
        meta["stopped"] = "; ".join(stopped)
    write_report(out, meta, [c for p in parts for c in p["spread"]], [r for p in parts for r in p["runs"]], policies)
    print(f"report: {out / 'report.md'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    args = parse(argv)
    if args.merge:
        return merge(args.merge, Path(args.out))
    from vlora.builder import build_engine

    policies = tuple(args.policies.split(","))
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or "vlora" not in policies:
        raise SystemExit(f"--policies must include vlora and be among {', '.join(POLICIES)}; got {args.policies}")
    counts = [int(x) for x in args.adapters.split(",")]
    settings = [Setting(name, n) for n in counts for name in args.settings.split(",")]
    shape = TraceShape(args.duration, args.rate, args.retrieval_rate, args.video_streams, _pair(args.input_range),
                       _pair(args.output_range))
    for s in settings:
        make_trace(s, 0, replace(shape, duration_s=0.1))              # an unknown setting fails before the engine
    out = Path(args.out)
    log = lambda m: print(m, file=sys.stderr, flush=True)              # noqa: E731

    engine = build_engine(_engine_config(args))
    if args.mixed_launch:
        engine.runner.lora_launch = replace(engine.runner.lora_launch, mixed=args.mixed_launch)
        if engine.runner.graphs is not None:
            engine.runner.graphs.launch = engine.runner.lora_launch
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "model": args.model,
            "device": _device_name(engine), "policies": policies, "shape": asdict(shape), "argv": sys.argv[1:],
            "kernel_build": getattr(engine, "kernel_build", None), "mixed_launch": engine.runner.lora_launch.mixed,
            "commit": _commit(), "sampling": args.sampling, "merged_copy": engine.config.cache.merged_copy}
    sampling = SAMPLING[args.sampling]
    max_wall = args.duration * 4 + 30
    log(f"engine built [{time.monotonic() - t_start:.0f} s]")
    with tempfile.TemporaryDirectory() as tmp:
        names = register_random_adapters(engine, SweepConfig(num_adapters=max(counts + [_setting(
            args.repeat_setting, 8).adapters]), ranks=tuple(int(r) for r in args.ranks.split(","))), Path(tmp), log)
        log(f"{len(names)} adapters registered [{time.monotonic() - t_start:.0f} s]")
        t_warm = time.monotonic()
        engine.runner.capture_graphs(mixed=True)
        warm = [replace(s, arrival_s=0.0) for s in make_trace(settings[0], 10_000, shape)][:args.warmup_requests]
        sc = engine.config.scheduler
        for policy in policies:
            same_start(engine, names[:settings[0].adapters])
            engine.orchestrator = Orchestrator(policy, sc.starvation_s, sc.max_num_seqs)
            run_workload(engine, warm, seed=10_000, sampling=sampling)
        same_start(engine, names)
        costs = engine.profile_modes()
        meta["warmup_s"] = round(time.monotonic() - t_warm, 1)
        meta["mode_costs"] = None if costs is None else costs.as_dict()
        log(f"warm-up and mode profile: {meta['warmup_s']} s; mode costs {meta['mode_costs']}")
        meta["mixed_launch_ms"] = mixed_launch_costs(engine)
        if meta["mixed_launch_ms"]:
            log(f"decode iteration per mode, ms: {meta['mixed_launch_ms']}")

        spread = []
        if args.repeat:
            rs = _setting(args.repeat_setting, 8)
            for legacy in (True, False) if args.spread_before else (False,):
                log(f"spread check: {args.repeat_policy} x{args.repeat} on {rs.label}, seed 0"
                    + (" (as runs were made before)" if legacy else ""))
                spread.append(repeat_runs(engine, names[:rs.adapters], args.repeat_policy, make_trace(rs, 0, shape), 0,
                                          costs, args.repeat, max_wall, log, legacy, sampling)
                              | {"setting": rs.label})
                write_report(out, meta, spread, [], policies)
        rows: list[dict] = []
        if not args.no_grid:
            clock = Clock(args.seeds * len(settings) * len(policies), t_start)
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                block = len(settings) * len(policies) * clock.next_run_s(args.duration * 1.5)
                if args.max_wall_s is not None and seed > args.first_seed and clock.elapsed() + block > args.max_wall_s:
                    meta["stopped"] = (f"after {seed - args.first_seed} seeds, the next would pass --max-wall-s "
                                       f"{args.max_wall_s:g}")
                    log(meta["stopped"])
                    break
                for s in settings:
                    specs = make_trace(s, seed, shape)
                    for policy in rotation(policies, seed):
                        t0 = time.monotonic()
                        m = run_policy(engine, names[:s.adapters], policy, specs, seed, costs, max_wall,
                                       sampling=sampling)
                        rows.append(m | {"setting": s.label})
                        log(f"{s.label:14s} seed {seed} {policy:12s} avg token latency "
                            f"{1e3 * (m['avg_token_latency_s'] or 0):7.2f} ms, modes {m['mode_share']}, "
                            f"{m['switches']} switches {clock.ran(time.monotonic() - t0)}")
                write_report(out, meta, spread, rows, policies)
        write_report(out, meta, spread, rows, policies)
    log(f"report: {out / 'report.md'}")
    return 0


def _device_name(engine) -> str:
    if engine.device.type != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(engine.device)


if __name__ == "__main__":
    sys.exit(main())
