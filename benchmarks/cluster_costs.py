"""Measure the cost table the cluster simulator runs on (vlora/cluster/costs.py): engine iterations timed on
this GPU for a grid of prefill tokens x decode batch x distinct adapters, the decode context's cost, adapter
load times per rank and the engine's side of a migration.

    python benchmarks/cluster_costs.py                 # GPU: random Llama-2-7B shape, bf16, ranks 8-64
    python benchmarks/cluster_costs.py --ranks 8,16 --targets q_proj,k_proj,v_proj,o_proj   # as bench_cluster.py
    python benchmarks/cluster_costs.py --dry-run       # CPU: a tiny random model and grid (tests run this)

The engine runs with the settings bench_cluster.py's replicas use (defaults sized to the GPU, max_lora_rank
the largest rank), so the table's limits are theirs.

Each grid cell sets up its decode batch (requests of --context prompt tokens, adapter i of the batch's
distinct adapters for request i), waits until they all decode, times decode-only steps, then for each
prefill size adds prompts (at most 1,024 tokens each) beside the decodes and times the step that prefills
them. The prefill axis ends at the engine's token budget. A cell whose prefill does not fit the budget beside
its decodes (or the sequence cap) is extrapolated along the prefill axis from the two largest that fit; a cell asking more distinct adapters than it has requests takes
the value with one adapter per request. Writes the table JSON (--out) that benchmarks/sim_cluster.py loads.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vlora.cluster.costs import CostTable, ReplicaLimits  # noqa: E402
from vlora.llm import LLM  # noqa: E402
from vlora.lora.adapter import LORA_TARGETS, ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402
from vlora.sampling_params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_CHUNK = 1024            # longest prompt the prefill cells add (several make up a larger prefill)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: the tiny random model, float32, a small grid (checks the script, measures nothing real)")
    p.add_argument("--model", default="random:llama-2-7b", help="model to time (random:<preset> or a directory)")
    p.add_argument("--dtype", default="bfloat16", help="weight and activation dtype")
    p.add_argument("--ranks", type=ints, default=[8, 16, 32, 64],
                   help="adapter ranks, given to adapters a0, a1, ... in turn (as the cluster benchmarks do)")
    p.add_argument("--targets", default=",".join(LORA_TARGETS),
                   help="projections the adapters change (bench_cluster.py's --targets, to match its runs)")
    p.add_argument("--prefill", type=ints, default=[0, 16, 256, 1024, 4096],
                   help="prefill-token grid axis; the engine's token budget is added as its last point (a small "
                        "point beside 0 prices the step from graph-replayed decodes to an eager prefill)")
    p.add_argument("--decode", type=ints, default=[0, 1, 8, 32, 64, 128, 224], help="decode-batch grid axis")
    p.add_argument("--adapters", type=ints, default=[0, 1, 4, 16, 64],
                   help="distinct-adapters grid axis (0: the base model only)")
    p.add_argument("--context", type=int, default=32, help="prompt tokens of each decoding request in the grid")
    p.add_argument("--long-context", type=int, default=1024,
                   help="prompt tokens of the decodes timed again to price the decode context")
    p.add_argument("--reps", type=int, default=3, help="timed steps per cell (the median is kept)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine setting (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine setting (default: the engine's)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help="engine setting (default: the engine's)")
    p.add_argument("--out", type=Path, default=None,
                   help="table JSON to write (default: benchmarks/results/cluster-costs-<gpu or cpu>.json)")
    a = p.parse_args(argv)
    a.targets = tuple(a.targets.split(","))
    if a.dry_run:
        a.model, a.dtype = "random:tiny-llama", "float32"
        a.prefill, a.decode, a.adapters, a.ranks = [0, 8, 32], [0, 2], [0, 1, 2], [8, 16]
        a.context, a.long_context, a.reps = 8, 24, 1
    for name in ("prefill", "decode", "adapters"):
        axis = getattr(a, name)
        if axis != sorted(set(axis)) or axis[0] != 0:
            p.error(f"--{name} must be increasing and start at 0, got {axis}")
    return a


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Bench:
    def __init__(self, args):
        self.args = args
        # unmerged: the simulator's replicas (vlora/cluster/sim_replica.py) model every adapter through the kernels
        kw = dict(dtype=args.dtype, max_lora_rank=max(args.ranks), check_base_model=False, policy="unmerged",
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory_gb=args.kv_cache_memory_gb)
        if args.dry_run:
            kw.update(device="cpu", max_num_seqs=8, max_num_batched_tokens=256, num_blocks=256)
        self.llm = LLM(args.model, **kw)
        self.eng = eng = self.llm.engine
        self.dev = eng.device
        sc = eng.config.scheduler
        self.budget, self.max_seqs = sc.max_num_batched_tokens, sc.max_num_seqs
        self.vocab = eng.model.cfg.vocab_size
        self.g = torch.Generator().manual_seed(0)
        self.ids = 0
        self.live: set[str] = set()          # requests this benchmark added and has not aborted
        log(f"engine: {eng.model_name} on {self.dev}, {eng.sizing.describe()}")

    def register(self, tmp: Path) -> list[str]:
        """Adapters a0..a{n-1}, ranks cycled; one file per rank (its weights do not change the time)."""
        cfg = self.eng.model.cfg
        ins, outs = cfg.lora_in_out()
        shape = ModelShape(self.eng.model_name, cfg.num_layers, ins, outs)
        paths = {r: write_random_adapter(tmp / f"r{r}", shape, r, seed=r, std=0.01, targets=self.args.targets)
                 for r in self.args.ranks}
        names = []
        n = max(self.args.adapters)
        for j in range(n):
            name = f"a{j}"
            self.llm.register_adapter(name, paths[self.args.ranks[j % len(self.args.ranks)]])
            names.append(name)
            if (j + 1) % 16 == 0 or j + 1 == n:
                log(f"registered {j + 1}/{n} adapters")
        return names

    def prompt(self, n: int) -> list[int]:
        return torch.randint(3, self.vocab, (n,), generator=self.g).tolist()

    def add(self, n: int, adapter: str | None, max_tokens: int) -> str:
        self.ids += 1
        rid = self.eng.add_request(self.prompt(n), adapter, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                   request_id=f"c{self.ids}")
        self.live.add(rid)
        return rid

    def abort(self, rid: str) -> None:
        self.eng.abort(rid)
        self.live.discard(rid)

    def step_s(self) -> float:
        sync(self.dev)
        t0 = time.perf_counter()
        self.eng.step()
        sync(self.dev)
        return time.perf_counter() - t0

    def clear(self) -> None:
        for rid in list(self.live):
            self.abort(rid)
        self.eng.step()          # flushes the aborts' outputs

    def decoding(self, d: int, adapters: list[str | None], context: int) -> list[str]:
        """``d`` requests of ``context`` prompt tokens, all past their prefill (each has sent a token)."""
        rids = [self.add(context, adapters[i % len(adapters)], 1 << 20) for i in range(d)]
        started: set[str] = set()
        while len(started) < d:
            started.update(o.request_id for o in self.eng.step() if o.token_ids)
        return rids

    def cell(self, d: int, a: int, names: list[str]) -> dict[int, float]:
        """Seconds per prefill size for a decode batch of ``d`` with ``a`` distinct adapters."""
        adapters = names[:a] if a else [None]
        self.clear()
        self.decoding(d, adapters, self.args.context)
        reps = self.args.reps
        out = {}
        if d:
            self.step_s()                                    # a graph capture or compile lands here
            out[0] = statistics.median(self.step_s() for _ in range(reps))
        for p in self.args.prefill[1:]:
            k = -(-p // PROMPT_CHUNK)
            if p + d > self.budget or d + k > self.max_seqs:
                continue
            times = []
            for _ in range(reps + 1):
                sizes = [PROMPT_CHUNK] * (k - 1) + [p - PROMPT_CHUNK * (k - 1)]
                rids = [self.add(n, adapters[i % len(adapters)], 1 << 20) for i, n in enumerate(sizes)]
                times.append(self.step_s())
                for r in rids:
                    self.abort(r)
            out[p] = statistics.median(times[1:])
        return out

    def context_slope(self, names: list[str]) -> tuple[float, int]:
        """Extra seconds per decode context token: a decode batch timed at --context and --long-context."""
        d = next((x for x in reversed(self.args.decode) if 0 < x <= 64), max(self.args.decode))
        times = {}
        for ctx in (self.args.context, self.args.long_context):
            self.clear()
            self.decoding(d, names[:1] or [None], ctx)
            self.step_s()
            times[ctx] = statistics.median(self.step_s() for _ in range(self.args.reps))
        extra = d * (self.args.long_context - self.args.context)
        return max(0.0, (times[self.args.long_context] - times[self.args.context]) / extra), d

    def adapter_costs(self, names: list[str]) -> tuple[dict[int, float], dict[int, int]]:
        """Seconds to copy an adapter of each rank into the pool, and the pages it takes (kernel path only)."""
        store = self.eng.adapters.store
        if store is None:
            return {}, {}
        self.clear()
        load, pages = {}, {}
        for r in self.args.ranks:
            name = names[self.args.ranks.index(r)]
            ad = self.eng.adapters.get(name)
            pages[r] = store.pages_needed(ad)
            times = []
            for _ in range(self.args.reps + 2):
                if name in store.resident:
                    store.evict(name)
                sync(self.dev)
                t0 = time.perf_counter()
                store.ensure([ad], set())
                if ad.placement.ready is not None:
                    ad.placement.ready.synchronize()
                sync(self.dev)
                times.append(time.perf_counter() - t0)
            load[r] = statistics.median(times[1:])
        return load, pages

    def migration_s(self) -> float:
        """The engine's side of a migration: abort a running request and add its prompt + tokens elsewhere."""
        self.clear()
        rid = self.decoding(1, [None], self.args.context)[0]
        t0 = time.perf_counter()
        self.abort(rid)
        self.add(self.args.context + 1, None, 1)
        return time.perf_counter() - t0


