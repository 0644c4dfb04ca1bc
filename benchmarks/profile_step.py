"""Where a decode step's time goes: host time per phase of the engine step (``vlora.bench.phases``: schedule,
inputs, staging and replay, sampling, waiting for tokens, finish, ...; on CUDA the GPU's time between forwards),
host functions (cProfile over engine steps) and GPU kernels (torch.profiler over one eager forward), for a
random-weight model with or without adapters. ``--arrival N``: what a new request of N prompt tokens costs the
decoding batch it joins (its steps timed and profiled) instead of the eager forward.

``--stub-forward`` replaces the model's forward with one that costs next to nothing (the LM head of a zero hidden
state), so the step is the host work alone, whatever the model; on a CPU it also replays the decode graphs' CPU
emulation, so the graph path's host side is what is timed.

    python benchmarks/profile_step.py --batch 64 --adapters 32          # GPU, Llama-2-7B shapes
    python benchmarks/profile_step.py --model random:tiny-llama --device cpu --batch 256 --adapters 32 \
        --stub-forward --input-len 32        # the host work of a 256-sequence decode step on this CPU
    python benchmarks/profile_step.py --batch 16 --adapters 4 --input-len 128 --arrival 4    # a request joins
    python benchmarks/profile_step.py --model random:llama-2-13b --batch 1 --tensor-parallel-size 2 \
        --all-reduce auto --replay-kernels --no-cprofile     # rank 0's kernels of a TP=2 batch-1 decode step
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlora import LLM, SamplingParams  # noqa: E402
from vlora.bench.phases import PhaseTimer, format_summary  # noqa: E402
from vlora.lora.adapter import ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=0)
    ap.add_argument("--rank", default="16", help="adapter rank, or comma-separated ranks the adapters cycle through "
                                                 "(bench_e2e's: 8,16,32,64)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-gb", type=float, default=None, help="unified pool, GiB (default: the engine's)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--stub-forward", action="store_true",
                    help="a forward that costs next to nothing: time the host work alone")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="queue each decode behind the one in flight (the engine's async_scheduling)")
    ap.add_argument("--replay-kernels", action="store_true",
                    help="also the GPU kernels of the timed steps as they run (graph replays): each kernel's time per "
                         "step, and how much of the step the GPU is busy")
    ap.add_argument("--trace", type=Path, default=None, help="write those steps' Chrome trace here")
    ap.add_argument("--no-cprofile", action="store_true", help="time the phases only (cProfile slows the host)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="split the model over this many GPUs (rank 0's host phases and kernels are profiled; the "
                         "workers replay alongside)")
    ap.add_argument("--all-reduce", choices=["auto", "nccl", "symm_mem"], default="nccl",
                    help="the all-reduce under tensor parallelism (see ModelConfig.all_reduce)")
    ap.add_argument("--arrival", type=int, default=0,
                    help="instead of the eager decode forward's kernels: a new request of this many prompt tokens "
                         "joins the decoding batch, several times; the steps until it is prefilled are timed, then "
                         "profiled (host functions, then torch.profiler's host and GPU ops)")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    if cpu:                   # a tiny model's ops gain nothing from threads; a busy second core only delays them
        torch.set_num_threads(1)
    llm = LLM(args.model, device=args.device, max_num_seqs=args.batch + bool(args.arrival),
              kv_cache_memory_gb=args.kv_gb,
              max_num_batched_tokens=max(8192, args.batch), max_model_len=args.input_len + 3 * args.steps + 64 + ARRIVAL_STEPS,
              check_base_model=False, async_scheduling=args.async_scheduling,
              tensor_parallel_size=args.tensor_parallel_size, all_reduce=args.all_reduce,
              **(dict(kernels="triton", lora_kernel="triton") if cpu and args.stub_forward else {}))
    atexit.register(llm.close)                 # under tensor parallelism: the workers go first
    eng = llm.engine
    cfg = eng.model.cfg
    if args.stub_forward:
        stub_forward(eng)
    ins, outs = cfg.lora_in_out()
    shape = ModelShape(cfg.name, cfg.num_layers, ins, outs)
    tmp = tempfile.mkdtemp()
    names = [None] * args.batch
    ranks = [int(r) for r in args.rank.split(",")]
    for j in range(args.adapters):
        rank = ranks[j % len(ranks)]
        llm.register_adapter(f"a{j}", write_random_adapter(Path(tmp) / f"a{j}", shape, rank, j, std=0.01))
    if args.adapters:
        names = [f"a{i % args.adapters}" for i in range(args.batch)]
    prompts = torch.randint(3, cfg.vocab_size, (args.batch, args.input_len)).tolist()
    sp = SamplingParams(max_tokens=3 * args.steps + 8 + ARRIVAL_STEPS * bool(args.arrival), ignore_eos=True)
    for p, a in zip(prompts, names):
        eng.add_request(p, a, sp)
    while any(s.num_computed < len(s.prompt_token_ids) for s in eng.scheduler.unfinished()):
        eng.step()
    for _ in range(3):                        # graphs captured, caches warm
        eng.step()
    cuda = eng.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    phases = PhaseTimer(eng)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    ms = 1e3 * (time.perf_counter() - t0) / args.steps
    phases.close()
    print(f"engine step, batch {args.batch}, {args.adapters} adapters, async scheduling "
          f"{'on' if args.async_scheduling else 'off'}{', forward stubbed' if args.stub_forward else ''}: "
          f"{ms:.2f} ms")
    print(f"  median decode step (us): {format_summary(phases.summary(args.batch))}")
    if not args.no_cprofile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            eng.step()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
        print(s.getvalue())
    if cuda and (args.replay_kernels or args.trace):
        replay_kernels(eng, args)
    if args.arrival:
        arrivals(eng, args, names[0], cuda)
        return
    if args.stub_forward:
        return
    # GPU kernels of one eager decode forward (no graph) of the same batch
    runner = eng.runner
    eng.land_in_flight()                      # every sequence's tokens on the host (none pending)
    sched = eng.scheduler.schedule()
    ordered = runner.order(sched.scheduled)
    fb = runner.prepare(ordered)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode():
        for _ in range(2):
            eng.model(fb, runner.kv_cache)
        with profile(activities=acts) as prof:
            eng.model(fb, runner.kv_cache)
            if cuda:
                torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))


ARRIVAL_STEPS = 80
"""Decode steps the streams have left for ``--arrival``'s requests."""


