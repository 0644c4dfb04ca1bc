"""The fused Triton merge/unmerge (interpreter on CPU, real kernels on GPU): bitwise exact after many cycles,
exceptions in the row slots and, past a row's first, finished after the kernel, merged weights equal to the torch
path's up to rounding."""

from __future__ import annotations

import random

import pytest
import torch

from tests.lora.test_merge import INS, LAYERS, OUTS, WIDTHS, stacked_weights
from vlora.lora.adapter import ModelShape
from vlora.lora.merge import merge_, unmerge_
from vlora.lora.random_adapter import write_random_adapter
from vlora.lora.registry import AdapterRegistry

TARGETS = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           ("down_proj",), ("k_proj", "up_proj")]


def adapters_for(tmp_path, dtype, n=4):
    shape = ModelShape("tiny", LAYERS, INS, OUTS)
    reg = AdapterRegistry(shape, 64, dtype, torch.device("cpu"), check_base_model=False)
    rng = random.Random(1)
    return [reg.register(f"a{i}", write_random_adapter(tmp_path / f"a{i}", shape, rank=rng.choice([4, 8, 16]),
                                                        seed=i, std=rng.choice([0.05, 0.5]), targets=TARGETS[i % 4]))
            for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tile", [(16, 32, 4), (64, 128, 4)])   # every slice divided by the tile; most not
def test_fused_cycles_are_bitwise_exact(tmp_path, monkeypatch, dtype, tile):
    from vlora.kernels import merge as kernels

    monkeypatch.setattr(kernels, "TILE", tile)
    adapters = adapters_for(tmp_path, dtype)
    weights = stacked_weights(dtype)
    original = {k: v.clone() for k, v in weights.items()}
    in_slots = finished = 0
    for cycle, a in enumerate(adapters):   # each adapter once, each at a scale of its own (large ones raise exceptions)
        rec = merge_(weights, WIDTHS, a, scale=(7.5, -a.scaling, a.scaling, -7.5)[cycle % 4],
                     kernel=True)
        assert rec.kernel and any(not torch.equal(weights[g], original[g]) for g in weights)
        in_slots += sum(sr.from_slots for sr in rec.slices.values())
        finished += sum(sr.exc_index.numel() - sr.from_slots for sr in rec.slices.values())
        unmerge_(weights, WIDTHS, rec)
        for g in weights:
            assert torch.equal(weights[g].view(torch.uint8), original[g].view(torch.uint8)), (cycle, g)
    assert in_slots > 0 and finished > 0               # the large scales put several exceptions in a tile row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_merge_is_as_accurate_as_torch_merge(tmp_path, dtype):
    """Both paths' merged weights lie within the rounding-error bound of the exact (float64) sum W + s·Σ_k a_k·b_k,
    which is relative to the terms' magnitude |W| + |s|·Σ_k|a_k·b_k|, not to the result's: where the delta cancels
    the weight, two correct summation orders (Triton's dot and torch's matmul, whose order depends on the CPU's
    vector units) differ by many units of the small result. The elements finished after the kernel (ΔW summed in
    float64, rounded once) are within one unit of the exact sum."""
    a = adapters_for(tmp_path, dtype, n=2)[1]
    ref, fused, orig = stacked_weights(dtype), stacked_weights(dtype), stacked_weights(dtype)
    merge_(ref, WIDTHS, a, kernel=False)
    rec = merge_(fused, WIDTHS, a, kernel=True)
    unit = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
    for g in ref:
        exact, mag = orig[g].double().clone(), orig[g].double().abs()
        row0, rank = 0, 0
        for j, width in enumerate(WIDTHS[g]):
            if (g, j) in rec.factors:
                fa, fb = (f.double() for f in rec.factors[(g, j)])
                exact[:, row0:row0 + width] += rec.scale * torch.einsum("lir,lro->loi", fa, fb)
                mag[:, row0:row0 + width] += abs(rec.scale) * torch.einsum("lir,lro->loi", fa.abs(), fb.abs())
                rank = max(rank, fa.shape[-1])
            row0 += width
        # one rounding of the result to the dtype, plus the float32 dot's (rank + 1 roundings of partial sums,
        # each within float32's eps·mag)
        bound = unit * exact.abs() + (rank + 1) * torch.finfo(torch.float32).eps * mag
        for path, got in (("torch", ref[g]), ("fused", fused[g])):
            err = (got.double() - exact).abs()
            assert (err <= bound).all(), (path, g, float((err / bound).max()))
        host = torch.cat([sr.exc_index[sr.from_slots:] for (grp, _), sr in rec.slices.items() if grp == g])
        got, want = fused[g].view(-1)[host].double(), exact.view(-1)[host]
        assert ((got - want).abs() <= want.abs() * unit).all(), g


@pytest.mark.parametrize("walk", [(16, 1), (48, 2)])         # a strip of one tile; of three (the last partial)
def test_unmerge_walks_and_ranks_above_one_k_tile_are_exact(monkeypatch, walk):
    """The unmerge's strip walk, with A hoisted (rank 8) and re-read per tile (rank 80, over the K tile of 64)."""
    from vlora.kernels import merge as kernels

    monkeypatch.setattr(kernels, "UNMERGE_WALK", walk)
    g = torch.Generator().manual_seed(3)
    for r in (8, 80):
        w = (torch.randn(2, 70, 64, generator=g) * 0.02).to(torch.bfloat16)
        orig = w.clone()
        a = (torch.randn(2, 64, r, generator=g) * 0.05).to(torch.bfloat16)
        b = (torch.randn(2, r, 50, generator=g) * 0.05).to(torch.bfloat16)
        sr = kernels.merge_slice_(w, 10, a, b, 2.0, tile=(16, 32, 4))
        delta = 2.0 * torch.einsum("lir,lro->loi", a.double(), b.double())
        assert torch.allclose(w[:, 10:60].double() - orig[:, 10:60].double(), delta, atol=2e-3,
                                              rtol=0.02)
        kernels.unmerge_slice_(w, 10, a, b, 2.0, sr)
        assert torch.equal(w.view(torch.int16), orig.view(torch.int16)), r


def test_merge_without_restore_record_merges_the_same():
    """``restore=False`` (a merge reusing its record; the benchmarks' cost-of-exactness baseline) writes the same
    merged weights as the kernel that makes a record, except the elements finished after it (in its list)."""
    from vlora.kernels.merge import merge_slice_

    g = torch.Generator().manual_seed(4)
    w = (torch.randn(2, 40, 64, generator=g) * 0.02).to(torch.bfloat16)
    a = (torch.randn(2, 64, 8, generator=g) * 0.05).to(torch.bfloat16)
    b = (torch.randn(2, 8, 40, generator=g) * 0.05).to(torch.bfloat16)
    w2 = w.clone()
    sr = merge_slice_(w, 0, a, b, 1.5, tile=(16, 32, 4))
    assert merge_slice_(w2, 0, a, b, 1.5, tile=(16, 32, 4), restore=False) is None
    differ = (w.view(torch.int16) != w2.view(torch.int16)).view(-1).nonzero().squeeze(1)
    assert torch.isin(differ, sr.exc_index[sr.from_slots:]).all()


def test_pending_exceptions_past_the_first_pass_room_are_finished_in_more_passes(monkeypatch):
    """With room for one listed exception in its first pass, the finishing lists the rest in a second pass; the
    record is still complete and the unmerge exact."""
    from vlora.kernels import merge as kernels

    monkeypatch.setattr(kernels, "pending_capacity", lambda rows: 1)
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(2, 40, 64, generator=g) * 0.02).to(torch.bfloat16)
    orig = w.clone()
    a = (torch.randn(2, 64, 8, generator=g) * 0.3).to(torch.bfloat16)
    b = (torch.randn(2, 8, 40, generator=g) * 0.3).to(torch.bfloat16)
    sr = kernels.merge_slice_(w, 0, a, b, 4.0, tile=(16, 32, 4))
    assert sr.exc_index.numel() - sr.from_slots > 2
    assert not (torch.stack([sr.codes & 15, sr.codes >> 4]) == 15).any()
    kernels.unmerge_slice_(w, 0, a, b, 4.0, sr)
    assert torch.equal(w.view(torch.int16), orig.view(torch.int16))


