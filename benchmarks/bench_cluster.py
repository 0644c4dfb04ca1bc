"""A cluster of engine replicas on Ray: peak request rate per placement policy, 1 vs 2 replicas, and a replica
killed mid-run.

Setting (issue 32): random weights of a Llama-2-7B-shaped model in bf16, ``--adapters`` random adapters
(ranks ``--ranks``, projections ``--targets``), requests of the synthetic workload of vlora/bench/workloads.py
(Gamma arrivals, cv 1, lengths uniform in ``--input-range`` / ``--output-range``, greedy with ignore_eos) under
two popularities: zipf (adapter i's share proportional to 1/(i+1)) and skewed (the most popular adapter gets
``--skewness`` of the requests, the others share the rest).

One cluster of ``--replicas`` replicas (TP=1, one GPU each through Ray's num_gpus) serves every run; a
"1 replica" run restricts placement to replica 0, so both sides pay the same front and Ray costs. Before
the sweep a warm-up burst (``--warmup-requests`` per replica, at once) runs every replica through the batch
sizes of the runs, so that CUDA-graph captures and kernel compilations do not land in a measured run.

For each (popularity, replicas, policy) the peak rate is searched: a run meets the target when its mean TTFT
is at most ``--ttft-slo`` with every request complete. From the first rate (``--start-rate`` per replica for
one replica; twice one replica's peak for all replicas) the rate doubles until a run misses (or halves until
one meets), then the bracket is bisected (geometric mean) until its ends are within ``--resolution`` of
each other; the peak is the highest rate that met the target. A run stops as soon as its mean TTFT is sure
to miss (the TTFTs so far, counting the requests still waiting at their wait so far, exceed the target
times the requests of the run), so overloaded runs cost little. 1-replica runs do not depend on the policy
and run once per popularity. Last, the kill run: all replicas under ``--kill-policy`` at ``--kill-load`` of
its peak rate, the last replica killed (ray.kill; Ray restarts it) ``--kill-at`` of the way in: requests
lost (not finished with all their tokens), failovers, the latency of requests in flight at the kill against
the others, and when the replica rejoined.

Runs are ordered by importance and skipped once ``--budget-s`` would be exceeded (the kill run keeps its
share). After every run results.json (config, every run with its per-request records and each replica's
engine steps, peaks, the kill run, the trace format) and summary.md are written again, so a run cut short
keeps what finished.

    python benchmarks/bench_cluster.py --popularities zipf --out benchmarks/results/cluster-h100x2   # 2 GPUs
    python benchmarks/bench_cluster.py --dry-run --out /tmp/cluster-dry            # tiny model on CPUs: ~1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from vlora.bench.workloads import skewed_shares, synthetic  # noqa: E402
from vlora.cluster.observer import FrontObserver  # noqa: E402
from vlora.cluster.policy import POLICIES, make_policy  # noqa: E402
from vlora.sampling_params import SamplingParams  # noqa: E402

TRACE_FORMAT = {
    "arrival_s": "when the request was due, seconds from the start of its run (open loop: sent then)",
    "adapter": "adapter name (a0 the most popular)",
    "input_len": "prompt tokens (random ids)",
    "output_len": "tokens asked for (max_tokens, ignore_eos: every request generates them all)",
    "ttft_s": "first token received at the front minus arrival_s (null: none came)",
    "latency_s": "last token received minus arrival_s (null: it did not finish)",
    "tokens": "tokens received",
    "finish_reason": "length when complete; abort / error / null otherwise",
    "replicas": "replica ids that served it, in order (more than one: it migrated or failed over)",
    "moves": "migrations and failovers it went through",
    "placed_s": "when the front's policy first placed it (seconds from the start of its run; null: never)",
    "submitted_s": "when the front had a replica's acceptance (the reply to its submit call; the first token may "
                   "already have left the replica)",
    "first_token_replica_s": "when its first token left the replica (the replica's output list was sent)",
    "first_token_front_s": "when its first token reached the front (arrival_s + ttft_s: when the client had it)",
}
STEP_FORMAT = ("each run's steps[replica id]: [began_s, seconds, outputs, running] per engine step of that replica: "
               "when it began (from the start of the run), how long Engine.step took, the outputs it gave, the "
               "sequences running after it")
DRY_RUN = dict(model="random:tiny-llama", dtype="float32", device="cpu", adapters=4, ranks="4,8",
               input_range="4,24", output_range="4,16", duration=2.0, start_rate=4.0, max_points=2,
               kill_duration=4.0, budget_s=120.0, num_blocks=64, ray_num_cpus=2, drain_s=20.0, rejoin_wait=0.0,
               warmup_requests=4)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Expected duration on two H100s: start-up "
                                "about 1 min (weights, kernels, writing and loading the adapters), the warm-up, the "
                                "sweep and kill run within --budget-s, the killed replica's rejoin up to --rejoin-wait.")
    p.add_argument("--model", default="random:llama-2-7b", help="model of every replica")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="replicas' device (auto: CUDA when the replica sees a GPU)")
    p.add_argument("--replicas", type=int, default=2, help="replicas of the cluster (one GPU each)")
    p.add_argument("--adapters", type=int, default=100, help="random adapters")
    p.add_argument("--ranks", default="8,16", help="adapter ranks, round-robin")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="projections the adapters change")
    p.add_argument("--adapter-dir", default="/tmp/vlora-bench-cluster-adapters",
                   help="where the random adapters are written (reused when present)")
    p.add_argument("--popularities", default="zipf,skewed", help="adapter popularities to run: zipf, skewed")
    p.add_argument("--skewness", type=float, default=0.5, help="skewed: the most popular adapter's share")
    p.add_argument("--policies", default=None, help="placement policies (default: every one vlora.cluster knows)")
    p.add_argument("--input-range", default="8,256", help="MIN,MAX prompt tokens")
    p.add_argument("--output-range", default="8,128", help="MIN,MAX output tokens")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per run")
    p.add_argument("--drain-s", type=float, default=15.0, help="after the arrivals, seconds a run waits for its "
                   "requests before aborting the rest (they count as not meeting the TTFT target)")
    p.add_argument("--ttft-slo", type=float, default=0.5, help="mean TTFT target (s) that defines the peak rate")
    p.add_argument("--start-rate", type=float, default=8.0, help="first rate tried for one replica, req/s (all "
                   "replicas start at twice one replica's peak)")
    p.add_argument("--resolution", type=float, default=0.1, help="the search stops when the lowest rate that "
                   "missed is within this share above the highest that met the target")
    p.add_argument("--max-points", type=int, default=9, help="most rates tried per peak search")
    p.add_argument("--warmup-requests", type=int, default=256, help="requests per replica sent at once before the "
                   "sweep, so that graph captures and kernel compilations land in no measured run (0: none)")
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                   help="end with the kill run (with more than one replica)")
    p.add_argument("--kill-policy", default="round_robin", help="policy of the kill run")
    p.add_argument("--kill-load", type=float, default=0.5, help="kill run rate, as a share of its peak rate with "
                   "all replicas (0.5 of two replicas' peak: what the survivor can carry alone)")
    p.add_argument("--kill-duration", type=float, default=20.0, help="seconds of arrivals of the kill run")
    p.add_argument("--kill-at", type=float, default=0.4, help="when the replica is killed, as a share of the run")
    p.add_argument("--rejoin-wait", type=float, default=90.0, help="after the kill run, seconds to wait for the "
                   "killed replica to rejoin (its restart time is reported)")
    p.add_argument("--budget-s", type=float, default=300.0, help="seconds the sweep and the kill run may take after "
                   "start-up (runs that would not fit are skipped and listed)")
    p.add_argument("--batch-cap", type=int, default=None, help="batch cap the replicas report to the policies "
                   "(Punica's consolidation fills a replica up to it; default: profiled from --costs, else the "
                   "engine's max_num_seqs)")
    p.add_argument("--costs", default=None, help="cost table of this model and GPU (benchmarks/cluster_costs.py, "
                   "served costs included when calibrated) to profile the batch cap from")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pages per replica (default: sized to the GPU)")
    p.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="a tiny random model on CPUs, a few short runs: checks "
                   "the script end to end (defaults then: " + ", ".join(f"{k}={v}" for k, v in DRY_RUN.items()) + ")")
    p.add_argument("--out", required=True, help="folder for results.json and summary.md")
    if "--dry-run" in (sys.argv[1:] if argv is None else argv):     # its settings, unless given explicitly
        p.set_defaults(**DRY_RUN)
    args = p.parse_args(argv)
    args.ranks = tuple(int(x) for x in args.ranks.split(","))
    args.targets = tuple(args.targets.split(","))
    args.input_range = tuple(int(x) for x in args.input_range.split(","))
    args.output_range = tuple(int(x) for x in args.output_range.split(","))
    args.popularities = tuple(args.popularities.split(","))
    args.policies = tuple(args.policies.split(",")) if args.policies else tuple(POLICIES)
    for name in args.policies + (args.kill_policy,):
        if name not in POLICIES:
            p.error(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    for pop in args.popularities:
        if pop not in ("zipf", "skewed"):
            p.error(f"unknown popularity {pop!r} (zipf, skewed)")
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- set-up -----------------------------------------------------------------------------------------------
def engine_config(args):
    from vlora.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig

    # unmerged, as the simulator's replicas (vlora/cluster/sim_replica.py) and the cost tables model them
    return EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed),
                        cache=CacheConfig(num_blocks=args.num_blocks),
                        lora=LoRAConfig(max_lora_rank=max(args.ranks)), scheduler=SchedulerConfig(policy="unmerged"))


def write_adapters(args, shape) -> dict[str, str]:
    """``--adapters`` random adapters for ``shape`` under --adapter-dir/<model>/ (kept for the next run)."""
    from vlora.lora.random_adapter import write_random_adapter

    root = Path(args.adapter_dir) / shape.name / f"r{'-'.join(map(str, args.ranks))}-{'-'.join(args.targets)}"
    out = {}
    for j in range(args.adapters):
        path = root / f"a{j}"
        if not (path / "adapter_model.safetensors").is_file():
            write_random_adapter(path, shape, args.ranks[j % len(args.ranks)], seed=j, std=0.01, targets=args.targets)
        out[f"a{j}"] = str(path)
    return out


def workload(args, popularity: str, rate: float, duration: float, seed: int):
    shares = skewed_shares(args.adapters, args.skewness) if popularity == "skewed" else None
    return synthetic(args.adapters, alpha=1.0, cv=1.0, rate=rate, duration_s=duration, input_range=args.input_range,
                     output_range=args.output_range, seed=seed, shares=shares)


class Only:
    """A policy that sees only some replicas (a 1-replica run on the 2-replica cluster)."""

    def __init__(self, policy, replica_ids):
        self.policy, self.ids = policy, set(replica_ids)
        self.name = policy.name

    def place(self, request, replicas):
        return self.policy.place(request, [r for r in replicas if r.replica_id in self.ids])

    def placed(self, request, replica_id):
        self.policy.placed(request, replica_id)

    def rebalance(self, replicas, running):
        return self.policy.rebalance([r for r in replicas if r.replica_id in self.ids],
                                     {k: v for k, v in running.items() if k in self.ids})


# -- one run ----------------------------------------------------------------------------------------------
class Trace(FrontObserver):
    """What the front tells of each request (where it ran, its moves, where its TTFT went) and of the replicas'
    output streams; attached to the front for the whole benchmark."""

    def __init__(self):
        # per request id: wall-clock times of its first placement ("placed"), of its first acceptance by a
        # replica ("submitted"), and of its first token leaving the replica ("first_replica") and reaching the
        # front ("first_front")
        self.stamps: dict[str, dict[str, float]] = {}
        self.served_by: dict[str, list[int]] = {}     # replica ids that accepted it, in order
        self.moves: dict[str, int] = {}               # migrations and failovers
        self.output_lists = 0                         # lists (Ray objects) read from the replicas' output streams

    def placed(self, request_id: str, replica_id: int) -> None:
        self.stamps.setdefault(request_id, {}).setdefault("placed", time.time())

    def accepted(self, request_id: str, replica_id: int) -> None:
        self.stamps.setdefault(request_id, {}).setdefault("submitted", time.time())
        served = self.served_by.setdefault(request_id, [])
        if not served or served[-1] != replica_id:
            served.append(replica_id)

    def moved(self, request_id: str, why: str) -> None:
        self.moves[request_id] = self.moves.get(request_id, 0) + 1

    def outputs_arrived(self, replica_id: int, sent: float, received: float, request_ids: list[str]) -> None:
        self.output_lists += 1
        for rid in request_ids:
            stamps = self.stamps.setdefault(rid, {})
            if "first_replica" not in stamps:
                stamps["first_replica"], stamps["first_front"] = sent, received


async def run_load(front, specs, vocab: int, seed: int, drain_s: float, at=None, slo: float | None = None,
                   t0: list | None = None, trace: Trace | None = None) -> list[dict]:
    """Send ``specs`` open loop, each at its arrival; per-request records. ``at = (t, fn)``: ``await fn()``
    ``t`` seconds in. ``slo``: stop (aborting what is left) as soon as the mean TTFT is sure to exceed it.
    ``t0``: a list the run's start (wall clock) is appended to. ``trace``: the front's observer the records'
    replicas, moves and TTFT split come from."""
    from vlora.engine.client import Job

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(s.input_len)] for s in specs]
    records = [dict(arrival_s=s.arrival_s, adapter=s.adapter, input_len=s.input_len, output_len=s.output_len,
                    ttft_s=None, latency_s=None, tokens=0, finish_reason=None, replicas=[], moves=0,
                    placed_s=None, submitted_s=None, first_token_replica_s=None, first_token_front_s=None)
               for s in specs]
    start, wall = time.monotonic(), time.time()
    if t0 is not None:
        t0.append(wall)

    async def one(i, spec):
        rec, rid = records[i], f"bench-{seed}-{i}"
        await asyncio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
        try:
            group = await front.submit([Job(prompts[i], spec.adapter, SamplingParams(
                max_tokens=spec.output_len, ignore_eos=True), rid)])
        except Exception as e:
            rec["finish_reason"] = f"refused: {type(e).__name__}"
            return
        try:
            async for out in group:
                now = time.monotonic() - start
                if trace is not None:
                    rec["replicas"] = list(trace.served_by.get(rid, ()))
                if out.delta_token_ids and rec["ttft_s"] is None:
                    rec["ttft_s"] = now - spec.arrival_s
                    rec["first_token_front_s"] = now
                    stamps = trace.stamps.get(rid, {}) if trace is not None else {}
                    for key, name in (("placed", "placed_s"), ("submitted", "submitted_s"),
                                      ("first_replica", "first_token_replica_s")):
                        if key in stamps:
                            rec[name] = stamps[key] - wall
                rec["tokens"] = len(out.token_ids)
                if trace is not None:
                    rec["moves"] = trace.moves.get(rid, 0)
                if out.finished:
                    rec["finish_reason"] = out.finish_reason
                    rec["latency_s"] = now - spec.arrival_s
        except Exception as e:
            rec["finish_reason"] = f"error: {type(e).__name__}: {e}"[:200]
        finally:
            group.abort()

    tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(specs)]
    if at is not None:
        async def trigger():
            await asyncio.sleep(at[0])
            await at[1]()
        tasks.append(asyncio.ensure_future(trigger()))
    horizon = (specs[-1].arrival_s if specs else 0.0) + drain_s
    ends = [asyncio.gather(*tasks[:len(specs)], return_exceptions=True)]       # every request done
    if slo is not None:
        ends.append(asyncio.ensure_future(_watch_slo(records, start, slo)))    # or the target missed for sure
    await asyncio.wait(ends, timeout=horizon + 1.0, return_when=asyncio.FIRST_COMPLETED)
    pending = [t for t in tasks + ends if not t.done()]
    for t in pending:                 # overloaded: what has not finished by now is aborted (group.abort above)
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return records


async def _watch_slo(records: list[dict], start: float, slo: float) -> None:
    """Return once the run's mean TTFT is sure to exceed ``slo``: the TTFTs so far plus the waits so far of the
    requests that have arrived without a first token exceed ``slo`` times the requests of the run."""
    while True:
        await asyncio.sleep(0.1)
        now = time.monotonic() - start
        total = sum(r["ttft_s"] if r["ttft_s"] is not None else max(0.0, now - r["arrival_s"]) for r in records)
        if total > slo * len(records):
            log(f"the mean TTFT is past {slo} s whatever comes: stopping the run {now:.1f} s in")
            return


def summarize(records: list[dict], duration: float, slo: float) -> dict:
    n = len(records)
    complete = [r for r in records if r["finish_reason"] == "length" and r["tokens"] == r["output_len"]]
    ttfts = [r["ttft_s"] if r["ttft_s"] is not None else math.inf for r in records]
    lat = [r["latency_s"] for r in complete]
    finite = sorted(t for t in ttfts if math.isfinite(t))
    last = max((r["arrival_s"] + r["latency_s"] for r in complete), default=duration)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    mean_ttft = statistics.fmean(ttfts) if n else None
    return dict(requests=n, complete=len(complete), lost=n - len(complete), mean_ttft_s=mean_ttft,
                p50_ttft_s=pct(finite, 0.5), p90_ttft_s=pct(finite, 0.9), p99_ttft_s=pct(finite, 0.99),
                mean_latency_s=statistics.fmean(lat) if lat else None, p99_latency_s=pct(sorted(lat), 0.99),
                throughput_rps=len(complete) / last if last > 0 else None,
                output_tps=sum(r["tokens"] for r in complete) / last if last > 0 else None,
                moves=sum(r["moves"] for r in records),
                meets_slo=bool(n) and mean_ttft is not None and mean_ttft <= slo and len(complete) == n)


# -- the sweep --------------------------------------------------------------------------------------------
def next_rate(rate: float, met: float | None, missed: float | None, resolution: float) -> float | None:
    """The peak search's next rate after ``rate``, given the highest rate that met the target and the lowest that
    missed so far: double until one misses (halve until one meets), then the geometric mean of the two; None
    once the lowest miss is within ``resolution`` above the highest meet (or below it: noise)."""
    if met is not None and missed is not None:
        return None if missed <= met * (1 + resolution) else math.sqrt(met * missed)
    return rate * 2 if missed is None else rate / 2


class Bench:
    def __init__(self, front, args, adapters: dict[str, str], out: Path, meta: dict):
        self.front, self.args, self.adapters, self.out = front, args, adapters, out
        self.results = dict(meta=meta, config={k: v for k, v in vars(args).items()}, trace_format=TRACE_FORMAT,
                            step_format=STEP_FORMAT, batch_cap=getattr(front, "batch_cap", None), warmup=None,
                            runs=[], peaks=[], kill=None, skipped=[])
        self.t0 = time.monotonic()
        self.run_cost = args.duration + 5.0          # a run at a sustainable rate: arrivals + the last requests
        self.trace = Trace()                         # bench() attaches it to the front

    def save(self) -> None:
        """results.json and summary.md as they stand (after every run: a run cut short keeps what finished)."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        write_summary(self.results, self.out)

    def time_left(self) -> float:
        kill = 0.0 if self.results["kill"] is not None or not self.args.kill else self.args.kill_duration + 15.0
        return self.args.budget_s - (time.monotonic() - self.t0) - kill

    async def warmup(self) -> None:
        """--warmup-requests per replica at once, round robin: every replica's batch passes through the sizes of
        the runs (graph captures, kernel compilations) before any measured run."""
        a, front = self.args, self.front
        n = a.warmup_requests * len(front.replicas)
        if n <= 0:
            return
        front.policy = make_policy("round_robin")
        specs = workload(a, a.popularities[0], n, 1.0, a.seed + 999)        # about n requests within a second
        t = time.monotonic()
        records = await run_load(front, specs, front.info.vocab_size, a.seed + 999, a.drain_s, trace=self.trace)
        await front.replicas.step_logs()             # not part of any run
        done = sum(r["finish_reason"] == "length" for r in records)
        self.results["warmup"] = dict(requests=len(specs), complete=done, wall_s=time.monotonic() - t)
        log(f"warm-up: {done}/{len(specs)} requests in {time.monotonic() - t:.1f} s")

    async def run(self, popularity: str, replicas: int, policy: str, rate: float, seed: int) -> dict:
        base = make_policy(policy)
        self.front.policy = base if replicas == len(self.front.replicas) else Only(base, range(replicas))
        specs = workload(self.args, popularity, rate, self.args.duration, seed)
        t, lists, t0 = time.monotonic(), self.trace.output_lists, []
        await self.front.replicas.step_logs()        # drop what came before the run
        records = await run_load(self.front, specs, self.front.info.vocab_size, seed, self.args.drain_s,
                                 slo=self.args.ttft_slo, t0=t0, trace=self.trace)
        steps = {rid: [[round(b - t0[0], 4), round(d, 5), n, k] for b, d, n, k in log_]
                 for rid, log_ in (await self.front.replicas.step_logs()).items()}
        summary = summarize(records, self.args.duration, self.args.ttft_slo)
        row = dict(popularity=popularity, replicas=replicas, policy=policy, rate=rate, wall_s=time.monotonic() - t,
                   **summary, output_lists=self.trace.output_lists - lists, records=records, steps=steps)
        self.results["runs"].append(row)
        self.save()
        log(f"{popularity:6s} {replicas} replica(s) {policy:14s} {rate:6.2f} req/s: mean TTFT "
            f"{_fmt(summary['mean_ttft_s'])} s, {summary['complete']}/{summary['requests']} complete, "
            f"{'meets' if summary['meets_slo'] else 'misses'} the target")
        if summary["meets_slo"]:
            self.run_cost = max(self.run_cost, row["wall_s"])
        return row

    async def peak(self, popularity: str, replicas: int, policy: str, start: float) -> float | None:
        """The highest rate found whose mean TTFT meets the target (None: none did, or no time was left): from
        ``start`` the rate doubles until a run misses (halves until one meets), then the bracket is bisected
        (geometric mean) until the lowest miss is within --resolution above the highest meet."""
        a, rate = self.args, start
        met, missed, points = None, None, 0
        while points < a.max_points:
            if self.time_left() < self.run_cost:
                self.results["skipped"].append(dict(popularity=popularity, replicas=replicas, policy=policy,
                                                    rate=rate))
                log(f"out of time: skipping {popularity} {replicas} replica(s) {policy} at {rate:.2f} req/s")
                break
            row = await self.run(popularity, replicas, policy, rate, a.seed + points)
            points += 1
            if row["meets_slo"]:
                met = rate if met is None else max(met, rate)
            else:
                missed = rate if missed is None else min(missed, rate)
            rate = next_rate(rate, met, missed, a.resolution)
            if rate is None:
                break
        # bounded: a rate above the peak was tried and missed (else the peak is only a lower bound)
        self.results["peaks"].append(dict(popularity=popularity, replicas=replicas, policy=policy, peak_rps=met,
                                          bounded=missed is not None, lowest_miss_rps=missed, runs=points))
        self.save()
        return met

    async def sweep(self) -> None:
        """One replica's peak per popularity, then each policy's with all replicas, searched from twice one
        replica's peak. Order: for every popularity one replica and the first policy, then the other policies
        (what the budget leaves out comes last)."""
        a, n = self.args, len(self.front.replicas)
        ones = {}
        for popularity in a.popularities:
            ones[popularity] = await self.peak(popularity, 1, "round_robin", a.start_rate)
            if n > 1:
                await self.peak(popularity, n, a.policies[0], n * (ones[popularity] or a.start_rate))
        for policy in a.policies[1:] if n > 1 else ():
            for popularity in a.popularities:
                await self.peak(popularity, n, policy, n * (ones[popularity] or a.start_rate))

    async def kill(self) -> None:
        """All replicas under --kill-policy; the last one killed --kill-at of the way through."""
        import ray

        a, front = self.args, self.front
        victim = front.replicas[-1]
        peaks = [p["peak_rps"] for p in self.results["peaks"] if p["replicas"] == len(front.replicas)
                 and p["policy"] == a.kill_policy and p["peak_rps"]]
        rate = a.kill_load * (max(peaks) if peaks else a.start_rate * len(front.replicas))
        front.policy = make_policy(a.kill_policy)
        specs = workload(self.args, a.popularities[0], rate, a.kill_duration, a.seed + 100)
        kill_at = a.kill_at * a.kill_duration
        incarnation, failovers = victim.incarnation, front.failovers
        state = {}

        async def kill_victim():
            state["in_flight"] = set(front.requests.on_replica(victim.replica_id))
            state["killed_s"] = kill_at
            log(f"killing replica {victim.replica_id} ({len(state['in_flight'])} requests on it)")
            ray.kill(victim.actor, no_restart=False)
        t = time.monotonic()
        # the survivors carry the victim's load until it rejoins: a longer drain, so that slow is not counted lost
        records = await run_load(front, specs, front.info.vocab_size, a.seed + 100, max(a.drain_s, 60.0),
                                 (kill_at, kill_victim), trace=self.trace)
        deadline = time.monotonic() + a.rejoin_wait
        while not (victim.ready and victim.incarnation != incarnation) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        rejoined = victim.ready and victim.incarnation != incarnation
        summary = summarize(records, a.kill_duration, a.ttft_slo)
        hit = [r for i, r in enumerate(records)          # on the replica when it died, or placed on it after
               if f"bench-{a.seed + 100}-{i}" in state.get("in_flight", ()) or r["moves"]]
        before = [r for r in records if r["arrival_s"] + (r["latency_s"] or 0) < kill_at and r["latency_s"]]
        lat = lambda rs: statistics.fmean(r["latency_s"] for r in rs if r["latency_s"] is not None) \
            if any(r["latency_s"] is not None for r in rs) else None   # noqa: E731
        self.results["kill"] = dict(
            policy=a.kill_policy, rate=rate, killed_replica=victim.replica_id, killed_at_s=kill_at, **summary,
            failovers=front.failovers - failovers, requests_hit=len(hit),
            mean_latency_finished_before_kill_s=lat(before), mean_latency_on_killed_replica_s=lat(hit),
            rejoined=rejoined, rejoined_after_s=(time.monotonic() - t - kill_at) if rejoined else None,
            wall_s=time.monotonic() - t, records=records)
        self.save()
        log(f"kill run: {summary['lost']} of {summary['requests']} requests lost, {len(hit)} failed over; the "
            f"replica {'rejoined' if rejoined else 'did not rejoin in time'}")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def write_summary(results: dict, out: Path) -> Path:
    cfg = results["config"]
    lines = [f"# Cluster benchmark ({results['meta'].get('device')}, {results['meta'].get('date')})", "",
             f"Model {cfg['model']} ({cfg['dtype']}), {cfg['adapters']} adapters (ranks {cfg['ranks']}), "
             f"inputs {cfg['input_range']}, outputs {cfg['output_range']} tokens, {cfg['duration']} s of arrivals "
             f"per run; peak = highest rate tried whose mean TTFT <= {cfg['ttft_slo']} s with every request "
             "complete (>=: no rate tried missed it); the lowest rate that missed bounds it from above. Batch cap "
             f"reported by the replicas: {results.get('batch_cap') or 'max_num_seqs'}.", "",
             "| popularity | replicas | policy | peak req/s | lowest miss req/s | x one replica |",
             "|---|---|---|---|---|---|"]
    ones = {p["popularity"]: p["peak_rps"] for p in results["peaks"] if p["replicas"] == 1}
    for p in results["peaks"]:
        one = ones.get(p["popularity"])
        ratio = f"{p['peak_rps'] / one:.2f}" if p["peak_rps"] and one else "-"
        peak = ("" if p["bounded"] or p["peak_rps"] is None else ">= ") + _fmt(p["peak_rps"])
        lines.append(f"| {p['popularity']} | {p['replicas']} | {p['policy']} | {peak} | "
                     f"{_fmt(p.get('lowest_miss_rps'))} | {ratio} |")
    lines += ["", "Per run; the TTFT split (means, ms): arrival to placement by the front's policy, placement to the "
              "first token leaving the replica (the submit call, the engine's queue, the prefill), replica to front.",
              "", "| popularity | replicas | policy | rate | mean TTFT s | p99 TTFT s | mean latency s | complete | "
              "moves | placement | replica | stream |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        split = ttft_split(r["records"])
        lines.append(f"| {r['popularity']} | {r['replicas']} | {r['policy']} | {r['rate']:.2f} | "
                     f"{_fmt(r['mean_ttft_s'])} | {_fmt(r['p99_ttft_s'])} | {_fmt(r['mean_latency_s'])} | "
                     f"{r['complete']}/{r['requests']} | {r['moves']} | " + " | ".join(
                         "-" if v is None else f"{v * 1e3:.1f}" for v in split) + " |")
    k = results.get("kill")
    if k:
        lines += ["", f"Kill run ({k['policy']}, {k['rate']:.2f} req/s, replica {k['killed_replica']} killed at "
                  f"{k['killed_at_s']:.1f} s): **{k['lost']} of {k['requests']} requests lost**, "
                  f"{k['requests_hit']} were on the killed replica or sent to it before its death was seen "
                  f"({k['failovers']} failovers); mean "
                  f"latency {_fmt(k['mean_latency_finished_before_kill_s'])} s before the kill, "
                  f"{_fmt(k['mean_latency_on_killed_replica_s'])} s for the requests it hit; the replica "
                  + (f"rejoined {k['rejoined_after_s']:.1f} s after the kill." if k["rejoined"] else
                     "had not rejoined when the run ended.")]
    if results["skipped"]:
        lines += ["", f"Skipped for time: {len(results['skipped'])} runs (see results.json)."]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def ttft_split(records: list[dict]) -> tuple[float | None, float | None, float | None]:
    """Mean seconds from arrival to placement, from placement to the first token leaving the replica, and from
    there to the front, over the requests whose stamps are all there."""
    rows = [r for r in records if None not in (r.get("placed_s"), r.get("first_token_replica_s"),
                                                r.get("first_token_front_s"))]
    if not rows:
        return None, None, None
    return (statistics.fmean(r["placed_s"] - r["arrival_s"] for r in rows),
            statistics.fmean(r["first_token_replica_s"] - r["placed_s"] for r in rows),
            statistics.fmean(r["first_token_front_s"] - r["first_token_replica_s"] for r in rows))


def meta(front) -> dict:
    import ray
    import torch

    names = sorted(set(front.device_names))
    device = f"{len(front.replicas)} x {' / '.join(names)}"
    return dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=device,
                ray=ray.__version__, torch=torch.__version__, replicas=len(front.replicas))