def fill(prefill: list[int], col: dict[int, float]) -> list[float]:
    """Values on the prefill axis: measured, else extrapolated linearly from the two largest measured, and never
    below the largest measured (more prefill is not faster; timing noise can make the slope negative)."""
    xs = sorted(col)
    out = []
    for p in prefill:
        if p in col:
            out.append(col[p])
        elif len(xs) >= 2:
            x0, x1 = xs[-2], xs[-1]
            out.append(max(col[x1], col[x1] + (p - x1) * (col[x1] - col[x0]) / (x1 - x0)))
        else:
            out.append(col[xs[-1]] if xs else math.nan)
    return out


def main(argv=None) -> Path:
    args = parse(argv)
    t_start = time.perf_counter()
    b = Bench(args)
    with tempfile.TemporaryDirectory() as tmp:
        names = b.register(Path(tmp))
        sc = b.eng.config.scheduler
        if args.prefill[-1] < sc.max_num_batched_tokens:   # the table must reach the budget (it clamps beyond)
            args.prefill = args.prefill + [sc.max_num_batched_tokens]
        decode = [d for d in args.decode if d + 1 <= sc.max_num_seqs]
        if decode != args.decode:
            log(f"decode axis cut to {decode} (max_num_seqs {sc.max_num_seqs})")
        measured: dict[tuple[int, int], dict[int, float]] = {}
        cells = [(d, a) for d in decode for a in args.adapters if a <= max(d, 1)]
        for i, (d, a) in enumerate(cells, 1):
            measured[(d, a)] = b.cell(d, a, names)
            log(f"cell {i}/{len(cells)}: decodes {d}, adapters {a}: " +
                ", ".join(f"P{p} {s * 1e3:.2f} ms" for p, s in sorted(measured[(d, a)].items())))
        step = [[[0.0] * len(args.adapters) for _ in decode] for _ in args.prefill]
        for j, d in enumerate(decode):
            for k, a in enumerate(args.adapters):
                # more adapters than requests: one adapter per request (the largest measured count)
                col = measured[(d, max(x for x in args.adapters if x <= max(a and 1, min(a, max(d, 1)))))]
                if d == 0:
                    col = {**col, 0: 0.0}                    # nothing to run: no time
                for i, v in enumerate(fill(args.prefill, col)):
                    step[i][j][k] = v
        slope, slope_d = b.context_slope(names)
        log(f"decode context: {slope * 1e9:.2f} ns per token (decode batch {slope_d})")
        load, pages = b.adapter_costs(names)
        log("adapter load: " + (", ".join(f"r{r} {s * 1e3:.2f} ms ({pages[r]} pages)" for r, s in load.items())
                                 or "none (the torch path keeps adapters beside the model)"))
        mig = b.migration_s()
        b.clear()
    eng = b.eng
    dev = b.dev
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    table = CostTable(
        limits=ReplicaLimits(eng.sizing.num_pages, eng.block_size, sc.max_num_seqs, sc.max_num_batched_tokens,
                             pages, eng.scheduler.config.max_prefill_tokens_with_decodes,
                             eng.scheduler.max_chunks_with_decodes),
        prefill=args.prefill, decode=decode, adapters=args.adapters, step_s=step, grid_context=args.context,
        kv_s_per_token=slope, adapter_load_s=load, migration_s=mig, mode=sc.policy,
        meta=dict(device=gpu, model=args.model, dtype=args.dtype, adapter_ranks=args.ranks,
                  adapter_targets=list(args.targets),
                  prompt_chunk=PROMPT_CHUNK, measured_cells=len(cells), dry_run=args.dry_run,
                  date=time.strftime("%Y-%m-%d"), seconds=round(time.perf_counter() - t_start, 1)))
    out = args.out or RESULTS / f"cluster-costs-{'cpu' if dev.type != 'cuda' else gpu.split()[-1].lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    print(f"\ncost table ({gpu}, {args.model}, {args.dtype}; mode {sc.policy}): {out}")
    print(f"limits: {eng.sizing.num_pages} pages of {eng.block_size} tokens, max_num_seqs {sc.max_num_seqs}, "
          f"budget {sc.max_num_batched_tokens} tokens")
    hdr = "prefill \\ decode " + " ".join(f"{d:>8}" for d in decode)
    for k, a in enumerate(args.adapters):
        print(f"\niteration ms, {a} distinct adapters\n{hdr}")
        for i, p in enumerate(args.prefill):
            print(f"{p:>16} " + " ".join(f"{step[i][j][k] * 1e3:8.2f}" for j in range(len(decode))))
    print(json.dumps({"adapter_load_ms": {r: round(s * 1e3, 3) for r, s in load.items()},
                      "kv_ns_per_token": round(slope * 1e9, 3), "migration_ms": round(mig * 1e3, 3),
                      "seconds": table.meta["seconds"]}))
    return out


if __name__ == "__main__":
    main()
