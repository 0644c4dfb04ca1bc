"""Memory benchmarks of the unified pool, host adapter store, dependency tree and cache swapper.

1. Throughput with 5, 100 and 1,000 adapters registered (one engine, adapters added between runs; each run's
   requests use the first N adapters uniformly, all sent at once). Target: 1,000 adapters >= 90% of the
   5-adapter throughput. Host memory of the adapter store reported.
2. A dynamic-popularity multi-turn workload (FastLibra's setting: chat sessions on a shifting hot set of
   adapters, in real time) on engines with prefix caching: the unified pool with the dependency tree and
   FastLibra's cost-model swapper (fastlibra), the unified pool with LRU eviction (unified), and LRU with
   fixed separate pools for adapters and KV (lru-fixed, cached KV discarded), each in a process of its own.
   Target: mean TTFT -50% at the same request rate. Pool occupancy (running KV, cached KV,
   adapters) over time plotted for both. Per policy also preemptions, prompt tokens computed (and computed again
   after a preemption) and admissions stopped for want of pages.

    python benchmarks/bench_memory.py --out benchmarks/results            # GPU: Llama-2-7B shapes
    python benchmarks/bench_memory.py --tiny --out /tmp/mem                # CPU smoke run
    python benchmarks/bench_memory.py --cpu-pressure --parts dynamic --out /tmp/mem   # CPU: a pool too small for
                                                                           # the sessions (swapper overheads)
    python benchmarks/bench_memory.py --pressure --parts dynamic --session-rate 2 --out /tmp/mem  # GPU: sessions
                                                  # whose histories overflow the pool (FastLibra's loaded regime)
    python benchmarks/bench_memory.py --pressure --parts dynamic --session-rate 3.5 --kv-gb 96 --host-kv-gb 72 \
        --policies fastlibra,lru-fixed --out /tmp/mem   # the H200 runs of benchmarks/results/h200-2026-11-25-pressure/

Each request's TTFT is also reported split: its wait to be scheduled (``queued_*``) and the iterations from then
to its first token (``ttft_scheduled_*``); multi-turn runs give both for first and later turns.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlora import LLM  # noqa: E402
from vlora.bench import workloads as W  # noqa: E402
from vlora.bench.harness import run_workload  # noqa: E402
from vlora.kernels import compiles  # noqa: E402
from vlora.kernels.tuning import gpu_name  # noqa: E402
from vlora.lora.adapter import ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shape_of(llm) -> ModelShape:
    mc = llm.engine.model.cfg
    ins, outs = mc.lora_in_out()
    return ModelShape(llm.engine.model_name, mc.num_layers, ins, outs)


def free(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def throughput(args, tmp: Path, res: dict) -> None:
    llm = LLM(args.model, device=args.device, max_num_seqs=args.batch, kv_cache_memory_gb=args.kv_gb,
              max_model_len=args.input_len + args.output_len + 16, max_lora_rank=8, check_base_model=False,
              max_num_batched_tokens=args.max_batched_tokens)
    eng = llm.engine
    eng.runner.capture_graphs()
    src = write_random_adapter(tmp / "qkvo-r8", shape_of(llm), 8, seed=0, std=0.01,
                               targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    rows, registered = [], 0
    rng = random.Random(0)
    for n in args.counts:
        t0 = time.perf_counter()
        for i in range(registered, n):
            llm.register_adapter(f"a{i}", src)
        reg_s, added, registered = time.perf_counter() - t0, n - registered, n
        host = eng.adapters.store.host_bytes() if eng.adapters.store is not None else None
        specs = [W.RequestSpec(0.0, f"a{rng.randrange(n)}", args.input_len, args.output_len)
                 for _ in range(args.requests)]
        # warm-up over this many adapters (their first loads, the graphs' adapter columns); kernel variants are
        # built at engine start, and the timed run reports any built since
        log(f"warm-up over {n} adapters")
        run_workload(eng, [W.RequestSpec(0.0, f"a{rng.randrange(n)}", args.input_len, args.output_len)
                           for _ in range(args.batch)])
        loads0 = eng.adapters.store.num_loads if eng.adapters.store is not None else 0
        mark = compiles.snapshot()
        r = run_workload(eng, specs).metrics() | compiles.since(mark)
        row = {"adapters": n, "register_s": reg_s, "host_store_bytes": host, "throughput_tok_s": r["throughput_tok_s"],
               "duration_s": r["duration_s"], "finished": r["finished"], "ttft_mean_s": r["ttft_mean_s"],
               "adapter_loads": (eng.adapters.store.num_loads - loads0) if eng.adapters.store is not None else 0,
               "kernel_builds": r["compiles"]}
        rows.append(row)
        log(f"{n:5d} adapters: {row['throughput_tok_s']:.0f} output tok/s, {row['adapter_loads']} adapter loads, "
            f"host store {host / 2**30 if host else 0:.2f} GiB ({added} registered in {reg_s:.1f} s), "
            f"kernel builds {row['kernel_builds']}")
    base = rows[0]["throughput_tok_s"]
    for row in rows:
        row["vs_first"] = row["throughput_tok_s"] / base
    res["throughput"] = rows
    free(llm)


def dynamic(args, tmp: Path, res: dict) -> None:
    specs = W.dynamic_multi_turn(args.phases, num_adapters=args.dyn_adapters, session_rate=args.session_rate,
                                 turns=args.turns, think_s=args.think_s, first_range=args.first_range,
                                 next_range=args.next_range, output_range=args.output_range, seed=1)
    res["dynamic_workload"] = {"phases": args.phases, "adapters": args.dyn_adapters, "session_rate": args.session_rate,
                               "turns": args.turns, "requests": len(specs), "first_range": args.first_range,
                               "next_range": args.next_range, "output_range": args.output_range,
                               "think_s": args.think_s, "kv_gb": args.dyn_kv_gb, "host_kv_gb": args.host_kv_gb}
    out = {}
    dirs = None
    for policy in args.policies:
        llm = LLM(args.model, device=args.device, max_num_seqs=args.batch, kv_cache_memory_gb=args.dyn_kv_gb,
                  num_blocks=args.num_blocks, block_size=args.block_size,
                  max_model_len=args.max_model_len, max_lora_rank=max(args.ranks), check_base_model=False,
                  max_num_batched_tokens=args.max_batched_tokens, prefix_caching=True, memory_policy=policy,
                  adapter_pool_fraction=args.adapter_fraction, host_kv_gb=args.host_kv_gb)
        eng = llm.engine
        eng.runner.capture_graphs()
        if dirs is None:
            dirs = [write_random_adapter(tmp / f"d{r}", shape_of(llm), r, seed=r, std=0.01) for r in args.ranks]
        for i in range(args.dyn_adapters):
            llm.register_adapter(f"a{i}", dirs[i % len(dirs)])
        log(f"{policy}: pool {eng.pool.num_pages} pages of {eng.pool.page_elems * eng.pool.buf.element_size() >> 20}"
            f" MiB" + (f", adapters limited to {eng.pool.adapter_limit}" if eng.pool.adapter_limit else ""))
        run_workload(eng, [W.RequestSpec(0.0, f"a{i}", 64, 4) for i in range(4)])      # warm-up
        eng.prefix_cache.clear()
        samples = []
        t0 = time.monotonic()
        step = eng.step

        def sampled_step(step=step, eng=eng, samples=samples):
            outs = step()
            pool, tree = eng.pool, eng.prefix_cache
            samples.append((time.monotonic() - t0, pool.kv_pages - tree.num_pages - (eng.swapper.leaving if eng.swapper
                            else 0), tree.num_pages,
                            pool.num_adapter_pages, pool.num_pages,
                            len(eng.swapper.host_nodes) if eng.swapper is not None else 0,
                            len(eng.scheduler.running), len(eng.scheduler.waiting)))
            return outs

        eng.step = sampled_step
        mark = compiles.snapshot()

        def counts(eng=eng) -> dict:
            """Prompt tokens looked up in and served from the prefix cache (a preempted request is looked up
            again), preemptions, tokens computed (of them prompt positions, and positions computed again after a
            preemption), admissions stopped for want of pages: this run's, not the warm-up's."""
            return eng.scheduler.counters() | {"hit_tokens": eng.prefix_cache.hit_tokens,
                                               "lookup_tokens": eng.prefix_cache.lookup_tokens}

        before = counts()
        result = run_workload(eng, specs, max_wall_s=args.max_wall_s, progress=False)
        m = result.metrics() | compiles.since(mark)
        m.update({k: v - before[k] for k, v in counts().items()})
        m.update(adapter_loads=eng.adapters.store.num_loads if eng.adapters.store is not None else None,
                 swapper=eng.swapper.stats() if eng.swapper is not None else None, occupancy=samples[::5])
        out[policy] = m
        log(f"{policy}: TTFT mean {m['ttft_mean_s'] and m['ttft_mean_s'] * 1e3:.0f} ms p50 "
            f"{m['ttft_p50_s'] and m['ttft_p50_s'] * 1e3:.0f} ms p90 {m['ttft_p90_s'] and m['ttft_p90_s'] * 1e3:.0f}"
            f" ms (first turns {(m.get('ttft_first_turn_mean_s') or 0) * 1e3:.0f}, later turns "
            f"{(m.get('ttft_later_turns_mean_s') or 0) * 1e3:.0f} ms; waiting to be scheduled: mean "
            f"{(m.get('queued_mean_s') or 0) * 1e3:.0f} ms, p90 {(m.get('queued_p90_s') or 0) * 1e3:.0f} ms, first "
            f"turns {(m.get('queued_first_turn_mean_s') or 0) * 1e3:.0f}, later turns "
            f"{(m.get('queued_later_turns_mean_s') or 0) * 1e3:.0f} ms), {m['finished']}/{m['requests']} finished, "
            f"prefix hits {m['hit_tokens']}/{m['lookup_tokens']} "
            f"tokens, prompt tokens computed {m['prompt_tokens_computed']} (recomputed after "
            f"{m['preemptions']} preemptions: {m['recomputed_tokens']}), {m['admissions_blocked']} admissions "
            f"stopped for pages, swapper {m['swapper']}, kernel builds {m['compiles']}")
        free(llm)
    res["dynamic"] = out
    compare(res)


def compare(res: dict) -> None:
    out = res["dynamic"]
    base = out.get("lru-fixed", {}).get("ttft_mean_s")
    for policy, m in out.items():
        if base and m["ttft_mean_s"] and policy != "lru-fixed":
            res[f"ttft_change_{policy}_vs_lru_fixed"] = m["ttft_mean_s"] / base - 1


def dynamic_per_process(args, res: dict) -> None:
    """The dynamic part with each policy in a process of its own: an engine's pinned host memory (adapter store,
    host KV tier) is only sure to be returned when its process ends, and two 7B engines' worth does not fit."""
    out = {}
    for policy in args.policies:
        sub = args.out / f"policy-{policy}"
        cmd = [sys.executable, __file__, "--parts", "dynamic", "--policies", policy, "--out", str(sub),
               "--one-process"] + [f for f in ("--pressure", "--tiny", "--cpu-pressure")
                                   if getattr(args, f[2:].replace("-", "_"))]
        for flag, value in (("--session-rate", args.session_rate_override), ("--host-kv-gb", args.host_kv_override),
                            ("--kv-gb", args.kv_override)):
            if value is not None:
                cmd += [flag, str(value)]
        if subprocess.run(cmd).returncode:
            log(f"{policy}: failed")
            continue
        sub_res = json.loads(next(sub.glob("memory-*.json")).read_text())
        res["dynamic_workload"] = sub_res["dynamic_workload"]
        out[policy] = sub_res["dynamic"][policy]
    res["dynamic"] = out
    compare(res)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dyn = res.get("dynamic", {})
    fig, axes = plt.subplots(1, max(1, len(dyn)), figsize=(12, 4), sharey=True, squeeze=False)
    for ax, (policy, m) in zip(axes[0], dyn.items()):
        occ = m["occupancy"]
        if not occ:
            continue
        t = [s[0] for s in occ]
        total = occ[0][4]
        parts = [[100 * s[i] / total for s in occ] for i in (1, 2, 3)]
        ax.stackplot(t, *parts, labels=["running KV", "cached KV", "adapters"], alpha=0.8)
        ax.set_title(f"{policy}: TTFT mean {1e3 * (m['ttft_mean_s'] or 0):.0f} ms")
        ax.set_xlabel("time (s)")
        ax.set_ylim(0, 100)
    axes[0][0].set_ylabel("pool pages (%)")
    axes[0][0].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="tiny random model on the CPU (smoke run)")
    p.add_argument("--cpu-pressure", action="store_true",
                   help="tiny random model on the CPU, dynamic part with a 90-block pool the sessions overflow")
    p.add_argument("--pressure", action="store_true",
                   help="GPU dynamic part with long histories and more sessions than the KV pool holds, so cached "
                        "KV competes for pages (FastLibra's loaded regime); the default setting fits in the pool")
    p.add_argument("--session-rate", dest="session_rate_override", type=float, default=None,
                   help="sessions started per second (dynamic part)")
    p.add_argument("--host-kv-gb", dest="host_kv_override", type=float, default=None,
                   help="host memory for swapped-out KV (fastlibra; 0: blocks leaving the GPU are dropped)")
    p.add_argument("--kv-gb", dest="kv_override", type=float, default=None,
                   help="GPU pool of the dynamic part, GB (KV and adapters; lru-fixed splits it)")
    p.add_argument("--parts", default="throughput,dynamic")
    p.add_argument("--one-process", action="store_true",
                   help="run every policy of the dynamic part in this process (default: one process per policy)")
    p.add_argument("--policies", default="fastlibra,unified,lru-fixed", type=lambda t: t.split(","),
                   help="memory policies of the dynamic part")
    args = p.parse_args()
    args.num_blocks, args.block_size = None, 16
    args.think_s, args.next_range, args.output_range = (1.0, 3.0), (64, 256), (32, 96)
    if args.cpu_pressure:
        args.tiny = True
    if args.tiny:
        args.model, args.device = "random:tiny-llama", "cpu"
        args.kv_gb, args.dyn_kv_gb, args.host_kv_gb = 0.05, 0.01, 0.01
        args.counts, args.requests, args.batch, args.input_len, args.output_len = [5, 100, 1000], 16, 8, 32, 8
        args.phases, args.session_rate, args.turns, args.first_range = [(3.0, 2), (3.0, 6)], 1.0, 3, (32, 96)
        args.dyn_adapters, args.ranks, args.max_wall_s, args.max_model_len = 12, [4, 8], 30.0, 1024
        args.max_batched_tokens = 256
        if args.cpu_pressure:
            args.num_blocks, args.block_size, args.batch, args.max_wall_s = 90, 8, 16, 40.0
            args.phases, args.session_rate, args.turns, args.first_range = [(6.0, 3), (6.0, 8)], 8.0, 4, (96, 192)
            args.think_s, args.next_range, args.output_range, args.ranks = (0.3, 1.0), (16, 48), (8, 24), [8]
    else:
        args.model, args.device = "random:llama-2-7b", "cuda"
        args.kv_gb, args.dyn_kv_gb, args.host_kv_gb = 20.0, 8.0, 24.0
        args.counts, args.requests, args.batch, args.input_len, args.output_len = [5, 100, 1000], 384, 64, 256, 64
        args.phases, args.session_rate, args.turns, args.first_range = [(20.0, 8), (20.0, 32), (20.0, 8)], 0.75, 4, \
            (512, 1536)
        args.dyn_adapters, args.ranks, args.max_wall_s, args.max_model_len = 100, [8, 16], 90.0, 4096
        args.max_batched_tokens = 4096
        if args.pressure:      # chat sessions idle between turns hold more history than the KV pool (not the
            # GPU and host together); running requests fit in the pool, so what a miss costs is prefill compute
            args.phases, args.session_rate, args.turns, args.think_s = [(20.0, 41), (20.0, 75), (20.0, 41)], 1.0, 5, \
                (5.0, 15.0)
            args.first_range, args.dyn_kv_gb, args.host_kv_gb, args.max_wall_s = (1024, 2048), 24.0, 48.0, 150.0
            args.ranks = [16, 64]
    if args.session_rate_override is not None:
        args.session_rate = args.session_rate_override
    if args.host_kv_override is not None:
        args.host_kv_gb = args.host_kv_override
    if args.kv_override is not None:
        args.dyn_kv_gb = args.kv_override
    args.adapter_fraction = 0.15
    res = {"benchmark": "memory", "device": gpu_name() if args.device == "cuda" else platform.processor() or "cpu",
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__, "model": args.model}
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "throughput" in parts:
            throughput(args, Path(tmp), res)
        if "dynamic" in parts and (args.one_process or len(args.policies) == 1):
            dynamic(args, Path(tmp), res)
        elif "dynamic" in parts:
            dynamic_per_process(args, res)
    args.out.mkdir(parents=True, exist_ok=True)
    name = res["device"] if args.device == "cuda" else "cpu"
    (args.out / f"memory-{name}.json").write_text(json.dumps(res, indent=1))
    if "dynamic" in res:
        plot(res, args.out / f"memory-{name}.png")
    for row in res.get("throughput", []):
        print(f"adapters {row['adapters']:5d}: {row['throughput_tok_s']:.0f} tok/s ({row['vs_first']:.1%} of 5)")
    for key in (k for k in res if k.startswith("ttft_change_")):
        policy = key[len("ttft_change_"):-len("_vs_lru_fixed")]
        print(f"dynamic multi-turn, {policy}: mean TTFT {res[key]:+.1%} vs LRU fixed pools (target -50%)")


if __name__ == "__main__":
    main()