def _slice_index(idx, out_packed, row0, out, inn):
    """Flat indices into stacked weights [L, out_packed, in] -> into the slice [L, out, in] from row0."""
    layer, rest = idx // (out_packed * inn), idx % (out_packed * inn)
    return (layer * out + rest // inn - row0) * inn + rest % inn


def test_exception_indices_point_into_the_stacked_weights():
    """The record's list (slots gathered, the further exceptions finished after the kernel) holds flat indices into the whole
    stacked tensor and the original bits there, for a slice that starts below row 0 and ends above the last;
    the finished elements are merged and coded as exceptions."""
    from vlora.kernels.merge import merge_slice_

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3, 90, 64, generator=g) * 0.02).to(torch.bfloat16)
    orig = w.clone()
    a = (torch.randn(3, 64, 8, generator=g) * 0.3).to(torch.bfloat16)
    b = (torch.randn(3, 8, 40, generator=g) * 0.3).to(torch.bfloat16)
    sr = merge_slice_(w, 30, a, b, 4.0, tile=(16, 32, 4))
    assert sr.from_slots > 0 and sr.exc_index.numel() > sr.from_slots
    codes = torch.stack([sr.codes & 15, sr.codes >> 4], dim=-1)
    assert not (codes == 15).any()                             # none left pending
    delta = 4.0 * torch.einsum("lir,lro->loi", a.double(), b.double())
    host = sr.exc_index[sr.from_slots:]
    assert torch.allclose(w.view(-1)[host].double(), (orig[:, 30:70].double() + delta).view(-1)[
        _slice_index(host, 90, 30, 40, 64)], rtol=2 ** -7, atol=1e-6)
    idx = sr.exc_index
    rows = (idx // 64) % 90
    assert ((rows >= 30) & (rows < 70)).all() and idx.unique().numel() == idx.numel()
    assert torch.equal(orig.view(torch.int16).view(-1)[idx], sr.exc_bits)


def test_a_merge_reusing_its_record_writes_the_same_weights_and_stays_exact(tmp_path):
    """A restore record depends only on the base weights, the adapter and the scale: the next merge of the same
    adapter reuses it (writing the weights alone) and merges to the same bits as the kernel's merge, except
    where an exception was finished after the kernel; every unmerge restores the weights bit for bit. Any other adapter or
    scale, or a torch write to the weights in between, makes a new record."""
    from vlora.lora.merge import can_reuse

    a0, a1 = adapters_for(tmp_path, torch.bfloat16, n=2)
    weights = stacked_weights(torch.bfloat16)
    original = {k: v.clone() for k, v in weights.items()}
    rec = merge_(weights, WIDTHS, a1, kernel=True)
    first = {k: v.clone() for k, v in weights.items()}
    assert not can_reuse(rec, weights, a1, rec.scale)         # still merged
    unmerge_(weights, WIDTHS, rec)
    for cycle in range(3):
        again = merge_(weights, WIDTHS, a1, kernel=True, reuse=rec)
        assert again is rec and rec.reused
        for g in weights:
            differ = (weights[g].view(torch.int16) != first[g].view(torch.int16)).view(-1).nonzero().squeeze(1)
            sr_idx = torch.cat([sr.exc_index for (grp, _), sr in rec.slices.items() if grp == g] or
                               [torch.empty(0, dtype=torch.int64)])
            assert torch.isin(differ, sr_idx).all(), (cycle, g)  # only the finished elements may differ
        unmerge_(weights, WIDTHS, rec)
        for g in weights:
            assert torch.equal(weights[g].view(torch.int16), original[g].view(torch.int16)), (cycle, g)
    assert not can_reuse(rec, weights, a0, rec.scale) and not can_reuse(rec, weights, a1, -rec.scale)
    weights["o"][0, 0, 0] += 1.0                                 # a torch write: the base is not what it was
    weights["o"][0, 0, 0] -= 1.0
    fresh = merge_(weights, WIDTHS, a1, kernel=True, reuse=rec)
    assert fresh is not rec and not fresh.reused
    unmerge_(weights, WIDTHS, fresh)


@pytest.mark.gpu
@pytest.mark.parametrize("walk", [(64, 1), (512, 3)])
@pytest.mark.parametrize("tile", [(64, 128, 4), (64, 64, 4), (32, 128, 4)])
def test_gpu_fused_merge_is_exact_on_7b_shapes(monkeypatch, walk, tile):
    """One Llama-2-7B-sized layer stack slice (4 layers) in bf16, rank 64, and one the tile does not divide: exact
    after 5 cycles, the unmerge a tile per program or walking strips (its ΔW must equal the merge's bit for
    bit); the merge without a record (as when one is reused) writes the same bits as the one that made it, but
    for the exceptions finished after the kernel."""
    from vlora.kernels import merge as kernels
    from vlora.kernels.merge import merge_slice_, unmerge_slice_

    monkeypatch.setattr(kernels, "UNMERGE_WALK", walk)
    monkeypatch.setattr(kernels, "TILE", tile)
    for out, inn in ((11008, 4096), (11000, 4000)):
        w = (torch.randn(4, out, inn, device="cuda") * 0.02).to(torch.bfloat16)
        orig = w.clone()
        a = (torch.randn(4, inn, 64, device="cuda") * 0.02).to(torch.bfloat16)
        b = (torch.randn(4, 64, out, device="cuda") * 0.02).to(torch.bfloat16)
        for _ in range(5):
            sr = merge_slice_(w, 0, a, b, 2.0)
            assert sr.from_slots > 0 and sr.exc_index.numel() > sr.from_slots and not torch.equal(w, orig)
            merged = w.clone()
            unmerge_slice_(w, 0, a, b, 2.0, sr)
            assert torch.equal(w.view(torch.int16), orig.view(torch.int16))
            merge_slice_(w, 0, a, b, 2.0, tile=sr.tile, restore=False)    # a merge reusing the record
            differ = (w.view(torch.int16) != merged.view(torch.int16)).view(-1).nonzero().squeeze(1)
            assert torch.isin(differ, sr.exc_index[sr.from_slots:]).all()
            unmerge_slice_(w, 0, a, b, 2.0, sr)
            assert torch.equal(w.view(torch.int16), orig.view(torch.int16))


@pytest.mark.parametrize("strided", [True, False])         # False: the per-layer path (layers spaced unevenly)
def test_factors_staged_from_the_pool_equal_the_host_gather(tmp_path, monkeypatch, strided):
    """An adapter resident in the unified pool: its stacked factors read there (strided copies on the device)
    are bitwise the host path's, for every targets mix (layers without a slice stay zero)."""
    from vlora.lora import merge
    from vlora.lora.merge import stage_factors, stage_from_pool
    from vlora.memory.pool import UnifiedPool

    if not strided:
        monkeypatch.setattr(merge, "_uniform", lambda starts: False)

    shape = ModelShape("tiny", LAYERS, INS, OUTS)
    pool = UnifiedPool(64, 1, 4, 1, 64, torch.bfloat16, torch.device("cpu"))
    reg = AdapterRegistry(shape, 64, torch.bfloat16, torch.device("cpu"), check_base_model=False, kernel="triton",
                          pool=pool)
    weights = stacked_weights(torch.bfloat16)
    for i, targets in enumerate(TARGETS):
        a = reg.register(f"a{i}", write_random_adapter(tmp_path / f"a{i}", shape, rank=8, seed=i, targets=targets))
        assert stage_from_pool(a, pool.buf, weights, WIDTHS) is None          # not in the pool yet
        assert reg.store.load(a)
        want, got = stage_factors(a, weights, WIDTHS), stage_from_pool(a, pool.buf, weights, WIDTHS)
        assert want.keys() == got.keys() and want
        for key in want:
            for x, y in zip(want[key], got[key]):
                assert torch.equal(x, y), (targets, key)
        reg.store.evict(a.name)