async def bench(front, args, out: Path) -> dict:
    """The sweep and the kill run on a started ``front``; the results (also written under ``out``)."""
    adapters = write_adapters(args, front.adapter_shape)
    missing = {name: path for name, path in adapters.items() if name not in front.adapter_names}
    if missing:
        log(f"registering {len(missing)} adapters on {len(front.replicas)} replicas")
    for name, path in missing.items():
        await front.load_adapter(name, path)
    b = Bench(front, args, adapters, out, meta(front))
    front.observe(b.trace)
    await front.replicas.log_steps()
    policy = front.policy
    try:
        await b.warmup()
        b.t0 = time.monotonic()                      # the budget is the sweep's and the kill run's
        await b.sweep()
        if len(front.replicas) > 1 and args.kill:
            await b.kill()
    finally:
        front.policy = policy
        b.save()
        log(f"summary: {write_summary(b.results, out)}")
    return b.results


def main(argv=None) -> int:
    from vlora.cluster.config import ClusterConfig
    from vlora.cluster.front import ClusterFront

    args = parse_args(argv)
    out = Path(args.out)
    t = time.monotonic()
    front = ClusterFront(engine_config(args), ClusterConfig(replicas=args.replicas, ray_num_cpus=args.ray_num_cpus,
                                                            batch_cap=args.batch_cap, cost_table=args.costs,
                                                            max_restarts=-1))
    log(f"batch cap reported by the replicas: {front.batch_cap or 'the engine max_num_seqs'}")
    log(f"{args.replicas} replicas of {args.model} on {front.device} up in {time.monotonic() - t:.0f} s")
    try:
        front.set_adapters(write_adapters(args, front.adapter_shape))   # all at once, before serving
    except BaseException:
        front.close()
        raise
    log(f"{args.adapters} adapters registered on every replica; {time.monotonic() - t:.0f} s since start")

    async def go():
        front.start()
        try:
            return await bench(front, args, out)
        finally:
            await front.shutdown(5)
    asyncio.run(go())
    return 0


if __name__ == "__main__":
    sys.exit(main())