def arrivals(eng, args, adapter: str | None, cuda: bool) -> None:
    """A request of ``args.arrival`` prompt tokens joins the running batch: five times timed (the first warms),
    once under cProfile, once under torch.profiler. Printed: the steps until it was prefilled and their time."""
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    prompt = torch.randint(3, eng.model.cfg.vocab_size, (args.arrival,)).tolist()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    kinds = ["timed"] * 5 + ([] if args.no_cprofile else ["cprofile"]) + ["torch.profiler"]
    for k, kind in enumerate(kinds):
        for _ in range(4):                    # the batch back to decoding alone
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        rid = eng.add_request(prompt, adapter, SamplingParams(max_tokens=1))
        pr = cProfile.Profile() if kind == "cprofile" else None
        ctx = profile(activities=acts) if kind == "torch.profiler" else nullcontext()
        times = []
        with ctx as prof:
            if pr is not None:
                pr.enable()
            while rid in eng._seqs:
                t0 = time.perf_counter()
                eng.step()
                times.append(1e3 * (time.perf_counter() - t0))
            if cuda:
                torch.cuda.synchronize()
            if pr is not None:
                pr.disable()
        print(f"arrival {k} ({kind}): {len(times)} steps until prefilled, "
              f"{' + '.join(f'{t:.1f}' for t in times)} ms")
        if pr is not None:
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(args.top)
            print(out.getvalue())
    for key in ("cpu_time_total",) + (("cuda_time_total",) if cuda else ()):
        print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))


def replay_kernels(eng, args) -> None:
    """The GPU kernels of ``args.steps`` engine steps as the engine runs them (graph replays, side streams and
    all): per kernel name its GPU time per forward (the graph replays counted), then the time the GPU is busy
    with any kernel (the union of their intervals) against the span from the first kernel to the last. The
    profiler slows the host, so the span is longer than an unprofiled step's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graphs = eng.runner.graphs
    replays = graphs.num_replays if graphs is not None else 0
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    forwards = (graphs.num_replays - replays if graphs is not None else 0) or args.steps
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
        print(f"trace of {args.steps} steps -> {args.trace}")
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    if not spans:
        print("no GPU kernels recorded (the profiler saw none inside the graph replays)")
        return
    per_name: dict[str, list[float]] = {}
    busy, end = 0.0, spans[0][0]
    for s, e, name in spans:
        per_name.setdefault(name, []).append(e - s)
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    total = sum(sum(v) for v in per_name.values())
    print(f"GPU kernels over {args.steps} steps, {forwards} forwards (graph replays): {len(spans) / forwards:.0f} "
          f"per forward; busy (union) {busy / forwards:.0f} us per forward of a {(end - spans[0][0]) / forwards:.0f} "
          f"us span (the profiled host is slower); kernel time summed {total / forwards:.0f} us per forward "
          f"(above the union where streams overlap)")
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]
    print(f"{'us/fwd':>9} {'calls/fwd':>10} {'us/call':>8}  kernel")
    for name, ds in rows:
        print(f"{sum(ds) / forwards:9.1f} {len(ds) / forwards:10.1f} {sum(ds) / len(ds):8.2f}  {name[:110]}")


def stub_forward(eng) -> None:
    """The model's forward returns a zero hidden state (its LM head still runs); on a CPU the decode graphs'
    emulation replays nothing, so that a step is its host work."""
    hidden = eng.model.cfg.hidden_size
    eng.model.forward = lambda fb, kv: torch.zeros(fb.input_ids.shape[0], hidden, dtype=eng.dtype,
                                                   device=eng.device)
    if eng.runner.graphs is None and eng.device.type == "cpu":
        from vlora.engine import cuda_graphs

        cuda_graphs._Rerun.replay = lambda self: None
        sc = eng.config.scheduler
        eng.runner.enable_graphs(sc.max_num_seqs, eng.max_model_len)


if __name__ == "__main__":
    main()
