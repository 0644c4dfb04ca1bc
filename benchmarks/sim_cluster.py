"""The cluster simulator against real runs, then at the scale the machines here cannot reach.

    # (a) validation: replay each run of benchmarks/bench_cluster.py in the simulator on the measured table
    python benchmarks/sim_cluster.py validate --costs benchmarks/results/cluster-costs-h100.json \\
        --real benchmarks/results/cluster-h100x2/results.json
    # (b) scale study: the placement policies at 8 to 256 simulated GPUs, 1,000 adapters, with plots
    python benchmarks/sim_cluster.py scale --costs benchmarks/results/cluster-costs-h100.json
    # calibration: fit the served path's costs on some real runs (then validate on the others)
    python benchmarks/sim_cluster.py calibrate --costs TABLE.json --real results.json --runs 2 \\
        --out-table TABLE-served.json
    # the peak rates benchmarks/bench_cluster.py searches for, predicted
    python benchmarks/sim_cluster.py peaks --costs TABLE-served.json

(a) rebuilds each real run's trace from its per-request records (arrival, adapter, input and output lengths),
runs it through the simulator with the run's replica count and policy, and compares the mean latency and
throughput as bench_cluster.py computes them (complete requests; throughput = complete requests / the last
finish since the run's start). Runs that lost requests (aborted past the drain time) are left out: the
simulator has no drain limit. The target: within 10% for 1 and 2 replicas. A run is marked cold when it is
the first to use one of its replicas (that replica's first CUDA-graph captures and kernel compilations land
in it); runs a table was calibrated on (its ``served.source``) are reported but left out of the error.

Calibration fits the table's served-path costs (vlora/cluster/costs.py, ``ServedCosts``: seconds per
iteration, per sequence in an iteration, and the delay from an iteration to the client) on the named runs,
minimizing the squared relative errors of their mean latency and mean TTFT by coordinate descent.

(b) runs every policy on the same seeded trace per setting (common random numbers): the workloads of
vlora/bench/workloads.py (S-LoRA's power-law synthetic, Punica's skewed Zipf-1.5, FastLibra's shifting hot
set) over ``--adapters`` adapters, at ``--load`` of the cluster's estimated capacity (one replica's decode
throughput at its batch cap, from the table, times the GPUs), ``--requests-per-gpu`` requests per GPU. The
batch cap of the reports is Punica's profiled cap from the table (vlora.cluster.costs.profiled_batch_cap: the
decode batch beyond which a doubled batch slows each token more than it raises throughput). Plots the output tokens per second the cluster sustains while requests
arrive (second half of the arrival window: finished requests over the whole run would count the drain after
the last arrival), mean TTFT, busy GPUs (busy GPU-seconds per second; results.json also has the GPUs that ran
anything) and migrations per request against the GPU count.

Numbers come only from a measured table (benchmarks/cluster_costs.py on a GPU); ``--test-table`` runs on a
constructed table to check the script and is labelled so in every output.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))          # bench_cluster (peaks)

from vlora.bench import workloads as W  # noqa: E402
from vlora.cluster.costs import CostTable, ReplicaLimits, ServedCosts, linear_table  # noqa: E402
from vlora.cluster.policy import POLICIES, make_policy  # noqa: E402
from vlora.cluster.sim import ClusterSim, SimResult, cycled_rank, profiled_batch_cap  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def test_table() -> CostTable:
    """Constructed costs for checking the script (not a measurement)."""
    lim = ReplicaLimits(num_pages=4000, page_tokens=16, max_num_seqs=128, max_num_batched_tokens=8192,
                        adapter_pages={8: 4, 16: 8, 32: 16, 64: 32})
    return linear_table(lim, 0.012, 0.00007, 0.0001, 0.0002, prefill=(0, 8192), decode=(0, 128),
                        adapters=(0, 128), adapter_load_s={8: 0.001, 64: 0.004}, migration_s=0.005,
                        meta={"device": "constructed test table (not a measurement)"})


def load_costs(args) -> CostTable:
    if args.test_table:
        table = test_table()
    elif not args.costs:
        raise SystemExit("--costs TABLE.json is required (benchmarks/cluster_costs.py writes it), or --test-table")
    else:
        table = CostTable.load(args.costs)
    if getattr(args, "served", None):
        table = table.with_served(CostTable.load(args.served).served)
    if getattr(args, "step_scale", None):
        table = table.scaled(*args.step_scale, note="sim_cluster.py --step-scale (the `steps` command measures it)")
    return table


def summarize(records: list[dict]) -> dict:
    """bench_cluster.py's definitions: complete requests; throughput over the last finish since the start."""
    done = [r for r in records if r["finish_reason"] == "length" and r["tokens"] == r["output_len"]]
    last = max((r["arrival_s"] + r["latency_s"] for r in done), default=0.0)
    ttft = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    return dict(requests=len(records), complete=len(done),
                mean_latency_s=statistics.fmean(r["latency_s"] for r in done) if done else None,
                mean_ttft_s=statistics.fmean(ttft) if ttft else None,
                throughput_rps=len(done) / last if last > 0 else None)


