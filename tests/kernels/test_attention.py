"""Paged attention kernels against the float64 reference (interpreter on CPU, real kernels on GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from vlora.kernels.attention import paged_decode, paged_prefill
from vlora.kernels.reference import paged_decode_ref, paged_prefill_ref


def paged_case(ctx_lens, page, hq, hkv, d, dtype, device, seed=0, spare_blocks=3):
    """Random caches whose sequences own scattered, shuffled blocks; returns (k, v, tables [S, nb] int32)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in ctx_lens]
    num_blocks = sum(need) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    nb = max(max(need), 1)
    tables = torch.zeros(len(ctx_lens), nb, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    k = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    return k.to(device), v.to(device), tables.to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


CASES = [  # (ctx lens, page, Hq, Hkv, D, window)
    ([1, 17, 64, 5], 16, 4, 4, 32, 0),
    ([33, 2, 100], 8, 4, 2, 64, 0),           # GQA, page 8
    ([70, 9], 16, 6, 2, 48, 0),               # head dim not a power of two
    ([90, 40, 3], 16, 4, 1, 32, 24),          # MQA + sliding window
]


@pytest.mark.parametrize("parts", [1, 3, None])
@pytest.mark.parametrize("ctx_lens,page,hq,hkv,d,window", CASES)
def test_decode_matches_reference(ctx_lens, page, hq, hkv, d, window, parts):
    """parts > 1: each context split in parts (flash-decoding) and reduced; None: chosen from the batch."""
    k, v, tables = paged_case(ctx_lens + [0], page, hq, hkv, d, torch.float32, "cpu", seed=len(ctx_lens))
    lens = torch.tensor(ctx_lens + [0], dtype=torch.int32)          # last row: a padded (empty) slot
    q = torch.randn(len(lens), hq, d)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, k, v, tables, lens, 0.3, window, out=out, block_n=16, parts=parts, max_ctx=max(ctx_lens))
    ref = paged_decode_ref(q, k, v, tables, lens, 0.3, window)
    assert torch.isfinite(out).all(), "every row written"
    assert out[-1].abs().max() == 0, "a row of length 0 is zeros"
    assert rel_err(out, ref) < 1e-5


def test_split_decode_cuts_each_context_not_the_capacity():
    """A split chosen for a long capacity (a CUDA graph's max_model_len) on short contexts, with and without a
    sliding window: each program cuts its own context, and the parts reduce to the reference."""
    ctx_lens, page, hq, hkv, d = [50, 9], 8, 4, 2, 16
    k, v, tables = paged_case(ctx_lens, page, hq, hkv, d, torch.float32, "cpu", seed=5)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    q = torch.randn(2, hq, d)
    ref = paged_decode_ref(q, k, v, tables, lens, 0.3, 0)
    for window in (0, 20):
        out = paged_decode(q, k, v, tables, lens, 0.3, window, block_n=16, parts=3, max_ctx=4096)
        assert rel_err(out, paged_decode_ref(q, k, v, tables, lens, 0.3, window)) < 1e-5
    assert rel_err(out, ref) > 1e-3, "the window changes the result (the check above can fail)"


@pytest.mark.parametrize("ctx_lens,page,hq,hkv,d,window", CASES)
def test_prefill_with_cached_prefix_matches_reference(ctx_lens, page, hq, hkv, d, window):
    """Chunks with and without a cached prefix, ragged lengths, rows of no chunk left untouched."""
    rng = random.Random(7)
    q_lens = [rng.randint(1, n) if i % 2 else n for i, n in enumerate(ctx_lens)]   # even: no prefix
    k, v, tables = paged_case(ctx_lens, page, hq, hkv, d, torch.float32, "cpu", seed=3)
    starts, row = [], 2                                      # rows 0-1: decodes, not prefill rows
    for n in q_lens:
        starts.append(row)
        row += n
    q = torch.randn(row + 1, hq, d)                          # one trailing row of no chunk
    out = torch.full_like(q, float("nan"))
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)       # noqa: E731
    paged_prefill(q, k, v, tables, t(starts), t(q_lens), t(ctx_lens), max(q_lens), 0.3, window, out=out,
                  block_m=16, block_n=16)
    ref = paged_prefill_ref(q, k, v, tables, t(starts), t(q_lens), t(ctx_lens), 0.3, window)
    rows = torch.zeros(len(q), dtype=torch.bool)
    for s, n in zip(starts, q_lens):
        rows[s:s + n] = True
    assert torch.isfinite(out[rows]).all(), "every chunk row written"
    assert torch.isnan(out[~rows]).all(), "rows of no chunk untouched"
    assert rel_err(out[rows], ref[rows]) < 1e-5


def test_decode_equals_prefill_of_last_token():
    """The two kernels agree: decoding token n equals the last row of a prefill over n tokens."""
    k, v, tables = paged_case([37], 16, 4, 2, 32, torch.float32, "cpu")
    q = torch.randn(1, 4, 32)
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)       # noqa: E731
    dec = paged_decode(q, k, v, tables, t([37]), 0.2, block_n=16)
    pre = paged_prefill(q, k, v, tables, t([0]), t([1]), t([37]), 1, 0.2, block_m=16, block_n=16)
    torch.testing.assert_close(dec, pre, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [16, 32])
def test_gpu_kernels_match_reference(dtype, page):
    """Llama-shaped heads (D=128, GQA 32/8), long ragged contexts, the default tiles; bf16 tolerance 1e-2."""
    ctx_lens = [1, 130, 700, 2049, 513]
    k, v, tables = paged_case(ctx_lens, page, 32, 8, 128, dtype, "cuda", seed=1)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(ctx_lens), 32, 128, device="cuda").to(dtype)
    out = paged_decode(q, k, v, tables, lens, 128 ** -0.5)
    assert rel_err(out, paged_decode_ref(q, k, v, tables, lens, 128 ** -0.5)) < 1e-2
    q_lens = [1, 64, 700, 1000, 13]
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda").to(dtype)
    t = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")   # noqa: E731
    out = paged_prefill(q, k, v, tables, t(starts), t(q_lens), lens, max(q_lens), 128 ** -0.5)
    ref = paged_prefill_ref(q, k, v, tables, t(starts), t(q_lens), lens, 128 ** -0.5)
    assert rel_err(out, ref) < 1e-2


def test_kernels_read_blocks_at_the_pool_page_stride():
    """Caches that are one layer's slice of the unified pool's pages ([P, L, 2, page, Hkv, D][:, l, 0]): the
    same results as contiguous copies."""
    k, v, tables = paged_case([40, 7], 8, 4, 2, 32, torch.float32, "cpu", seed=5)
    pool = torch.full((k.shape[0], 3, 2, 8, 2, 32), float("nan"))
    pool[:, 1, 0], pool[:, 1, 1] = k, v
    ks, vs = pool[:, 1, 0], pool[:, 1, 1]
    assert not ks.is_contiguous()
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)       # noqa: E731
    q = torch.randn(2, 4, 32)
    torch.testing.assert_close(paged_decode(q, ks, vs, tables, t([40, 7]), 0.3, block_n=16, parts=2, max_ctx=40),
                               paged_decode(q, k, v, tables, t([40, 7]), 0.3, block_n=16, parts=2, max_ctx=40))
    qp = torch.randn(47, 4, 32)
    args = (tables, t([0, 40]), t([40, 7]), t([40, 7]), 40, 0.3)
    torch.testing.assert_close(paged_prefill(qp, ks, vs, *args, block_m=16, block_n=16),
                               paged_prefill(qp, k, v, *args, block_m=16, block_n=16))
