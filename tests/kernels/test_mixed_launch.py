"""Mixed mode in one launch: segments that carry a second (adapter, scale) pair give what two passes give.

Rows of adapter X with adapter M merged add X and subtract M; base-model rows subtract M alone. One shrink and
one expand (the pair's A rows after the segment's own, both products added in one store) against the two-pass
result and the float64 reference (Triton interpreter on CPU, real kernels on GPU).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_atmm import WIDTHS, make_case
from vlora.kernels.atmm import TileConfig, lora_expand, lora_shrink
from vlora.kernels.reference import lora_expand_ref, lora_shrink_ref
from vlora.kernels.segments import SegmentMeta


def _seg_tensors(segs, device):
    """(a_off, rtot, b_off, vcol) of the adapters of (start, len, adapter) segments."""
    return (torch.tensor([a["a_off"] for _, _, a in segs], dtype=torch.int64, device=device),
            torch.tensor([a["rtot"] for _, _, a in segs], dtype=torch.int32, device=device),
            torch.tensor([a["b_offs"] for _, _, a in segs], dtype=torch.int64, device=device).view(-1, 3),
            torch.tensor([a["vcols"] for _, _, a in segs], dtype=torch.int32, device=device).view(-1, 3))


def _meta(segs, device, pairs=None):
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)      # noqa: E731
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)    # noqa: E731
    lens = [n for _, n, _ in segs]
    return SegmentMeta(i32([s for s, _, _ in segs]), i32(lens), i32([a["r"] for _, _, a in segs]),
                       f32([a["scale"] for _, _, a in segs]), max(lens), sum(lens),
                       pair_ranks=None if pairs is None else i32([0 if p is None else p["r"] for p in pairs]),
                       pair_scales=None if pairs is None else f32([0.0 if p is None else p["scale"] for p in pairs]))


def mixed_case(dtype, device, seed):
    """A flat buffer, x, and the mixed iteration's segments: (start, len, own adapter, pair adapter or None).
    The merged adapter M (rank 16, every slice) is subtracted from every segment; segments of M itself get
    none; base-model rows (M alone, no pair) sit between them."""
    w, x, segs = make_case("zipf", 8, [1, 5, 17, 2, 33, 3], ranks=[8, 16, 8], dtype=dtype, device=device, seed=seed)
    adapters = list({id(a): a for _, _, a in segs}.values())
    merged = next(a for a in adapters if a["r"] == 16)
    minus = dict(merged, scale=-merged["scale"])
    out = []
    for i, (s, n, a) in enumerate(segs):
        if a is merged:
            continue                                   # rows of the merged adapter: no LoRA at all
        out.append((s, n, minus, None) if i % 4 == 3 else (s, n, a, minus))   # some base-model rows
    return w, x, out


def one_launch(w, x, segs, cfg_s, cfg_e, max_rank=None):
    dev = x.device
    own = [(s, n, a) for s, n, a, _ in segs]
    pairs = [p for *_, p in segs]
    meta = _meta(own, dev, pairs)
    a_off, rtot, b_off, vcol = _seg_tensors(own, dev)
    a2, r2, b2, v2 = _seg_tensors([(s, n, p or a) for s, n, a, p in segs], dev)     # no pair: unread stand-in
    r_max = max(a["rtot"] + (0 if p is None else p["rtot"]) for _, _, a, p in segs)
    v = lora_shrink(x, w, a_off, rtot, meta, r_max, cfg_s, pair=(a2, r2),
                    out=torch.full((cfg_s.split_k, x.shape[0], r_max), float("nan"), device=dev))   # poisoned
    y0 = torch.randn(x.shape[0], sum(WIDTHS), generator=torch.Generator().manual_seed(1)).to(x.dtype).to(dev)
    y = lora_expand(y0.clone(), v, w, b_off, vcol, WIDTHS, meta, cfg_e, max_rank=max_rank, pair=(b2, v2, rtot))
    return y0, y


def two_launches(w, x, segs, cfg_s, cfg_e, y0):
    """The same sums as two passes: own adapters, then the pairs."""
    y = y0.clone()
    for part in ([(s, n, a) for s, n, a, _ in segs], [(s, n, p) for s, n, _, p in segs if p is not None]):
        meta = _meta(part, x.device)
        a_off, rtot, b_off, vcol = _seg_tensors(part, x.device)
        r_max = int(rtot.max())
        lora_expand(y, lora_shrink(x, w, a_off, rtot, meta, r_max, cfg_s), w, b_off, vcol, WIDTHS, meta, cfg_e)
    return y


def reference(w, x, segs, y0):
    y = y0.double()
    for part in ([(s, n, a) for s, n, a, _ in segs], [(s, n, p) for s, n, _, p in segs if p is not None]):
        starts, lens = [s for s, _, _ in part], [n for _, n, _ in part]
        a_off, rtot, b_off, vcol = (t.tolist() for t in _seg_tensors(part, "cpu"))
        v = lora_shrink_ref(x.cpu(), w.cpu(), a_off, rtot, starts, lens, max(rtot))
        y = lora_expand_ref(y.cpu(), v, w.cpu(), b_off, vcol, WIDTHS, starts, lens, [a["r"] for *_, a in part],
                            [a["scale"] for *_, a in part])
    return y


CONFIGS = [(TileConfig(16, 16, 16), TileConfig(16, 16, 16), None),
           (TileConfig(16, 16, 16, split_k=2), TileConfig(16, 16, 16, m_loop=2, n_loop=2), None),
           (TileConfig(16, 32, 16, split_k=3, reduce=1), TileConfig(16, 16, 16, n_loop=2, hoist=1), 16)]


@pytest.mark.parametrize("cfg_s, cfg_e, max_rank", CONFIGS, ids=["plain", "planes-loops", "reduce-hoisted"])
def test_one_launch_equals_two_launches_and_the_float64_reference(cfg_s, cfg_e, max_rank):
    w, x, segs = mixed_case(torch.float32, "cpu", seed=4)
    assert any(p is None for *_, p in segs) and any(p is not None for *_, p in segs)
    y0, y = one_launch(w, x, segs, cfg_s, cfg_e, max_rank)
    torch.testing.assert_close(y.double(), reference(w, x, segs, y0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, two_launches(w, x, segs, cfg_s, cfg_e, y0), rtol=1e-5, atol=1e-5)
    covered = torch.zeros(x.shape[0], dtype=torch.bool)
    for s, n, *_ in segs:
        covered[s:s + n] = True
    assert torch.equal(y[~covered], y0[~covered])       # the merged adapter's rows and base gaps untouched


def test_pair_of_the_same_adapter_cancels():
    """X paired with (X, -s_X): the delta is exactly zero up to rounding, one launch."""
    w, x, segs = make_case("uniform", 5, [4, 9, 1], ranks=[8, 16], dtype=torch.float32, device="cpu", seed=2)
    cancel = [(s, n, a, dict(a, scale=-a["scale"])) for s, n, a in segs]
    y0, y = one_launch(w, x, cancel, TileConfig(16, 16, 16), TileConfig(16, 16, 16))
    torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_one_launch_within_tolerance_of_two(dtype):
    w, x, segs = mixed_case(dtype, "cuda", seed=7)
    for cfg_s, cfg_e, max_rank in CONFIGS + [(TileConfig(16, 64, 64, split_k=4, reduce=1),
                                              TileConfig(16, 64, 64, n_loop=2, hoist=1), 16)]:
        y0, y = one_launch(w, x, segs, cfg_s, cfg_e, max_rank)
        ref = reference(w, x, segs, y0)
        assert (y.double().cpu() - ref).norm() / (ref - y0.double().cpu()).norm() <= 1e-2
        two = two_launches(w, x, segs, cfg_s, cfg_e, y0)
        assert (y.double() - two.double()).norm() / (two.double() - y0.double()).norm() <= 1e-2