def sim_records(res: SimResult) -> list[dict]:
    return [dict(arrival_s=r.arrival, adapter=r.spec.adapter, input_len=r.spec.input_len,
                 output_len=r.spec.output_len, ttft_s=r.ttft, latency_s=r.latency,
                 tokens=r.generated, finish_reason=r.finish_reason, replica=r.replica, moves=r.migrations)
            for r in res.requests]


def rel_err(sim: float | None, real: float | None) -> float | None:
    if sim is None or not real:
        return None
    return (sim - real) / real


# -- (a) validation -----------------------------------------------------------------------------------
def complete(recs: list[dict]) -> bool:
    return bool(recs) and all(r["finish_reason"] == "length" and r["tokens"] == r["output_len"] for r in recs)


def policy_of(name: str, capped_affinity: bool = False):
    """The placement policy ``name``; ``capped_affinity``: affinity holding requests at the front while every
    replica is at its batch cap, as commit 9830b47 and earlier ran it (their runs replay so)."""
    return make_policy(name, capped=True) if capped_affinity and name == "affinity" else make_policy(name)


def replay(costs: CostTable, run: dict, ranks: tuple[int, ...], report_s: float,
           batch_cap: int | None = None, capped_affinity: bool = False) -> tuple[SimResult, dict, dict]:
    """A real run's trace through the simulator with its replica count, policy and the batch cap its replicas
    reported (None: the engine's max_num_seqs): (result, simulated summary, real summary)."""
    recs = run["records"]
    specs = sorted((W.RequestSpec(r["arrival_s"], r["adapter"], r["input_len"], r["output_len"]) for r in recs),
                   key=lambda s: s.arrival_s)
    sim = ClusterSim(costs, run["replicas"], policy_of(run["policy"], capped_affinity), report_s=report_s,
                     batch_cap=batch_cap,
                     adapter_rank=lambda a: cycled_rank(a, ranks)).run(specs)
    return sim, summarize(sim_records(sim)), summarize(recs)


def cold_runs(runs: list[dict]) -> set[int]:
    """Indices of the runs that were the first to use one of their replicas."""
    seen, cold = set(), set()
    for i, run in enumerate(runs):
        used = {x for r in run.get("records") or () for x in r.get("replicas") or ()}
        if used - seen:
            cold.add(i)
        seen |= used
    return cold


def run_label(run: dict) -> str:
    return f"{run.get('popularity')} {run.get('replicas')} replica(s) {run.get('policy')} {run.get('rate')}"


def calibration_runs(costs: CostTable, real: dict) -> set[int]:
    """The runs of ``real`` the table's served costs were fitted on (none if fitted on another file)."""
    fit = costs.meta.get("served_fit") or {}
    if fit.get("real_date") and fit.get("real_date") == (real.get("meta") or {}).get("date"):
        return set(fit.get("runs", ()))
    return set()


