"""ATMM kernels against the float64 reference (Triton interpreter on CPU, real kernels on GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from vlora.kernels import atmm
from vlora.kernels.atmm import TileConfig, lora_expand, lora_shrink
from vlora.kernels.reference import lora_expand_ref, lora_shrink_ref
from vlora.kernels.segments import SegmentMeta

WIDTHS = (48, 16, 16)          # a packed q, k, v group (GQA: k and v narrower)
K = 40                          # not a multiple of any BLOCK_K: exercises masking (EVEN_K off)


def zipf_choice(rng, n, alpha=1.5):
    weights = [1 / (i + 1) ** alpha for i in range(n)]
    return rng.choices(range(n), weights)[0]


def make_case(dist, num_segs, lens, ranks, dtype, device, seed=0, gaps=True):
    """Flat weight buffer with adapters at scattered offsets, segments with base-only rows between."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_adapters = {"identical": 1, "uniform": 4, "zipf": 6, "distinct": num_segs}[dist]
    adapters = []
    chunks, off = [], 0
    for i in range(num_adapters):
        r = ranks[i % len(ranks)]
        present = [True, rng.random() < 0.7, True] if dist != "identical" else [True, True, True]
        pad = rng.randrange(0, 7)                      # adapters are not packed back to back
        chunks.append(torch.full((pad,), float("nan")))
        off += pad
        a_off = off
        n_present = sum(present)
        chunks.append(torch.randn(n_present * r * K, generator=g) * 0.3)
        off += n_present * r * K
        b_offs, vcols, j_present = [], [], 0
        for j, p in enumerate(present):
            if p:
                chunks.append(torch.randn(r * WIDTHS[j], generator=g) * 0.3)
                b_offs.append(off)
                vcols.append(j_present * r)
                off += r * WIDTHS[j]
                j_present += 1
            else:
                b_offs.append(-1)
                vcols.append(0)
        adapters.append(dict(r=r, a_off=a_off, rtot=n_present * r, b_offs=b_offs, vcols=vcols,
                             scale=rng.choice([0.5, 2.0, -1.0])))
    w = torch.cat(chunks).to(dtype)
    segs, row = [], 0
    for s in range(num_segs):
        row += rng.randrange(0, 3) if gaps else 0     # rows in no segment: base model only
        n = lens[s % len(lens)]
        choice = {"identical": 0, "uniform": s % num_adapters, "distinct": s,
                  "zipf": None}[dist]
        if choice is None:
            choice = zipf_choice(rng, num_adapters)
        segs.append((row, n, adapters[choice]))
        row += n
    total = row + (2 if gaps else 0)
    x = (torch.randn(total, K, generator=g)).to(dtype)
    return w.to(device), x.to(device), segs


def metas(segs, device):
    starts = [s for s, _, _ in segs]
    lens = [n for _, n, _ in segs]
    meta = SegmentMeta(
        starts=torch.tensor(starts, dtype=torch.int32, device=device),
        lens=torch.tensor(lens, dtype=torch.int32, device=device),
        ranks=torch.tensor([a["r"] for _, _, a in segs], dtype=torch.int32, device=device),
        scales=torch.tensor([a["scale"] for _, _, a in segs], dtype=torch.float32, device=device),
        max_len=max(lens, default=0), num_rows=sum(lens))
    return meta, starts, lens


def run_both(segs, w, x, cfg_s, cfg_e, device):
    meta, starts, lens = metas(segs, device)
    a_off = torch.tensor([a["a_off"] for _, _, a in segs], dtype=torch.int64, device=device)
    rtot = torch.tensor([a["rtot"] for _, _, a in segs], dtype=torch.int32, device=device)
    b_off = torch.tensor([a["b_offs"] for _, _, a in segs], dtype=torch.int64, device=device).view(-1, 3)
    vcol = torch.tensor([a["vcols"] for _, _, a in segs], dtype=torch.int32, device=device).view(-1, 3)
    r_max = max([a["rtot"] for _, _, a in segs], default=1)
    v = lora_shrink(x, w, a_off, rtot, meta, r_max, cfg_s, out=torch.full(
        (cfg_s.split_k, x.shape[0], r_max), float("nan"), device=device))      # poisoned
    v_ref = lora_shrink_ref(x, w, a_off.tolist(), rtot.tolist(), starts, lens, r_max)
    y0 = torch.randn(x.shape[0], sum(WIDTHS), dtype=x.dtype, device=device)
    y = lora_expand(y0.clone(), v, w, b_off, vcol, WIDTHS, meta, cfg_e)
    y_ref = lora_expand_ref(y0, v_ref, w, b_off.tolist(), vcol.tolist(), WIDTHS, starts, lens,
                            meta.ranks.tolist(), meta.scales.tolist())
    return defined(v, segs), v_ref, y, y_ref, y0, starts, lens


