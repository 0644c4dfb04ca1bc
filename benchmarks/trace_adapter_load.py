"""Where the engine's steps pause while an adapter loads: each step's time beside the loader's phases.

One engine (random:llama-2-7b on CUDA, random:tiny-llama on the CPU) decodes 16 streams on 4 rank-16 adapters;
between stretches of steps, an adapter of rank 16 or 64 is read, validated and packed in the loader process and
finished (its pool copy pinned) on a thread, as the server's loads are (``--loader process``; ``--loader thread``:
all of it on a thread, ``AdapterRegistry.prepare``), while the engine steps on, then registered and given a
4-token request (a load); or a like request goes to an adapter already registered (a control). The loader's
phases and the engine's memory work are timed by wrapping them. Printed per load and control: its duration, its
steps' longest and their time beyond the steps around it (the mean of the median of the 30 steps before it and
of the 30 after it: steps grow as the streams' contexts do), the mean step beside each phase, and each step
longer than twice the median with the phases it overlapped. A diagnosis for ``bench_adapter_load.py``'s figures, not a figure of its own.

    python benchmarks/trace_adapter_load.py --device cuda > trace.log
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vlora.lora.device_store as device_store  # noqa: E402
import vlora.lora.loader as loader_mod  # noqa: E402
import vlora.lora.registry as registry  # noqa: E402
import vlora.memory.manager as manager  # noqa: E402
from vlora import LLM, SamplingParams  # noqa: E402
from vlora.engine import cuda_graphs  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402
from vlora.models.loader import lora_shape  # noqa: E402

SPANS: list[tuple[str, str, float, float]] = []      # (phase, thread, start, end)
ENGINE_PHASES = {"memory.prepare", "memory.after", "store.load", "registry.add", "graph.capture"}


def timed(owner, attr: str, label: str | None = None) -> None:
    """Record every call of ``owner.attr`` in SPANS."""
    f = getattr(owner, attr)

    @functools.wraps(f)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPANS.append((label or attr, threading.current_thread().name, t0, time.perf_counter()))
    setattr(owner, attr, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="default: random:llama-2-7b on CUDA, random:tiny-llama on the CPU")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="the interpreter's thread switch interval, seconds (default: Python's, 0.005)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the engine is built")
    ap.add_argument("--loader", choices=("process", "thread"), default="process",
                    help="where adapters are read: the loader process, as the server reads them, or a thread")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    cuda = args.device.startswith("cuda")
    model = args.model or ("random:llama-2-7b" if cuda else "random:tiny-llama")
    for owner, attr, label in [(device_store, "pinned_empty", None), (device_store, "pin_in_place", None),
                               (loader_mod, "load_adapter", None), (loader_mod, "pack", None),
                               (loader_mod, "landed", None), (registry.AdapterRegistry, "finish", "registry.finish"),
                               (device_store.AdapterStore, "host_copy", None),
                               (device_store.AdapterStore, "load", "store.load"),
                               (registry.AdapterRegistry, "add", "registry.add"),
                               (cuda_graphs.DecodeGraphs, "capture", "graph.capture"),
                               (manager.MemoryManager, "prepare", "memory.prepare"),
                               (manager.MemoryManager, "after", "memory.after")]:
        timed(owner, attr, label)
    shape = lora_shape(model)
    tmp = Path(tempfile.mkdtemp())
    llm = LLM(model, device=args.device, max_lora_rank=64, check_base_model=False)
    eng = llm.engine
    if args.loader == "process":
        loader_mod.LOADER.start()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    for j in range(4):
        llm.register_adapter(f"run-{j}", write_random_adapter(tmp / f"run-{j}", shape, 16, j))
    paths = {f"r{rank}-{j}": write_random_adapter(tmp / f"r{rank}-{j}", shape, rank, 100 + rank + j)
             for rank in (16, 64) for j in range(2)}
    prompts = torch.randint(3, min(1000, eng.model.cfg.vocab_size), (args.streams, 128), generator=torch.Generator().manual_seed(0)).tolist()
    for i, p in enumerate(prompts):
        eng.add_request(p, f"run-{i % 4}", SamplingParams(max_tokens=100_000 if cuda else 400, ignore_eos=True))
    steps: list[tuple[float, float]] = []

    def step() -> None:
        if not eng.has_unfinished():         # the streams ended (the CPU's are short): wait, record nothing
            time.sleep(1e-3)
            return
        t0 = time.perf_counter()
        eng.step()
        steps.append((t0, time.perf_counter()))

    def request(kind: str, name: str) -> tuple[str, str, float, float]:
        t0 = time.perf_counter()
        if kind == "load":
            box = {}

            def prepare() -> None:
                if args.loader == "thread":
                    box["p"] = eng.adapters.prepare(name, paths[name])
                else:
                    t = time.perf_counter()
                    read = asyncio.run(loader_mod.LOADER.read(eng.adapters.spec, name, str(paths[name])))
                    SPANS.append(("read (worker)", "loader", t, time.perf_counter()))
                    box["p"] = eng.adapters.finish(read)
            loader = threading.Thread(target=prepare, name="loader")
            loader.start()
            while loader.is_alive():
                step()
            eng.adapters.add(box["p"])
        rid = eng.add_request(prompts[0][:4], name, SamplingParams(max_tokens=1))
        while rid in eng._seqs:
            step()
        return kind, name, t0, time.perf_counter()

    for _ in range(30):
        step()
    events = []
    for name in paths:
        for _ in range(40):
            step()
        events.append(request("load", name))
        for _ in range(40):
            step()
        events.append(request("control", "run-0"))
    median = statistics.median(b - a for a, b in steps[30:])
    print(f"{args.device}, loader {args.loader}: {len(steps)} steps, median {1e3 * median:.2f} ms (switch interval "
          f"{sys.getswitchinterval()} s, gc frozen: {args.gc_freeze})")
    quiet = [(s0, s1) for s0, s1 in steps if not any(s0 < b and s1 > a for _, _, a, b in events)]
    for kind, name, a, b in events:
        inside = [(s0, s1) for s0, s1 in steps if s0 >= a and s1 <= b]
        durs = [s1 - s0 for s0, s1 in inside]
        # the steps' own time around the event: they grow as the streams' contexts do
        around = [statistics.median(side) for side in ([s1 - s0 for s0, s1 in quiet if s1 <= a][-30:],
                                                      [s1 - s0 for s0, s1 in quiet if s0 >= b][:30]) if side]
        base = statistics.fmean(around) if around else median
        beyond = sum(d - base for d in durs)
        print(f"{kind} {name}: {1e3 * (b - a):.0f} ms, {len(durs)} steps, longest {1e3 * max(durs):.1f} ms, "
              f"beyond the steps around it ({1e3 * base:.2f} ms) {1e3 * beyond:.1f} ms, "
              f"{1e3 * (beyond - max(durs) + base):.1f} ms but the longest")
        phases = sorted({p for p, _, t0, t1 in SPANS if t0 < b and t1 > a and p not in ENGINE_PHASES})
        beside = {p: [s1 - s0 for s0, s1 in inside if any(q == p and t0 < s1 and t1 > s0 for q, _, t0, t1 in SPANS)]
                  for p in phases}
        alone = [s1 - s0 for s0, s1 in inside if not any(q in phases and t0 < s1 and t1 > s0
                                                         for q, _, t0, t1 in SPANS)]
        print("   mean step (ms, steps) beside " + ", ".join(
            f"{p}: {1e3 * statistics.fmean(d):.2f} ({len(d)})" for p, d in beside.items() if d)
            + (f"; beside none: {1e3 * statistics.fmean(alone):.2f} ({len(alone)})" if alone else ""))
        for s0, s1 in inside:
            if s1 - s0 > 2 * median:
                phases = [(p, th, round(1e3 * (t1 - t0), 1)) for p, th, t0, t1 in SPANS if t0 < s1 and t1 > s0]
                print(f"   step {1e3 * (s1 - s0):.1f} ms at +{1e3 * (s0 - a):.0f} ms, beside {phases}")
    longest = {}
    for p, _, t0, t1 in SPANS:
        longest[p] = max(longest.get(p, 0.0), t1 - t0)
    print("longest of each phase (ms):", {p: round(1e3 * s, 1) for p, s in sorted(longest.items())})


if __name__ == "__main__":
    main()