def validate(args) -> dict:
    costs = load_costs(args)
    real = json.loads(Path(args.real).read_text())
    cfg = real.get("config", {})
    ranks = tuple(cfg.get("ranks") or (8, 16, 32, 64))
    runs = real.get("runs", [])
    cold, calib = cold_runs(runs), calibration_runs(costs, real)
    rows, skipped = [], []
    for i, run in enumerate(runs):
        recs = run.get("records") or []
        if not recs:
            continue
        if not complete(recs):
            lost = sum(1 for r in recs if not (r["finish_reason"] == "length" and r["tokens"] == r["output_len"]))
            skipped.append(dict(run=run_label(run), reason=f"{lost} requests lost (overloaded past the drain time)"))
            continue
        sim, s, r = replay(costs, run, ranks, args.report_s, real.get("batch_cap"), args.capped_affinity)
        row = dict(index=i, popularity=run.get("popularity"), replicas=run["replicas"], policy=run["policy"],
                   rate=run.get("rate"), requests=len(recs), cold=i in cold, calibration=i in calib,
                   real_mean_latency_s=r["mean_latency_s"], sim_mean_latency_s=s["mean_latency_s"],
                   real_throughput_rps=r["throughput_rps"], sim_throughput_rps=s["throughput_rps"],
                   real_mean_ttft_s=r["mean_ttft_s"], sim_mean_ttft_s=s["mean_ttft_s"],
                   real_moves=sum(x.get("moves", 0) for x in recs), sim_migrations=sim.migrations)
        row["latency_err"] = rel_err(s["mean_latency_s"], r["mean_latency_s"])
        row["throughput_err"] = rel_err(s["throughput_rps"], r["throughput_rps"])
        row["ttft_err"] = rel_err(s["mean_ttft_s"], r["mean_ttft_s"])
        rows.append(row)
    by_n = {}
    for n in sorted({r["replicas"] for r in rows}):
        for key, sel in ((str(n), [r for r in rows if r["replicas"] == n and not r["calibration"]]),
                         (f"{n} warm", [r for r in rows if r["replicas"] == n and not r["calibration"]
                                        and not r["cold"]])):
            if sel:
                by_n[key] = errors(sel)
    out = dict(costs=args.costs or "test table", costs_meta=costs.meta, served=vars(costs.served),
               real=str(args.real), real_meta=real.get("meta"), report_s=args.report_s, rows=rows, by_replicas=by_n,
               skipped=skipped)
    print("\n  # popularity replicas policy          rate   lat real / sim (err)      TTFT real / sim (err)"
          "       tput real / sim (err)")
    for r in rows:
        mark = "calibration" if r["calibration"] else "cold" if r["cold"] else ""
        print(f"{r['index']:>3} {r['popularity'] or '-':10s} {r['replicas']:>8} {r['policy']:14s} {r['rate'] or 0:6.2f}  "
              f"{r['real_mean_latency_s']:6.3f} / {r['sim_mean_latency_s']:6.3f} ({r['latency_err']:+6.1%})  "
              f"{r['real_mean_ttft_s']:6.3f} / {r['sim_mean_ttft_s']:6.3f} ({r['ttft_err']:+6.1%})  "
              f"{r['real_throughput_rps']:6.2f} / {r['sim_throughput_rps']:6.2f} ({r['throughput_err']:+6.1%})  {mark}")
    for n, v in by_n.items():
        print(f"{n} replica(s): {v['runs']} runs, mean |error| latency {v['mean_abs_latency_err']:.1%} "
              f"(max {v['max_abs_latency_err']:.1%}), TTFT {v['mean_abs_ttft_err']:.1%}, throughput "
              f"{v['mean_abs_throughput_err']:.1%}; {v['within_10pct']} within 10% on latency and throughput")
    if skipped:
        print(f"left out: {len(skipped)} runs that lost requests")
    return out


def errors(rows: list[dict]) -> dict:
    return dict(runs=len(rows), mean_abs_latency_err=statistics.fmean(abs(r["latency_err"]) for r in rows),
                max_abs_latency_err=max(abs(r["latency_err"]) for r in rows),
                mean_abs_ttft_err=statistics.fmean(abs(r["ttft_err"]) for r in rows),
                mean_abs_throughput_err=statistics.fmean(abs(r["throughput_err"]) for r in rows),
                within_10pct=sum(abs(r["latency_err"]) <= 0.1 and abs(r["throughput_err"]) <= 0.1 for r in rows))


# -- calibration ----------------------------------------------------------------------------------------
FIT_START = (0.002, 0.0001, 0.02)      # iteration_s, seq_s, stream_s: where the descent starts
FIT_STEP = (0.001, 0.00005, 0.01)      # and its first steps (halved each round)


def measured_stream_s(runs: list[dict]) -> float | None:
    """Mean seconds from a first token leaving its replica to the front, over the requests of ``runs`` that
    recorded both (bench_cluster.py's stamps); None when none did."""
    gaps = [r["first_token_front_s"] - r["first_token_replica_s"] for run in runs for r in run.get("records") or ()
            if r.get("first_token_front_s") is not None and r.get("first_token_replica_s") is not None]
    return statistics.fmean(gaps) if gaps else None


def step_gaps(run: dict, idle_s: float = 0.05) -> dict | None:
    """What a run's engine step logs say of the served loop: per step, the time from its end to the next step's
    start (the async engine's loop, the actor's outputs, under one interpreter lock), fitted as a line in the
    step's outputs over consecutive steps less than ``idle_s`` apart; and the mean Engine.step time."""
    pts, steps_s = [], []
    for log_ in (run.get("steps") or {}).values():
        for (b0, d0, n0, _), (b1, _, _, _) in zip(log_, log_[1:]):
            steps_s.append(d0)
            gap = b1 - b0 - d0
            if 0 <= gap < idle_s:
                pts.append((n0, gap))
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(n for n, _ in pts), statistics.fmean(g for _, g in pts)
    var = sum((n - mx) ** 2 for n, _ in pts)
    slope = sum((n - mx) * (g - my) for n, g in pts) / var if var else 0.0
    return dict(steps=len(pts), mean_gap_s=my, gap_per_step_s=my - slope * mx, gap_per_output_s=slope,
                mean_step_s=statistics.fmean(steps_s))