def defined(v, segs):
    """Sum of the split-K planes on the entries the kernel defines (segment rows, R_s columns); 0 elsewhere."""
    out = torch.zeros(v.shape[1:], dtype=v.dtype, device=v.device)
    for s, n, a in segs:
        out[s:s + n, :a["rtot"]] = v[:, s:s + n, :a["rtot"]].sum(0)
    return out


CONFIGS = [TileConfig(16, 16, 16), TileConfig(32, 16, 32, split_k=2), TileConfig(16, 32, 16, split_k=3, m_loop=2),
           TileConfig(16, 16, 16, split_k=2, reduce=1)]


@pytest.mark.parametrize("dist", ["identical", "uniform", "zipf", "distinct"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c.as_list()[:4])))
def test_shrink_expand_match_float64_reference(dist, cfg):
    lens = [1, 5, 17, 33, 0, 2] if dist != "identical" else [40, 9]
    w, x, segs = make_case(dist, 7, lens, ranks=[8, 16, 4], dtype=torch.float32, device="cpu", seed=hash(dist) % 97)
    v, v_ref, y, y_ref, y0, starts, lens = run_both(segs, w, x, cfg, TileConfig(cfg.block_m, 16, 16, m_loop=cfg.m_loop, n_loop=cfg.split_k), "cpu")
    torch.testing.assert_close(v.double(), v_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    covered = torch.zeros(x.shape[0], dtype=torch.bool)
    for s, n in zip(starts, lens):
        covered[s:s + n] = True
    assert torch.equal(y[~covered], y0[~covered])           # base-only rows untouched, bit for bit


@pytest.mark.parametrize("dist", ["uniform", "distinct"])
@pytest.mark.parametrize("cfg", [TileConfig(16, 16, 16, n_loop=2, num_stages=2, hoist=1),
                                 TileConfig(16, 32, 16, n_loop=3, num_stages=1, hoist=1)],
                         ids=["strip2", "strip3"])
def test_hoisted_expand_matches_float64_reference(dist, cfg):
    """The decode expand with v loaded once and the strip of B as the pipelined inner loop: the same result
    (ranks up to the K tile; split-K planes of the shrink summed)."""
    lens = [1, 2, 5, 0, 3, 1, 4]
    w, x, segs = make_case(dist, 7, lens, ranks=[8, 16, 4], dtype=torch.float32, device="cpu", seed=5)
    meta, starts, lens = metas(segs, "cpu")
    b_off = torch.tensor([a["b_offs"] for _, _, a in segs], dtype=torch.int64).view(-1, 3)
    vcol = torch.tensor([a["vcols"] for _, _, a in segs], dtype=torch.int32).view(-1, 3)
    r_max = max(a["rtot"] for _, _, a in segs)
    v = torch.randn(2, x.shape[0], r_max)                           # two split-K planes
    y0 = torch.randn(x.shape[0], sum(WIDTHS))
    y = lora_expand(y0.clone(), v, w, b_off, vcol, WIDTHS, meta, cfg, max_rank=16)
    y_ref = lora_expand_ref(y0, v.sum(0).double(), w, b_off.tolist(), vcol.tolist(), WIDTHS, starts, lens,
                            meta.ranks.tolist(), meta.scales.tolist())
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    plain = lora_expand(y0.clone(), v, w, b_off, vcol, WIDTHS, meta, cfg)       # rank bound unknown: not hoisted
    torch.testing.assert_close(plain, y, rtol=1e-5, atol=1e-5)


def test_shrink_writes_every_covered_entry_of_a_poisoned_output():
    w, x, segs = make_case("uniform", 5, [3, 18, 1], ranks=[16, 8], dtype=torch.float32, device="cpu", seed=5)
    meta, starts, lens = metas(segs, "cpu")
    a_off = torch.tensor([a["a_off"] for _, _, a in segs], dtype=torch.int64)
    rtot = torch.tensor([a["rtot"] for _, _, a in segs], dtype=torch.int32)
    r_max = int(rtot.max())
    for split, reduce in ((1, 0), (3, 0), (3, 1)):
        poison = torch.full((split, x.shape[0], r_max), float("nan"))
        cfg = TileConfig(16, 16, 16, split_k=split, reduce=reduce)
        v = lora_shrink(x, w, a_off, rtot, meta, r_max, cfg, out=poison)
        ref = lora_shrink_ref(x, w, a_off.tolist(), rtot.tolist(), starts, lens, r_max)
        assert v.shape == (cfg.planes, x.shape[0], r_max) and v.data_ptr() == poison.data_ptr()   # planes of out
        for (s, n, a) in segs:
            got = v[:, s:s + n, :a["rtot"]].sum(0).double()
            assert torch.isfinite(got).all()                       # every defined entry was written
            torch.testing.assert_close(got, ref[s:s + n, :a["rtot"]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_parts_are_summed_in_the_kernel_and_leave_the_counters_at_zero(split):
    """The last part of a tile to finish sums the planes into plane 0 (in plane order: the same bits call after
    call) and sets the tile's counter back to 0 for the next launch."""
    w, x, segs = make_case("zipf", 6, [7, 33, 2, 0], ranks=[16, 8, 4], dtype=torch.float32, device="cpu", seed=3)
    meta, starts, lens = metas(segs, "cpu")
    a_off = torch.tensor([a["a_off"] for _, _, a in segs], dtype=torch.int64)
    rtot = torch.tensor([a["rtot"] for _, _, a in segs], dtype=torch.int32)
    r_max = int(rtot.max())
    ref = lora_shrink_ref(x, w, a_off.tolist(), rtot.tolist(), starts, lens, r_max)
    outs = []
    for _ in range(3):
        planes = torch.full((split, x.shape[0], r_max), float("nan"))
        v = lora_shrink(x, w, a_off, rtot, meta, r_max, TileConfig(16, 16, 16, split_k=split, reduce=1), out=planes)
        assert v.shape[0] == 1 and int(atmm.tile_counts(x.device, 1).abs().sum()) == 0
        for s, n, a in segs:
            torch.testing.assert_close(v[0, s:s + n, :a["rtot"]].double(), ref[s:s + n, :a["rtot"]], rtol=1e-4,
                                       atol=1e-4)
        outs.append(v[0].clone())
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0, equal_nan=True)


def test_delora_pair_is_a_second_pass_with_negative_scale():
    """Rows of adapter i on a model with adapter m merged: + A_i B_i, then - A_m B_m in a second pass."""
    w, x, segs = make_case("uniform", 4, [6, 3], ranks=[8, 16], dtype=torch.float32, device="cpu", seed=9)
    cfg = TileConfig(16, 16, 16)
    _, _, y1, y1_ref, y0, starts, lens = run_both(segs, w, x, cfg, cfg, "cpu")
    merged = dict(segs[0][2], scale=-segs[0][2]["scale"])
    minus = [(s, n, merged) for s, n, _ in segs]
    meta, _, _ = metas(minus, "cpu")
    a_off = torch.tensor([merged["a_off"]] * len(minus), dtype=torch.int64)
    rtot = torch.tensor([merged["rtot"]] * len(minus), dtype=torch.int32)
    b_off = torch.tensor([merged["b_offs"]] * len(minus), dtype=torch.int64)
    vcol = torch.tensor([merged["vcols"]] * len(minus), dtype=torch.int32)
    v = lora_shrink(x, w, a_off, rtot, meta, merged["rtot"], cfg)
    y2 = lora_expand(y1.clone(), v, w, b_off, vcol, WIDTHS, meta, cfg)
    v_ref = lora_shrink_ref(x, w, a_off.tolist(), rtot.tolist(), starts, lens, merged["rtot"])
    y2_ref = lora_expand_ref(y1_ref, v_ref, w, b_off.tolist(), vcol.tolist(), WIDTHS, starts, lens,
                             meta.ranks.tolist(), meta.scales.tolist())
    torch.testing.assert_close(y2.double(), y2_ref, rtol=1e-4, atol=1e-4)
    # the segment already on the merged adapter comes back to the base output
    s, n, _ = segs[0]
    torch.testing.assert_close(y2[s:s + n].double(), y0[s:s + n].double(), rtol=1e-4, atol=1e-4)


def test_no_segments_is_a_no_op():
    x = torch.randn(4, K)
    y = torch.randn(4, sum(WIDTHS))
    meta = SegmentMeta(*(torch.zeros(0, dtype=t) for t in (torch.int32, torch.int32, torch.int32, torch.float32)),
                       max_len=0, num_rows=0)
    v = lora_shrink(x, torch.zeros(8), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                    meta, 8, TileConfig(16, 16, 16))
    assert v.shape == (1, 4, 8)
    out = lora_expand(y.clone(), v, torch.zeros(8), torch.zeros(0, 3, dtype=torch.int64),
                      torch.zeros(0, 3, dtype=torch.int32), WIDTHS, meta, TileConfig(16, 16, 16))
    assert torch.equal(out, y)


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["identical", "uniform", "zipf", "distinct"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_bf16_within_benchmark_tolerance(dist, dtype):
    w, x, segs = make_case(dist, 9, [1, 7, 64, 130, 3], ranks=[16, 64, 8, 32], dtype=dtype, device="cuda", seed=3)
    for cfg in (TileConfig(16, 32, 64), TileConfig(64, 64, 32, split_k=4, num_warps=8),
                TileConfig(64, 64, 32, split_k=4, num_warps=8, reduce=1)):
        v, v_ref, y, y_ref, *_ = run_both(segs, w, x, cfg, TileConfig(cfg.block_m, 64, 16), "cuda")
        assert (v.double() - v_ref).norm() / v_ref.norm() <= 1e-2
        assert (y.double() - y_ref).norm() / y_ref.norm() <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg_s, cfg_e", [(TileConfig(16, 64, 64, split_k=4, reduce=1), TileConfig(16, 64, 64, n_loop=2, hoist=1)),
                                          (TileConfig(32, 32, 32, split_k=2), TileConfig(32, 64, 16, m_loop=2)),
                                          (TileConfig(16, 32, 64), TileConfig(16, 32, 64, hoist=1))],
                         ids=["reduce-hoisted", "planes-mloop", "plain-hoisted"])
def test_gpu_pdl_pairs_in_a_graph_match_sequential_launches(cfg_s, cfg_e):
    """The expand launched as a programmatic dependent of the shrink (Hopper) reads v only once the shrink is
    done: several pairs back to back in one CUDA graph, each expand's y feeding the next pair's x, give the bits
    of the same pairs launched one after the other, and the float64 reference (a race would show as bits that
    differ, not reliably: this checks the ordering the kernels promise, it cannot prove it)."""
    if not atmm.pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9")
    w, x, segs = make_case("zipf", 9, [1, 7, 64, 130, 3], ranks=[16, 64, 8, 32], dtype=torch.bfloat16,
                           device="cuda", seed=5, gaps=False)
    assert x.shape[0] == sum(n for _, n, _ in segs) and sum(WIDTHS) > K
    meta, starts, lens = metas(segs, "cuda")
    a_off = torch.tensor([a["a_off"] for _, _, a in segs], dtype=torch.int64, device="cuda")
    rtot = torch.tensor([a["rtot"] for _, _, a in segs], dtype=torch.int32, device="cuda")
    b_off = torch.tensor([a["b_offs"] for _, _, a in segs], dtype=torch.int64, device="cuda").view(-1, 3)
    vcol = torch.tensor([a["vcols"] for _, _, a in segs], dtype=torch.int32, device="cuda").view(-1, 3)
    r_max = max(a["rtot"] for _, _, a in segs)
    y0 = torch.randn(x.shape[0], sum(WIDTHS), dtype=x.dtype, device="cuda")

    no_slice = torch.full_like(b_off, -1)        # an adapter that targets none of the group: no program has work

    def chain(ys, pdl):
        """Pair i reads x from y[i] (the previous expand's output) and adds into y[i+1]; pair 1's expand has no
        work; the last pair runs as mixed mode does: two shrinks, then two expands into the same y."""
        for i in range(len(ys) - 1):
            xi = ys[i][:, :K].contiguous() if i else x
            v = lora_shrink(xi, w, a_off, rtot, meta, r_max, cfg_s, pdl=pdl)
            if i == len(ys) - 2:
                v2 = lora_shrink(xi, w, a_off, rtot, meta, r_max, cfg_s, pdl=pdl)
                lora_expand(ys[i + 1], v, w, b_off, vcol, WIDTHS, meta, cfg_e, max_rank=64, pdl=pdl)
                lora_expand(ys[i + 1], v2, w, b_off, vcol, WIDTHS, meta, cfg_e, max_rank=64, pdl=pdl)
            else:
                lora_expand(ys[i + 1], v, w, no_slice if i == 1 else b_off, vcol, WIDTHS, meta, cfg_e, max_rank=64,
                            pdl=pdl)

    def run(pdl):
        ys = [y0.clone() for _ in range(5)]
        chain(ys, pdl)                              # eager (compiles), then captured and replayed
        for y in ys:
            y.copy_(y0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(ys, pdl)
        for _ in range(3):
            for y in ys:
                y.copy_(y0)
            graph.replay()
        torch.cuda.synchronize()
        return ys

    with_pdl, without = run(True), run(False)
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
    assert torch.equal(with_pdl[2], y0)                     # pair 1 added nothing
    v_ref = lora_shrink_ref(x, w, a_off.tolist(), rtot.tolist(), starts, lens, r_max)
    y_ref = lora_expand_ref(y0, v_ref, w, b_off.tolist(), vcol.tolist(), WIDTHS, starts, lens,
                            meta.ranks.tolist(), meta.scales.tolist())
    assert (with_pdl[1].double() - y_ref).norm() / y_ref.norm() <= 1e-2


def test_even_k_path_matches_reference(monkeypatch):
    """K a multiple of BLOCK_K * split_k takes the unmasked-K loads."""
    import tests.kernels.test_atmm as t

    monkeypatch.setattr(t, "K", 64)
    w, x, segs = make_case("zipf", 6, [2, 19, 5], ranks=[8, 16], dtype=torch.float32, device="cpu", seed=11)
    for cfg in (TileConfig(16, 16, 32), TileConfig(32, 16, 16, split_k=2)):
        v, v_ref, y, y_ref, *_ = run_both(segs, w, x, cfg, TileConfig(16, 16, 16, m_loop=3), "cpu")
        torch.testing.assert_close(v.double(), v_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)


def test_adapter_buffer_aligns_every_matrix(tmp_path):
    """The engine promises the kernels 16-element alignment of every A and B (aligned=True)."""
    from vlora.lora.adapter import ModelShape
    from vlora.lora.random_adapter import write_random_adapter
    from vlora.lora.registry import AdapterRegistry
    from vlora.memory.pool import UnifiedPool

    ins = {"q_proj": 64, "k_proj": 64, "v_proj": 64, "o_proj": 64, "gate_proj": 64, "up_proj": 64, "down_proj": 128}
    outs = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64, "gate_proj": 128, "up_proj": 128, "down_proj": 64}
    shape = ModelShape("tiny", 2, ins, outs)
    pool = UnifiedPool(256, 2, 2, 4, 16, torch.float32, torch.device("cpu"))    # pages of 512 elements
    reg = AdapterRegistry(shape, 64, torch.float32, torch.device("cpu"), kernel="triton", pool=pool)
    for i, r in enumerate((8, 24, 5)):           # rank 5: odd sizes get padded
        reg.register(f"a{i}", write_random_adapter(tmp_path / f"a{i}", shape, r, seed=i, targets=("q_proj", "v_proj", "down_proj")))
    reg.unregister("a1")
    reg.register("a3", write_random_adapter(tmp_path / "a3", shape, 16, seed=3))
    assert reg.store.ensure([reg.get(n) for n in reg.names()], set()) == set(reg.names())
    for name in reg.names():
        for g in reg.get(name).offsets.values():
            assert (g.a_off % 16 == 0).all() and (g.b_off[g.b_off >= 0] % 16 == 0).all()
