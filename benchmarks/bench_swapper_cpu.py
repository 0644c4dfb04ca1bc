"""CPU cost of the cache swapper's bookkeeping at the tree sizes of the H100 pressure runs.

The swapper's Python runs in the engine's step loop. This script builds a dependency tree the size of the 24 GB
pool of ``bench_memory.py --pressure`` (3,072 GPU pages, a 6,000-block host tier, chat histories of about 60
blocks under 100 adapters). Pages here hold a few floats, so only the bookkeeping is timed. It then times:

- a busy monitor tick (usage above the high watermark: one ranking of the GPU leaves, then the swap-outs);
- an on-demand reclaim as ``make_room`` calls it;
- an idle tick that swaps in up to the low watermark;
- ``PrefixTree.reclaimable``, which every admission check calls through ``UnifiedPool.available``.

    python benchmarks/bench_swapper_cpu.py [--pages 3072 --host-blocks 6000 --sessions 300] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlora.memory.pool import UnifiedPool  # noqa: E402
from vlora.memory.swapper import CacheSwapper  # noqa: E402
from vlora.memory.tree import PrefixTree  # noqa: E402

BS = 2                                       # tokens per block: a 120-token prompt is a 60-block chain


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def serve(pool, tree, adapter, tokens) -> None:
    """One request: match its prefix, compute the rest into new pages, give the blocks to the tree."""
    pages = tree.match(adapter, tokens)
    need = -(-len(tokens) // BS) - len(pages)
    if not pool.make_room(need):
        tree.release(adapter, tokens[:len(pages) * BS], pages, len(pages))
        return
    tree.release(adapter, tokens, pages + pool.allocate(need), len(pages))


def timed(fn, profile: cProfile.Profile | None) -> float:
    t = time.perf_counter()
    if profile is not None:
        profile.enable()
    fn()
    if profile is not None:
        profile.disable()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=3072)
    p.add_argument("--host-blocks", type=int, default=6000)
    p.add_argument("--sessions", type=int, default=300)
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="print the 15 costliest calls of the timed ticks")
    args = p.parse_args()
    rng = random.Random(0)
    pool = UnifiedPool(args.pages, 1, BS, 1, 4, torch.float32, torch.device("cpu"))
    tree, clock = PrefixTree(pool, BS), Clock()
    swapper = CacheSwapper(pool, tree, None, lambda name: None, clock=clock,
                           host_kv_bytes=args.host_blocks * pool.page_elems * 4)
    pool.reclaimers.insert(0, swapper.reclaim)
    pool.reclaimable.insert(0, tree.reclaimable)
    sessions = [(f"a{rng.randrange(args.adapters)}", [rng.randrange(1000) for _ in range(rng.randint(100, 140))])
                for _ in range(args.sessions)]
    t = time.perf_counter()
    for _ in range(3):                                   # three turns of every session: the pool overflows
        for adapter, tokens in sessions:
            tokens += [rng.randrange(1000) for _ in range(10)]
            clock.t += 0.01
            serve(pool, tree, adapter, tokens)
    print(f"tree: {tree.num_pages} GPU blocks, {len(swapper.host_nodes)} host blocks, {pool.num_free} pages free "
          f"(built in {time.perf_counter() - t:.1f} s)")
    profile = cProfile.Profile() if args.profile else None
    busy, demand, avail = [], [], []
    for i in range(args.repeats):
        adapter, tokens = sessions[i]
        serve(pool, tree, adapter, tokens + [rng.randrange(1000) for _ in range(200)])   # usage back over high
        clock.t += 0.2
        busy.append(timed(lambda: swapper.tick(32), profile))
        avail.append(timed(pool.available, None))
        demand.append(timed(lambda: swapper.reclaim(swapper.batch), None))
    swapper.reclaim(args.pages // 2)
    clock.t += 0.2
    fill = timed(lambda: swapper.tick(32), None)
    for name, xs in (("busy tick (rank + swap out)", busy), ("on-demand reclaim", demand),
                     ("pool.available()", avail)):
        print(f"{name:30s} mean {statistics.mean(xs):7.2f} ms  max {max(xs):7.2f} ms")
    print(f"{'idle tick (swap in to low)':30s} {fill:7.2f} ms")
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(15)


if __name__ == "__main__":
    main()