def fit_served(costs: CostTable, runs: list[dict], ranks: tuple[int, ...], report_s: float,
               rounds: int = 6, stream_s: float | None = None,
               batch_cap: int | None = None, capped_affinity: bool = False) -> tuple[ServedCosts, float]:
    """Served-path costs (per iteration, per sequence, stream delay; all >= 0) that make the simulated mean
    latency and mean TTFT of ``runs`` closest to the real ones (sum of squared relative errors), by coordinate
    descent with steps halved each round. ``stream_s``: the stream delay as measured (then not fitted).
    Returns them and the objective."""
    def objective(x) -> float:
        table = costs.with_served(ServedCosts(x[0], x[1], 0.0, x[2]))
        total = 0.0
        for run in runs:
            _, s, r = replay(table, run, ranks, report_s, batch_cap, capped_affinity)
            total += (s["mean_latency_s"] / r["mean_latency_s"] - 1) ** 2 + (s["mean_ttft_s"] / r["mean_ttft_s"] - 1) ** 2
        return total

    x, steps = list(FIT_START), list(FIT_STEP)
    free = range(3)
    if stream_s is not None:
        x[2], free = stream_s, range(2)
    best = objective(x)
    for _ in range(rounds):
        moved = True
        while moved:
            moved = False
            for k in free:
                for sign in (1, -1):
                    y = list(x)
                    y[k] = max(0.0, y[k] + sign * steps[k])
                    v = objective(y)
                    if v < best - 1e-12:
                        best, x, moved = v, y, True
        steps = [s / 2 for s in steps]
    return ServedCosts(x[0], x[1], 0.0, x[2]), best


def calibrate(args) -> dict:
    costs = load_costs(args)
    real = json.loads(Path(args.real).read_text())
    runs = real.get("runs", [])
    ranks = tuple(real.get("config", {}).get("ranks") or (8, 16, 32, 64))
    for i in args.runs:
        if not 0 <= i < len(runs) or not complete(runs[i].get("records") or []):
            raise SystemExit(f"run {i}: not a run of {args.real} with every request complete")
    chosen = [runs[i] for i in args.runs]
    t0 = time.perf_counter()
    stream = None if args.fit_stream else measured_stream_s(chosen)
    served, obj = fit_served(costs, chosen, ranks, args.report_s, stream_s=stream, batch_cap=real.get("batch_cap"),
                             capped_affinity=args.capped_affinity)
    labels = ", ".join(f"#{i} ({run_label(runs[i])})" for i in args.runs)
    how = "the stream delay measured from the runs' stamps, the rest " if stream is not None else ""
    served = ServedCosts(served.iteration_s, served.seq_s, served.submit_s, served.stream_s,
                         source=f"{how}fitted by sim_cluster.py calibrate on runs {labels} of {args.real} "
                                f"({(real.get('meta') or {}).get('date')})")
    gaps = {i: step_gaps(runs[i]) for i in args.runs}
    for i, g in gaps.items():
        if g is not None:
            print(f"run {i}: {g['steps']} busy steps, Engine.step {g['mean_step_s'] * 1e3:.2f} ms on average, then "
                  f"{g['gap_per_step_s'] * 1e3:.3f} ms + {g['gap_per_output_s'] * 1e3:.4f} ms per output to the next")
    table = costs.with_served(served)
    table.meta = dict(costs.meta, served_fit=dict(real=str(args.real), real_date=(real.get("meta") or {}).get("date"),
                                                  runs=list(args.runs), objective=obj))
    out_table = args.out_table or (args.out or RESULTS / "sim-cluster-calibrate") / "costs-served.json"
    out_table.parent.mkdir(parents=True, exist_ok=True)
    table.save(out_table)
    print(f"served path: {served.iteration_s * 1e3:.3f} ms per iteration, {served.seq_s * 1e3:.4f} ms per sequence, "
          f"{served.stream_s * 1e3:.1f} ms to the client (objective {obj:.4g}, {time.perf_counter() - t0:.0f} s)")
    print(f"table: {out_table}")
    return dict(costs=args.costs, real=str(args.real), runs=list(args.runs), served=vars(served), objective=obj,
                measured_stream_s=stream, step_gaps=gaps, table=str(out_table))


