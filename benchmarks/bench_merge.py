"""Swift merge/unmerge of one adapter into a random Llama-2-7B-shaped model, against its bytes floor.

Floor: every touched weight read and written once (merge), and again (unmerge), at the copy
bandwidth measured in the same run. Also reports the exactness cost (restore record bytes,
exception count) and checks the weights come back bit for bit. Then the merged copy
(``--merged-copy``, on by default): making a copy of the merged projections in pool pages, and a
switch to or from it (the layers' weights pointed at the copy or back), against the in-place
switches; the copy is checked bitwise against an in-place merge.

``--graphs MODEL`` instead measures what a merged copy costs the decode CUDA graphs, on an engine of MODEL:
the copy's own set of graphs (a graph reads the weights at its capture's addresses), captured per batch
bucket for merged and mixed iterations, in seconds and device memory, and a merged decode step replayed on
the copy against the same step merged in place.

    python benchmarks/bench_merge.py                 # GPU: 7B shapes, rank 64, bf16
    python benchmarks/bench_merge.py --layers 2      # smaller, e.g. on a CPU
    python benchmarks/bench_merge.py --graphs random:llama-2-7b          # GPU: the copy's graph set
    TRITON_INTERPRET=1 python benchmarks/bench_merge.py --graphs random:tiny-llama --graph-batch 4   # CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from vlora.kernels import merge as kernels
from vlora.kernels.tuning import gpu_name
from vlora.lora.adapter import ModelShape
from vlora.lora.merge import group_widths, merge_, stage_factors, stage_from_pool, unmerge_
from vlora.lora.random_adapter import write_random_adapter
from vlora.lora.registry import AdapterRegistry
from vlora.memory.pool import UnifiedPool

PAGE_ELEMS = 1 << 23               # the stand-in pools' page: 16 MiB of bf16


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def merged_copy(weights, widths, adapter, staged, repeats, device) -> dict:
    """Make a merged copy ``repeats`` times and switch to and from it ``repeats`` times each way, on a stand-in
    model whose layers' weights are views of ``weights`` (as the decoder's are); check the copy bitwise against
    an in-place first merge of the same adapter. ``weights`` are the base weights before and after."""
    from types import SimpleNamespace

    from torch import nn

    from vlora.engine.modes import ModeSwitcher
    from vlora.lora.merge_copy import MergedCopies

    L = next(iter(weights.values())).shape[0]

    def linear(w):
        lin = nn.Linear(1, 1, bias=False, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        return lin

    layers = [nn.Module() for _ in range(L)]
    for i, layer in enumerate(layers):
        for g, w in weights.items():
            setattr(layer, g, linear(w[i]))
    h, inter = widths["o"][0], widths["gate_up"][0]
    model = SimpleNamespace(cfg=SimpleNamespace(q_size=widths["qkv"][0], kv_size=widths["qkv"][1], hidden_size=h,
                                                intermediate_size=inter), stacked=weights, layers=layers)
    pages = sum(-(-w.numel() // PAGE_ELEMS) for w in weights.values()) + 1
    pool = UnifiedPool(pages, 1, 16, 1, PAGE_ELEMS // 32, next(iter(weights.values())).dtype, device)
    modes = ModeSwitcher(model)
    modes.keep_copies(MergedCopies(pool))
    modes.merge(adapter, copy_keep_free=0)       # untimed: stages the adapter's factors (kept), builds kernels
    makes, to_copy, to_base = [], [], []
    for _ in range(repeats):
        modes.copies.drop()
        makes.append(modes.merge(adapter, copy_keep_free=0))
        assert modes.on_copy, "the stand-in pool holds no copy"
        for _ in range(repeats):
            to_base.append(modes.unmerge())
            to_copy.append(modes.merge(adapter, copy_keep_free=0))
    copy = modes.copies.copy.weights
    modes.unmerge()
    rec = merge_(weights, widths, adapter, staged=staged)         # in place, a first merge: the reference
    same = all(torch.equal(copy[g].view(torch.int16), weights[g].view(torch.int16)) for g in copy)
    unmerge_(weights, widths, rec)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"make_copy_ms": med(makes) * 1e3, "copy_switch_to_ms": med(to_copy) * 1e3,
            "copy_switch_back_ms": med(to_base) * 1e3, "copy_pages": modes.copies.copy.pages,
            "copy_bytes": sum(t.numel() * t.element_size() for t in copy.values()),
            "copy_bitwise_in_place": same, "layers_pointed_per_switch": L * len(copy)}


def graph_sets(model: str, max_batch: int, rank: int, reps: int) -> dict:
    """The copy's decode-graph set on an engine of ``model``: capture time and device memory per bucket (merged
    and mixed kinds), and merged decode steps replayed on the copy and in place."""
    from vlora import LLM
    from vlora.engine.cuda_graphs import BASE
    from vlora.engine.mode_costs import _time
    from vlora.lora.adapter import ModelShape

    cuda = torch.cuda.is_available()
    kw = dict(dtype="bfloat16", kv_cache_memory_gb=24.0) if cuda else dict(device="cpu", kernels="triton",
                                                                           lora_kernel="triton", num_blocks=256)
    # policy vlora: start-up builds the merge kernels and mixed mode's variants (nothing is served here)
    llm = LLM(model, merged_copy=True, policy="vlora", max_num_seqs=max_batch, max_lora_rank=max(rank, 16), **kw)
    eng = llm.engine
    mc = eng.model.cfg
    ins, outs = mc.lora_in_out()
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(("m", "x")):       # "m" is merged; "x" gives mixed graphs a row to subtract from
            eng.adapters.register(name, write_random_adapter(Path(tmp) / name, ModelShape(eng.model_name,
                                  mc.num_layers, ins, outs), rank, seed=i, std=0.01))
    runner, modes = eng.runner, eng.runner.modes
    if runner.graphs is None:                       # CPU: the emulation
        runner.enable_graphs(max_batch, eng.max_model_len)
    graphs, adapter = runner.graphs, eng.adapters.get("m")
    eng.adapters.store.ensure([adapter, eng.adapters.get("x")], set())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    free = (lambda: torch.cuda.mem_get_info()[0]) if cuda else (lambda: 0)

    def capture(kinds) -> tuple[float, int]:
        sync()
        before, t0 = free(), time.perf_counter()
        for b in reversed(graphs.buckets):
            for kind in kinds:
                graphs.capture(b, kind)
        sync()
        return time.perf_counter() - t0, before - free()

    base_s, base_bytes = capture((BASE, graphs.mixed_kind))           # the base weights' set, for comparison
    modes.merge(adapter, copy_keep_free=0)          # untimed: the adapter's factors staged, the kernels warm
    modes.copies.drop()
    make_s = modes.merge(adapter, copy_keep_free=0)
    assert modes.on_copy, "no room for a copy in the pool"
    graphs._use_weights(eng.model.weights_key)
    copy_s, copy_bytes = capture((BASE, graphs.mixed_kind))

    def step(b):
        rows = dict(ids=[0] * b, positions=[0] * b, slots=[graphs.scratch_slot] * b, tables=[[0]] * b, lens=[1] * b)
        return _time(lambda: graphs.run(**rows, segments=[]), graphs.device, reps)

    on_copy = {b: step(b) for b in graphs.buckets}
    modes.unmerge()
    modes.merge(adapter)                            # in place: the base set's graphs read the merged weights
    in_place = {b: step(b) for b in graphs.buckets}
    modes.unmerge()
    n = 2 * len(graphs.buckets)
    return {"graph_model": model, "graph_buckets": graphs.buckets, "graphs_per_set": n,
            "base_set_capture_s": base_s, "base_set_bytes": base_bytes, "make_copy_ms": make_s * 1e3,
            "copy_set_capture_s": copy_s, "copy_set_bytes": copy_bytes,
            "copy_set_capture_ms_per_graph": copy_s * 1e3 / n,
            "merged_step_ms_on_copy": {b: t * 1e3 for b, t in on_copy.items()},
            "merged_step_ms_in_place": {b: t * 1e3 for b, t in in_place.items()}}


def copy_bandwidth(device, nbytes=1 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), device)[0] for _ in range(5))
    return 2 * nbytes / best


# (BM, BN, warps) and the unmerge's walk (rows per strip, stages; rows = BM is one tile per program)
SWEEP = [((64, 128, 4), (512, 3)), ((64, 128, 4), (256, 3)), ((64, 64, 4), (512, 3)), ((32, 128, 4), (256, 3)),
         ((64, 128, 8), (512, 3)), ((128, 128, 8), (512, 3)), ((128, 64, 4), (512, 3))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="time the fused kernels' tile alternatives first and "
                   "report with the fastest")
    p.add_argument("--merged-copy", action=argparse.BooleanOptionalAction, default=True,
                   help="also time making a merged copy in pool pages and switching to and from it")
    p.add_argument("--graphs", metavar="MODEL", help="measure the merged copy's decode-graph set on an engine of "
                   "MODEL (e.g. random:llama-2-7b) instead")
    p.add_argument("--graph-batch", type=int, default=64, help="--graphs: the engine's max_num_seqs (graph buckets "
                   "up to it)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.graphs:
        res = graph_sets(args.graphs, args.graph_batch, args.rank, args.repeats) | {
            "benchmark": "merge-copy-graphs", "device": gpu_name() if dev.type == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"merge-copy-graphs-{res['device']}.json").write_text(json.dumps(res, indent=1))
        print(f"{args.graphs}: the copy's graph set ({res['graphs_per_set']} graphs, merged and mixed kinds per "
              f"bucket) captured in {res['copy_set_capture_s']:.2f} s ({res['copy_set_capture_ms_per_graph']:.1f} ms "
              f"a graph), {res['copy_set_bytes'] / 2**20:.1f} MiB of device memory (the base set's: "
              f"{res['base_set_capture_s']:.2f} s, {res['base_set_bytes'] / 2**20:.1f} MiB); copy made in "
              f"{res['make_copy_ms']:.1f} ms")
        for b in res["graph_buckets"]:
            print(f"  merged decode step, batch {b:3}: on the copy {res['merged_step_ms_on_copy'][b]:.3f} ms, "
                  f"in place {res['merged_step_ms_in_place'][b]:.3f} ms")
        return
    h, inter, L = args.hidden, args.intermediate, args.layers
    ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": h, "gate_proj": h, "up_proj": h, "down_proj": inter}
    outs = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": h, "gate_proj": inter, "up_proj": inter, "down_proj": h}
    widths = group_widths(h, h, h, inter)
    shape = ModelShape("bench", L, ins, outs)
    reg = AdapterRegistry(shape, 128, torch.bfloat16, torch.device("cpu"), check_base_model=False, kernel="torch")
    with tempfile.TemporaryDirectory() as tmp:
        adapter = reg.register("a", write_random_adapter(Path(tmp) / "a", shape, args.rank, seed=0, std=0.01))
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {grp: (torch.randn(L, sum(wd), ins[{"qkv": "q_proj", "o": "o_proj", "gate_up": "gate_proj",
                                                 "down": "down_proj"}[grp]], generator=g, device=dev) * 0.02
                     ).to(torch.bfloat16) for grp, wd in widths.items()}
    original = {k: v.clone() for k, v in weights.items()}
    touched = sum(t.numel() * t.element_size() for t in weights.values())
    bw = copy_bandwidth(dev)
    floor = 2 * touched / bw
    stage_s, staged = timed(lambda: stage_factors(adapter, weights, widths), dev)   # once per adapter, kept
    # the engine's path: the same factors read where the adapter sits in the unified pool
    pool = UnifiedPool(-(-2 * adapter.num_bytes() // PAGE_ELEMS) + 1, 1, 16, 1, PAGE_ELEMS // 32, torch.bfloat16, dev)
    preg = AdapterRegistry(shape, 128, torch.bfloat16, dev, check_base_model=False, kernel="triton", pool=pool)
    with tempfile.TemporaryDirectory() as tmp:
        pooled = preg.register("a", write_random_adapter(Path(tmp) / "a", shape, args.rank, seed=0, std=0.01))
    assert preg.store.load(pooled)
    timed(lambda: stage_from_pool(pooled, pool.buf, weights, widths), dev)                  # warm-up
    stage_pool_s, from_pool = timed(lambda: stage_from_pool(pooled, pool.buf, weights, widths), dev)
    assert all(torch.equal(x, y) for k in staged for x, y in zip(staged[k], from_pool[k]))
    del from_pool, preg, pool
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731

    def cycles(repeats, reuse=False):
        """Merge + unmerge ``repeats`` times; with ``reuse`` every merge after the first reuses its record (as a
        switch back to the adapter unmerged last does), and the first is not counted."""
        merges, unmerges, rec = [], [], None
        for _ in range(repeats + reuse):
            t, rec = timed(lambda: merge_(weights, widths, adapter, staged=staged, reuse=rec if reuse else None),
                           dev)
            merges.append(t)
            t, _ = timed(lambda: unmerge_(weights, widths, rec), dev)
            unmerges.append(t)
        assert rec.reused == (reuse and repeats > 0)
        return merges[reuse:], unmerges[reuse:], rec

    sweep = []
    if args.sweep and dev.type == "cuda":
        for tile, walk in SWEEP:
            kernels.TILE, kernels.UNMERGE_WALK = tile, walk
            cycles(1)                                   # compiles this tile's kernels
            m, u, _ = cycles(3)
            mr, ur, _ = cycles(3, reuse=True)
            row = {"tile": tile, "unmerge_walk": walk, "merge_ms": med(m) * 1e3, "unmerge_ms": med(u) * 1e3,
                   "merge_reusing_record_ms": med(mr) * 1e3, "unmerge_after_reuse_ms": med(ur) * 1e3}
            row["cold_plus_reused_cycle_ms"] = row["merge_ms"] + row["merge_reusing_record_ms"] + 2 * row["unmerge_ms"]
            sweep.append(row)
            print(f"tile {tile} unmerge walk {walk}: merge {row['merge_ms']:.2f} ms, reusing its record "
                  f"{row['merge_reusing_record_ms']:.2f} ms, unmerge {row['unmerge_ms']:.2f} ms", flush=True)
        best = min(sweep, key=lambda r: r["cold_plus_reused_cycle_ms"])
        kernels.TILE, kernels.UNMERGE_WALK = tuple(best["tile"]), tuple(best["unmerge_walk"])
    merges, unmerges, rec = cycles(args.repeats)
    reused = cycles(args.repeats, reuse=rec.kernel) if rec.kernel else None
    exact = all(torch.equal(weights[k].view(torch.int16), original[k].view(torch.int16)) for k in weights)
    # the cost of exactness: a merge that reuses its record is the same kernel writing no record
    plain_ms = med(reused[0]) * 1e3 if reused else None
    copy = merged_copy(weights, widths, adapter, staged, args.repeats, dev) if args.merged_copy else {}
    exact = exact and all(torch.equal(weights[k].view(torch.int16), original[k].view(torch.int16)) for k in weights)
    res = {
        "benchmark": "merge", "device": gpu_name() if dev.type == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
        "config": vars(args) | {"out": str(args.out)}, "touched_weight_bytes": touched,
        "copy_bandwidth_GBps": bw / 1e9, "floor_ms": floor * 1e3,
        "merge_ms": med(merges) * 1e3, "unmerge_ms": med(unmerges) * 1e3,
        "merge_over_floor": med(merges) / floor, "unmerge_over_floor": med(unmerges) / floor,
        "merge_plus_unmerge_over_floor": (med(merges) + med(unmerges)) / (2 * floor),
        "merge_reusing_record_ms": med(reused[0]) * 1e3 if reused else None,
        "unmerge_after_reuse_ms": med(reused[1]) * 1e3 if reused else None,
        "reused_pair_over_floor": (med(reused[0]) + med(reused[1])) / (2 * floor) if reused else None,
        "stage_factors_ms": stage_s * 1e3, "stage_from_pool_ms": stage_pool_s * 1e3, "fused_kernel": rec.kernel,
        "tile": next((sr.tile for sr in rec.slices.values()), None), "tile_sweep": sweep,
        "unmerge_walk": list(kernels.UNMERGE_WALK) if rec.kernel else None, "merge_without_restore_ms": plain_ms,
        "restore_record_bytes": rec.restore_bytes(), "exceptions": rec.num_exceptions(), "bitwise_exact": exact,
        "exceptions_in_slots": sum(sr.from_slots for sr in rec.slices.values()) if rec.kernel else None,
    } | copy
    args.out.mkdir(parents=True, exist_ok=True)
    name = res["device"] if dev.type == "cuda" else "cpu"
    (args.out / f"merge-{name}.json").write_text(json.dumps(res, indent=1))
    print(f"touched weights {touched / 2**30:.2f} GiB, copy {bw / 1e9:.0f} GB/s, floor {floor * 1e3:.2f} ms")
    print(f"{'op':8} {'ms':>9} {'x floor':>8}")
    print(f"{'merge':8} {res['merge_ms']:9.2f} {res['merge_over_floor']:8.2f}")
    print(f"{'unmerge':8} {res['unmerge_ms']:9.2f} {res['unmerge_over_floor']:8.2f}")
    if reused:
        print(f"{'merge, reusing its record':26} {res['merge_reusing_record_ms']:9.2f}, then unmerge "
              f"{res['unmerge_after_reuse_ms']:.2f} ms: {res['reused_pair_over_floor']:.2f}x floor")
    print(f"merge + unmerge {res['merge_plus_unmerge_over_floor']:.2f}x floor (fused kernel: {rec.kernel}); "
          f"staging the adapter's factors once: {stage_s * 1e3:.1f} ms from the host, {stage_pool_s * 1e3:.1f} ms "
          f"from the pool")
    print(f"restore record {rec.restore_bytes() / 2**20:.1f} MiB ({rec.restore_bytes() / touched:.1%} of the "
          f"weights), {rec.num_exceptions()} exceptions ({res['exceptions_in_slots']} in the row slots, the rest "
          f"finished after the kernel); bitwise exact: {exact}")
    if plain_ms is not None:
        print(f"the merge writing no restore record (as when it reuses one): {plain_ms:.2f} ms, "
              f"{plain_ms * 1e-3 / floor:.2f}x its floor; making the record adds {res['merge_ms'] - plain_ms:.2f} ms")
    if copy:
        pair = copy["copy_switch_to_ms"] + copy["copy_switch_back_ms"]
        in_place = res["merge_ms"] + res["unmerge_ms"]
        how = "first merge + unmerge"
        if reused:
            in_place, how = res["merge_reusing_record_ms"] + res["unmerge_after_reuse_ms"], "merge reusing its record + unmerge"
        print(f"merged copy ({copy['copy_bytes'] / 2**30:.2f} GiB, {copy['copy_pages']} pool pages): made in "
              f"{copy['make_copy_ms']:.2f} ms (first merge + unmerge: {res['merge_ms'] + res['unmerge_ms']:.2f} ms); "
              f"switch to it {copy['copy_switch_to_ms']:.3f} ms, back {copy['copy_switch_back_ms']:.3f} ms "
              f"({copy['layers_pointed_per_switch']} weights pointed), against {in_place:.2f} ms in place "
              f"({how}): {in_place / max(pair, 1e-9):.0f}x; bitwise the in-place "
              f"merge: {copy['copy_bitwise_in_place']}")
        if not copy["copy_bitwise_in_place"]:
            raise SystemExit("the merged copy differs from the in-place merge")
    if not exact:
        raise SystemExit("unmerge did not restore the weights bit for bit")


if __name__ == "__main__":
    main()