# -- engine steps against the table -------------------------------------------------------------------
def run_steps(run: dict, bare: CostTable) -> list[dict]:
    """Each engine step of a run (its replicas' step logs) with what the table prices it at. The step log has no
    batch composition, so it is rebuilt from the requests: a request's prefill is in the last step on its first
    replica that ended before its first token left (prompts fit one step's token budget); the step's decodes are
    its outputs less those prefills; its adapters and KV context are those of the requests on the replica then
    (from the first token leaving to the end, the tokens so far taken as growing evenly)."""
    recs = [r for r in run.get("records") or () if r.get("first_token_replica_s") is not None and r.get("replicas")]
    out = []
    for rid, log_ in (run.get("steps") or {}).items():
        mine = sorted((r for r in recs if r["replicas"][0] == int(rid)), key=lambda r: r["first_token_replica_s"])
        ends = [b + d for b, d, _, _ in log_]
        pre = [[] for _ in log_]
        for r in mine:
            k = bisect.bisect_right(ends, r["first_token_replica_s"] + 1e-6) - 1
            if k >= 0:
                pre[k].append(r)
        firsts = [r["first_token_replica_s"] for r in mine]
        for k, (began, seconds, outputs, _) in enumerate(log_):
            prefill = sum(r["input_len"] for r in pre[k])
            decodes = max(0, outputs - len(pre[k]))
            adapters, context = set(), 0
            for r in mine[:bisect.bisect_right(firsts, began)]:
                t0 = r["first_token_replica_s"]
                t1 = r["arrival_s"] + r["latency_s"] if r.get("latency_s") is not None else run.get("wall_s", began)
                if t1 >= began:
                    adapters.add(r["adapter"])
                    context += r["input_len"] + int(r["output_len"] * min(1.0, (began - t0) / max(t1 - t0, 1e-9)))
            adapters |= {r["adapter"] for r in pre[k]}
            table_s = bare.step(prefill, decodes, len(adapters), context, decodes + len(pre[k]))
            out.append(dict(seconds=seconds, table_s=table_s, prefill=prefill, prefills=len(pre[k]), decodes=decodes))
    return out


def ratio(rows: list[dict]) -> float | None:
    table = sum(r["table_s"] for r in rows)
    return sum(r["seconds"] for r in rows) / table if table else None


def steps(args) -> dict:
    """The real runs' Engine.step times against the table's (bare: the grid times Engine.step alone): the ratio
    for decode-only iterations (graph replay) and for iterations with a prefill (eager), by batch; the factors
    ``--step-scale`` takes to carry the table over to the runs' GPU."""
    bare = load_costs(args).with_served(ServedCosts())
    real = json.loads(Path(args.real).read_text())
    rows = [x for run in real.get("runs", []) for x in run_steps(run, bare)]
    if not rows:
        raise SystemExit(f"{args.real} has no step logs (bench_cluster.py records them from 2026-11-26 on)")
    decode = [x for x in rows if not x["prefills"] and x["decodes"]]
    prefill = [x for x in rows if x["prefills"]]
    groups = []
    for lo, hi in ((1, 8), (8, 32), (32, 64), (64, 128), (128, 1 << 30)):
        sel = [x for x in decode if lo <= x["decodes"] < hi]
        if sel:
            groups.append(dict(kind="decode only", decodes=f"{lo}-{hi - 1 if hi < 1 << 30 else ''}", steps=len(sel),
                               real_ms=1e3 * statistics.fmean(x["seconds"] for x in sel),
                               table_ms=1e3 * statistics.fmean(x["table_s"] for x in sel), ratio=ratio(sel)))
    for n in sorted({x["prefills"] for x in prefill}):
        sel = [x for x in prefill if x["prefills"] == n]
        if len(sel) >= 20:
            groups.append(dict(kind=f"{n} prefill(s)", decodes=f"{statistics.fmean(x['decodes'] for x in sel):.0f}",
                               steps=len(sel), real_ms=1e3 * statistics.fmean(x["seconds"] for x in sel),
                               table_ms=1e3 * statistics.fmean(x["table_s"] for x in sel), ratio=ratio(sel)))
    gaps = [g for g in (step_gaps(run) for run in real.get("runs", [])) if g]
    res = dict(real=str(args.real), real_meta=real.get("meta"), costs=args.costs, costs_meta=bare.meta,
               steps=len(rows), decode_ratio=ratio(decode), prefill_ratio=ratio(prefill), groups=groups,
               loop_gap_ms=1e3 * statistics.fmean(g["mean_gap_s"] for g in gaps) if gaps else None,
               stream_ms=1e3 * (measured_stream_s(real.get("runs", [])) or 0))
    print(f"{len(rows)} steps of {args.real} ({(real.get('meta') or {}).get('device')}) against {args.costs}")
    print("kind            decodes  steps  real ms  table ms  real/table")
    for g in groups:
        print(f"{g['kind']:15s} {g['decodes']:>7} {g['steps']:6d} {g['real_ms']:8.1f} {g['table_ms']:9.1f} "
              f"{g['ratio']:10.2f}")
    print(f"real/table over all decode-only steps {res['decode_ratio']:.2f}, over all steps with a prefill "
          f"{res['prefill_ratio']:.2f}: --step-scale {res['decode_ratio']:.2f},{res['prefill_ratio']:.2f}")
    if gaps:
        print(f"between steps (the served loop): {res['loop_gap_ms']:.2f} ms on average; first token from replica "
              f"to front {res['stream_ms']:.1f} ms on average")
    if args.out_table:
        # the served loop's own work shows inside Engine.step (same process, one interpreter lock), which the
        # factors already carry: the served costs are only the measured gap between steps and the stream delay
        date = (real.get("meta") or {}).get("date")
        served = ServedCosts(iteration_s=(res["loop_gap_ms"] or 0) / 1e3, stream_s=res["stream_ms"] / 1e3,
                             source=f"measured by sim_cluster.py steps on {args.real} ({date}): the mean gap between "
                                    f"engine steps and the mean first-token delay from replica to front")
        table = bare.scaled(res["decode_ratio"], res["prefill_ratio"],
                            note=f"measured by sim_cluster.py steps: Engine.step times of {args.real} ({date}, "
                                 f"{(real.get('meta') or {}).get('device')}) over this table's").with_served(served)
        args.out_table.parent.mkdir(parents=True, exist_ok=True)
        table.save(args.out_table)
        res["table"] = str(args.out_table)
        print(f"table scaled to these runs: {args.out_table}")
    return res


# -- the peak rates bench_cluster.py searches, simulated -----------------------------------------------
def peaks(args) -> dict:
    """bench_cluster.py's peak search (its workload, seeds, target and search) on the simulator: the peaks a
    GPU run of it should find, per popularity, replica count and policy."""
    import bench_cluster as B

    costs = load_costs(args)
    b = B.parse_args(["--out", "-", "--popularities", args.popularities, "--policies", args.policies])
    cap = args.batch_cap or profiled_batch_cap(costs)
    ranks = tuple(b.ranks)

    def meets(popularity: str, replicas: int, policy: str, rate: float, seed: int) -> dict:
        specs = B.workload(b, popularity, rate, b.duration, seed)
        res = ClusterSim(costs, replicas, policy_of(policy, args.capped_affinity), report_s=args.report_s,
                         batch_cap=cap,
                         adapter_rank=lambda a: cycled_rank(a, ranks)).run(specs)
        m = res.metrics()
        return dict(rate=rate, mean_ttft_s=m["mean_ttft_s"], mean_latency_s=m["mean_latency_s"],
                    meets=m["mean_ttft_s"] <= b.ttft_slo and m["unserved"] == 0)

    def search(popularity: str, replicas: int, policy: str, start: float) -> dict:
        rate, met, missed, runs = start, None, None, []
        while rate is not None and len(runs) < b.max_points:
            row = meets(popularity, replicas, policy, rate, b.seed + len(runs))
            runs.append(row)
            if row["meets"]:
                met = rate if met is None else max(met, rate)
            else:
                missed = rate if missed is None else min(missed, rate)
            rate = B.next_rate(rate, met, missed, b.resolution)
        log(f"{popularity:6s} {replicas} replica(s) {policy:13s}: peak {met or 0:7.2f} req/s (lowest miss "
            f"{missed or 0:.2f}, {len(runs)} runs)")
        return dict(popularity=popularity, replicas=replicas, policy=policy, peak_rps=met, lowest_miss_rps=missed,
                    runs=runs)

    rows = []
    for popularity in b.popularities:
        one = search(popularity, 1, "round_robin", b.start_rate)
        rows.append(one)
        for policy in b.policies:
            rows.append(search(popularity, b.replicas, policy, b.replicas * (one["peak_rps"] or b.start_rate)))
    return dict(costs=args.costs or "test table", costs_meta=costs.meta, served=vars(costs.served), batch_cap=cap,
                bench_settings={k: v for k, v in vars(b).items() if k != "out"}, peaks=rows)


# -- (b) scale study ----------------------------------------------------------------------------------
WORKLOADS = ("synthetic", "skewed", "dynamic")


def capacity_rps(costs: CostTable, batch_cap: int, mean_in: float, mean_out: float) -> float:
    """One replica's request rate at its batch cap: decodes at the cap (or as many as the KV holds), each
    request's prefill on top. An estimate to set the load, not a result."""
    seqs = max(1, min(batch_cap, costs.limits.num_pages * costs.limits.page_tokens // int(mean_in + mean_out)))
    adapters = min(seqs, costs.adapters[-1])
    step = costs.step(0, seqs, adapters, int(seqs * (mean_in + mean_out / 2)))
    prefill = costs.step(int(mean_in), 0, 1) - costs.step(0, 0, 0)
    return 1.0 / (step / seqs * mean_out + max(prefill, 0.0))


def trace(kind: str, n_adapters: int, rate: float, duration: float, seed: int,
          input_range=(8, 512), output_range=(8, 512)) -> list[W.RequestSpec]:
    if kind == "synthetic":      # S-LoRA §7.2: power law alpha 1, Gamma cv 1
        return W.synthetic(n_adapters, 1.0, 1.0, rate, duration, input_range, output_range, seed)
    if kind == "skewed":         # Punica §7: Zipf-1.5 popularity, Poisson
        return W.synthetic(n_adapters, rate=rate, duration_s=duration, input_range=input_range,
                           output_range=output_range, seed=seed, shares=W.popularity_shares(n_adapters, "skewed"))
    if kind == "dynamic":        # FastLibra §6.2: the hot set shifts (a tenth of the adapters, then a fifth)
        half = duration / 2
        return W.dynamic_popularity([(half, max(1, n_adapters // 10)), (half, max(1, n_adapters // 5))],
                                    n_adapters, rate, input_range=input_range, output_range=output_range, seed=seed)
    raise ValueError(f"unknown workload {kind!r} ({', '.join(WORKLOADS)})")


def scale(args) -> dict:
    costs = load_costs(args)
    cap = args.batch_cap or profiled_batch_cap(costs)
    mean_in, mean_out = sum(args.input_range) / 2, sum(args.output_range) / 2
    per_gpu = args.rate_per_gpu or args.load * capacity_rps(costs, cap, mean_in, mean_out)
    log(f"batch cap {cap}; {per_gpu:.2f} req/s per GPU ({'given' if args.rate_per_gpu else f'{args.load:.0%} of the estimated capacity'})")
    rows = []
    t_all = time.perf_counter()
    for kind in args.workloads:
        for gpus in args.gpus:
            rate = per_gpu * gpus
            duration = args.requests_per_gpu * gpus / rate
            specs = trace(kind, args.adapters, rate, duration, args.seed, tuple(args.input_range),
                          tuple(args.output_range))
            for policy in args.policies:
                t0 = time.perf_counter()
                res = ClusterSim(costs, gpus, policy_of(policy, args.capped_affinity), report_s=args.report_s,
                                 batch_cap=cap).run(specs)
                m = res.metrics()
                m.update(workload=kind, rate_rps=rate, arrivals_s=duration, adapters=args.adapters,
                         migrations_per_request=m["migrations"] / max(1, m["requests"]),
                         wall_s=time.perf_counter() - t0)
                rows.append(m)
                log(f"{kind:9s} {gpus:>4} GPUs {policy:13s}: {m['window_tok_s'] or 0:9.0f} tok/s, mean TTFT "
                    f"{m['mean_ttft_s']:7.3f} s, busy GPUs {m['mean_busy_gpus']:6.1f} (used {m['gpus_used']}), "
                    f"{m['migrations']} migrations  [{m['wall_s']:.1f} s]")
    out = dict(costs=args.costs or "test table", costs_meta=costs.meta, served=vars(costs.served), batch_cap=cap,
               rate_per_gpu=per_gpu,
               settings={k: v for k, v in vars(args).items() if k not in ("func",)}, rows=rows,
               wall_s=time.perf_counter() - t_all)
    return out


def plot_scale(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    kinds = sorted({r["workload"] for r in rows}, key=WORKLOADS.index)
    panels = [("window_tok_s", "output tok/s while requests arrive"), ("mean_ttft_s", "mean TTFT (s)"),
              ("mean_busy_gpus", "GPUs busy (mean)"), ("migrations_per_request", "migrations per request")]
    fig, axes = plt.subplots(len(kinds), len(panels), figsize=(4 * len(panels), 3.2 * len(kinds)), squeeze=False)
    for i, kind in enumerate(kinds):
        for j, (key, label) in enumerate(panels):
            ax = axes[i][j]
            for pol in sorted({r["policy"] for r in rows}):
                pts = sorted((r["gpus"], r[key]) for r in rows if r["workload"] == kind and r["policy"] == pol)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=pol)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs")
            ax.set_title(f"{kind}: {label}", fontsize=9)
            if key == "mean_ttft_s":
                ax.set_yscale("log")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    src = res["costs_meta"].get("device", "?")
    if any(v for k, v in (res.get("served") or {}).items() if k != "source"):
        src += "; served path calibrated"
    fig.suptitle(f"simulated cluster, {res['settings']['adapters']} adapters, {res['rate_per_gpu']:.2f} req/s per "
                 f"GPU, batch cap {res['batch_cap']} (cost table: {src})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def csv_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--costs", help="cost table JSON written by benchmarks/cluster_costs.py")
    common.add_argument("--test-table", action="store_true",
                        help="a constructed table instead of --costs (checks the script; its numbers mean nothing)")
    common.add_argument("--served", default=None,
                        help="take the served path's costs from this table (one that calibrate wrote) instead of those of --costs")
    common.add_argument("--report-s", type=float, default=0.05,
                        help="seconds between replica reports (the cluster's report_interval_s)")
    common.add_argument("--step-scale", type=csv_floats, default=None, metavar="DECODE[,PREFILL]",
                        help="multiply the table's iteration times by DECODE where an iteration has no prefill and by "
                             "PREFILL (default DECODE) where it has one: a table of one GPU carried over to another "
                             "(the steps command measures the factors)")
    common.add_argument("--capped-affinity", action="store_true",
                        help="run affinity holding requests at the front while every replica is at its batch cap "
                             "(as commit 9830b47 and earlier did: replays of their runs)")
    common.add_argument("--out", type=Path, default=None, help="folder for the JSON (and plots)")
    v = sub.add_parser("validate", parents=[common], help="replay real cluster runs and report the error")
    v.add_argument("--real", required=True, help="results.json of benchmarks/bench_cluster.py")
    c = sub.add_parser("calibrate", parents=[common],
                       help="fit the served path's costs on some real runs; writes the table with them")
    c.add_argument("--real", required=True, help="results.json of benchmarks/bench_cluster.py")
    c.add_argument("--runs", type=csv_ints, required=True,
                   help="indices (0-based, the order of results.json's runs) of the runs to fit on")
    c.add_argument("--out-table", type=Path, default=None,
                   help="table JSON to write (default: OUT/costs-served.json)")
    c.add_argument("--fit-stream", action="store_true",
                   help="fit the stream delay even when the runs' stamps measure it (first token leaving the "
                        "replica to reaching the front)")
    t = sub.add_parser("steps", parents=[common],
                       help="real runs' engine step times against the table (the factors for --step-scale)")
    t.add_argument("--real", required=True, help="results.json of benchmarks/bench_cluster.py (with step logs)")
    t.add_argument("--out-table", type=Path, default=None,
                   help="write the table scaled by the measured factors, with the served costs measured on the runs")
    k = sub.add_parser("peaks", parents=[common], help="bench_cluster.py's peak-rate search, simulated")
    k.add_argument("--popularities", default="zipf,skewed", help="adapter popularities (zipf, skewed)")
    k.add_argument("--policies", default="consolidate,affinity,round_robin,least_loaded",
                   help="placement policies with all replicas")
    k.add_argument("--batch-cap", type=int, default=None, help="batch cap in the reports (default: profiled)")
    s = sub.add_parser("scale", parents=[common], help="the policies at 8-256 simulated GPUs, with plots")
    s.add_argument("--gpus", type=csv_ints, default=[8, 32, 128, 256], help="cluster sizes")
    s.add_argument("--policies", default=",".join(POLICIES), help="placement policies to compare")
    s.add_argument("--workloads", default="synthetic,skewed", help=f"workloads ({', '.join(WORKLOADS)})")
    s.add_argument("--adapters", type=int, default=1000, help="adapters (ranks 8, 16, 32, 64 in turn)")
    s.add_argument("--load", type=float, default=0.7, help="request rate as a share of the estimated capacity")
    s.add_argument("--rate-per-gpu", type=float, default=None, help="request rate per GPU (overrides --load)")
    s.add_argument("--requests-per-gpu", type=int, default=200,
                   help="requests per simulated GPU (sets the arrival window: long enough for the batches to reach "
                        "steady state; the run's cost grows with it)")
    s.add_argument("--input-range", type=csv_ints, default=[8, 512], help="MIN,MAX prompt tokens")
    s.add_argument("--output-range", type=csv_ints, default=[8, 512], help="MIN,MAX output tokens")
    s.add_argument("--batch-cap", type=int, default=None, help="batch cap in the reports (default: profiled)")
    s.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.cmd == "scale":
        a.policies = a.policies.split(",")
        a.workloads = a.workloads.split(",")
        for pol in a.policies:
            if pol not in POLICIES:
                p.error(f"unknown policy {pol!r} ({', '.join(POLICIES)})")
        for w in a.workloads:
            if w not in WORKLOADS:
                p.error(f"unknown workload {w!r} ({', '.join(WORKLOADS)})")
    return a


def main(argv=None) -> dict:
    args = parse(argv)
    res = {"validate": validate, "calibrate": calibrate, "peaks": peaks, "scale": scale, "steps": steps}[args.cmd](args)
    res["test_table"] = bool(args.test_table)
    out = args.out or RESULTS / f"sim-cluster-{args.cmd}{'-test-table' if args.test_table else ''}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    if args.cmd == "scale":
        plot_scale(res, out / "scale.png")
        print("\nworkload   GPUs policy          tok/s*  req/s**  mean TTFT  busy GPUs  used  migr/req")
        for r in res["rows"]:
            print(f"{r['workload']:9s} {r['gpus']:>5} {r['policy']:13s} {r['window_tok_s'] or 0:8.0f} "
                  f"{r['throughput_rps']:7.1f} "
                  f"{r['mean_ttft_s']:10.3f} {r['mean_busy_gpus']:10.1f} {r['gpus_used']:5d} "
                  f"{r['migrations_per_request']:9.2f}")
        print("* output tokens per second over the second half of the arrival window; ** finished requests per "
              "second from the first arrival to the last finish (includes the drain)")
    print(f"\nwritten: {out}/results.json" + (" (constructed test table: not a measurement)" if args.test_table
                                             else ""))
    return res


if __name__ == "__main__":
    main()
