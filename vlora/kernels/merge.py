"""Fused exact merge/unmerge of one LoRA slice into stacked base weights, in Triton.

One launch per projection slice covers every layer: each program computes a
``[BM, BN]`` tile of ``ΔW = s·(A·B)^T`` on the tensor cores (adapter factors in
the weights' dtype, fp32 accumulation), reads the weight tile once, writes the
merged tile once, and writes the tile's restore codes: ``c = bits(W) -
bits(round(W' - ΔW))``, the difference of the bit patterns read as integers
(for two floats of one sign, the number of representable values between them),
in 4 bits per element, ``c + 8`` for ``c`` in [-8, 6]. Code 15 marks an
exception (``c`` out of range, or a sign change: where ``|W|`` is far below
``|ΔW|``, about 0.2% of the elements for the benchmark's random 7B-shaped model at rank 64).
The first kernel leaves an exception as it was and counts the tile's
exceptions; a second launch over the same tiles, after a prefix sum of the
counts, merges them and writes each one's flat index and original bits into
the slice's list, at its tile's offset plus its rank in the tile (a scan over
the tile's mask). No atomics, and the first kernel keeps no per-row state.

Unmerge recomputes the identical ΔW (the same product of the same tiles),
applies ``round(W' - ΔW)`` and the codes, and the list is scattered back: the
weights return bit for bit. The record depends only on the base weights, the
adapter and the scale, so a later merge of the same adapter can reuse it and
write the weights alone (``merge_slice_(restore=False)`` with the record's tile).

Traffic per touched element: merge reads 2 and writes 2.5 bytes (bf16 + half a
byte of code), unmerge the reverse; the second launch reads the codes again
(half a byte) and touches only the exceptions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vlora.kernels import compiles

INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@triton.jit
def _dot(bt, at, IEEE: tl.constexpr):
    """B's tile [BM, BK] times A's [BK, BN], fp32; the one product both kernels compute ΔW with."""
    if IEEE:
        return tl.dot(bt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
    return tl.dot(bt, at)


@triton.jit
def _delta_tile(a_ptr, b_ptr, l, offs_o, offs_i, o_mask, i_mask, R, IN, OUT, scale,
                BK: tl.constexpr, IEEE: tl.constexpr):
    """scale * sum_k B[l, k, o] * A[l, i, k] for the tile's (o, i), fp32."""
    acc = tl.zeros((offs_o.shape[0], offs_i.shape[0]), dtype=tl.float32)
    offs_k = tl.arange(0, BK)
    a_base = a_ptr + l.to(tl.int64) * IN * R
    b_base = b_ptr + l.to(tl.int64) * R * OUT
    for k0 in range(0, R, BK):
        k = k0 + offs_k
        k_mask = k < R
        bt = tl.load(b_base + k[None, :] * OUT + offs_o[:, None], mask=o_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + offs_i[None, :] * R + k[:, None], mask=k_mask[:, None] & i_mask[None, :], other=0.0)
        acc += _dot(bt, at, IEEE)
    return acc * scale


@triton.jit
def _tile(row0, IN, OUT, stride_wl, stride_wo, tiles_o, tiles_i, BM: tl.constexpr, BN: tl.constexpr):
    """This program's tile: layer, rows/columns and masks, weight offsets, packed-code offsets and mask."""
    pid = tl.program_id(0)
    l = pid // (tiles_o * tiles_i)
    rest = pid % (tiles_o * tiles_i)
    offs_o = (rest // tiles_i) * BM + tl.arange(0, BM)
    offs_i = (rest % tiles_i) * BN + tl.arange(0, BN)
    o_mask = offs_o < OUT
    i_mask = offs_i < IN
    w_off = l.to(tl.int64) * stride_wl + (row0 + offs_o[:, None]).to(tl.int64) * stride_wo + offs_i[None, :]
    half = (rest % tiles_i) * (BN // 2) + tl.arange(0, BN // 2)
    c_off = (l.to(tl.int64) * OUT + offs_o[:, None]) * (IN // 2) + half[None, :]
    c_mask = o_mask[:, None] & (half < IN // 2)[None, :]
    return l, offs_o, offs_i, o_mask, i_mask, w_off, c_off, c_mask


# Arguments that differ between the slices of one model are not specialised on. The rank is: A's rows are R
# elements long, and only a known multiple of 16 lets its loads vectorise (unspecialised, the unmerge of a
# rank-64 adapter took 25.4 ms instead of 18.3 on an H100, best tiles of two sweeps on 2026-11-22:
# benchmarks/results/h100-2026-11-22/merge-nvidia-h100-80gb-hbm3.json and earlier/). The variants are then one
# per (K tile, rank a multiple of 16 or not, rank 1) and dtype, which the engine builds at start-up
# (vlora.engine.warmup.build_merge).
@compiles.jit(ints=("row0", "tiles_o", "tiles_i"))
def _merge_kernel(w_ptr, a_ptr, b_ptr, codes_ptr, count_ptr, row0, R, IN, OUT, stride_wl, stride_wo, scale,
                  tiles_o, tiles_i, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                  INT_T: tl.constexpr, ORD_T: tl.constexpr, RESTORE: tl.constexpr = True):
    l, offs_o, offs_i, o_mask, i_mask, w_off, c_off, c_mask = _tile(row0, IN, OUT, stride_wl, stride_wo,
                                                                    tiles_o, tiles_i, BM, BN)
    mask = o_mask[:, None] & i_mask[None, :]
    w = tl.load(w_ptr + w_off, mask=mask, other=0.0)        # issued first: in flight while ΔW is computed
    d = _delta_tile(a_ptr, b_ptr, l, offs_o, offs_i, o_mask, i_mask, R, IN, OUT, scale, BK, IEEE)
    merged = (w.to(tl.float32) + d).to(w.dtype)
    if not RESTORE:                          # a merge reusing its record; the benchmarks' cost-of-exactness baseline
        tl.store(w_ptr + w_off, merged, mask=mask)
        return
    naive = (merged.to(tl.float32) - d).to(w.dtype)
    # restore code: the distance from round(W' - ΔW) to W in units in the last place, as the difference of the
    # bit patterns (for two floats of one sign it counts the representable values between them)
    wbits = w.to(INT_T, bitcast=True).to(ORD_T)
    nbits = naive.to(INT_T, bitcast=True).to(ORD_T)
    c = wbits - nbits
    exc = (((wbits ^ nbits) < 0) | (c < -8) | (c > 6)) & mask
    nib = tl.where(exc, 15, c + 8).to(tl.int32)
    tl.store(w_ptr + w_off, tl.where(exc, w, merged), mask=mask)    # exceptions: merged by _finish_kernel
    lo, hi = tl.split(tl.reshape(nib, (BM, BN // 2, 2)))
    tl.store(codes_ptr + c_off, (lo | (hi << 4)).to(tl.uint8), mask=c_mask)
    tl.store(count_ptr + tl.program_id(0), tl.sum(tl.sum(exc.to(tl.int32), axis=1), axis=0))


# The exceptions the merge left: each program takes the merge's tile, returns at once if the tile had none,
# else re-reads the tile's codes, recomputes ΔW (the same product), merges the exceptions and writes (flat index
# in the slice, original bits) at its tile's offset in the list plus each one's rank in the tile.
@compiles.jit(ints=("row0", "tiles_o", "tiles_i"))
def _finish_kernel(w_ptr, a_ptr, b_ptr, codes_ptr, count_ptr, offset_ptr, exc_idx_ptr, exc_bits_ptr, row0, R, IN,
                   OUT, stride_wl, stride_wo, scale, tiles_o, tiles_i, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, IEEE: tl.constexpr, INT_T: tl.constexpr):
    if tl.load(count_ptr + tl.program_id(0)) == 0:
        return
    l, offs_o, offs_i, o_mask, i_mask, w_off, c_off, c_mask = _tile(row0, IN, OUT, stride_wl, stride_wo,
                                                                    tiles_o, tiles_i, BM, BN)
    packed = tl.load(codes_ptr + c_off, mask=c_mask, other=0).to(tl.int32)
    exc = (tl.reshape(tl.join(packed & 15, packed >> 4), (BM, BN)) == 15) & o_mask[:, None] & i_mask[None, :]
    d = _delta_tile(a_ptr, b_ptr, l, offs_o, offs_i, o_mask, i_mask, R, IN, OUT, scale, BK, IEEE)
    w = tl.load(w_ptr + w_off, mask=exc, other=0.0)
    tl.store(w_ptr + w_off, (w.to(tl.float32) + d).to(w.dtype), mask=exc)
    # rank in the tile, row-major: the exceptions of the rows above, then a scan along the row (2-D scans in the
    # tile's own layout, no reshape)
    e = exc.to(tl.int32)
    per_row = tl.sum(e, axis=1)
    pos = tl.load(offset_ptr + tl.program_id(0)) + (tl.cumsum(per_row, axis=0) - per_row)[:, None] + \
        tl.cumsum(e, axis=1) - 1
    tl.store(exc_idx_ptr + pos, (l.to(tl.int64) * OUT + offs_o[:, None]) * IN + offs_i[None, :], mask=exc)
    tl.store(exc_bits_ptr + pos, w.to(INT_T, bitcast=True), mask=exc)


# The unmerge walks a strip of ROWS rows of one column tile, BM rows at a time, software-pipelined (STAGES), with A's
# tile loaded once per strip when the rank fits one K tile (one tile per program re-read it from L2 for every
# [BM, BN] of weights: 16 KB per 8 KB at rank 64 and (32, 128) tiles). ΔW is the same product of the same tiles
# as the merge's (one dot of [BM, BK] by [BK, BN]), so the restore stays bit for bit (the GPU tests check it).
# On an H100 on 2026-11-22 this took the unmerge of a rank-64 adapter from 20.0 to 14.7 ms in the sweep, 15.0 ms
# in the timed cycles (Llama-2-7B shapes, benchmarks/results/h100-2026-11-22-merge/). The merge stays one tile per
# program: walking strips made it slower (44 -> 62-66 ms in a sweep of that design, attempts/ there). The
# exceptions come back from the record's list, scattered after the kernel.
@compiles.jit(ints=("row0", "tiles_i", "strips"))
def _unmerge_kernel(w_ptr, a_ptr, b_ptr, codes_ptr, row0, R, IN, OUT, stride_wl, stride_wo, scale, tiles_i, strips,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                    HOIST: tl.constexpr, IEEE: tl.constexpr, INT_T: tl.constexpr, ORD_T: tl.constexpr):
    pid = tl.program_id(0)
    l = pid // (tiles_i * strips)
    rest = pid % (tiles_i * strips)
    ti = rest % tiles_i
    o_begin = (rest // tiles_i) * ROWS
    offs_i = ti * BN + tl.arange(0, BN)
    i_mask = offs_i < IN
    half = ti * (BN // 2) + tl.arange(0, BN // 2)
    offs_k = tl.arange(0, BK)
    if HOIST:
        at = tl.load(a_ptr + l.to(tl.int64) * IN * R + offs_i[None, :] * R + offs_k[:, None],
                     mask=(offs_k < R)[:, None] & i_mask[None, :], other=0.0)
    for o0 in tl.range(o_begin, tl.minimum(o_begin + ROWS, OUT), BM, num_stages=STAGES):
        offs_o = o0 + tl.arange(0, BM)
        o_mask = offs_o < OUT
        mask = o_mask[:, None] & i_mask[None, :]
        w_off = l.to(tl.int64) * stride_wl + (row0 + offs_o[:, None]).to(tl.int64) * stride_wo + offs_i[None, :]
        w = tl.load(w_ptr + w_off, mask=mask, other=0.0)
        c_off = (l.to(tl.int64) * OUT + offs_o[:, None]) * (IN // 2) + half[None, :]
        packed = tl.load(codes_ptr + c_off, mask=o_mask[:, None] & (half < IN // 2)[None, :],
                         other=8 | (8 << 4)).to(tl.int32)
        nib = tl.reshape(tl.join(packed & 15, packed >> 4), (BM, BN))
        if HOIST:
            bt = tl.load(b_ptr + l.to(tl.int64) * R * OUT + offs_k[None, :] * OUT + offs_o[:, None],
                         mask=o_mask[:, None] & (offs_k < R)[None, :], other=0.0)
            d = _dot(bt, at, IEEE) * scale
        else:
            d = _delta_tile(a_ptr, b_ptr, l, offs_o, offs_i, o_mask, i_mask, R, IN, OUT, scale, BK, IEEE)
        naive = (w.to(tl.float32) - d).to(w.dtype)
        step = tl.where(nib == 15, 0, nib - 8).to(ORD_T)                    # exceptions: from the list
        restored = (naive.to(INT_T, bitcast=True).to(ORD_T) + step).to(INT_T)
        tl.store(w_ptr + w_off, restored.to(w.dtype, bitcast=True), mask=mask)


def _ieee(w: torch.Tensor) -> bool:
    """fp32 products for fp32 weights, and in the interpreter (its dot of 16-bit inputs is wrong; bf16 x bf16
    products are exact in fp32, so the result is the same)."""
    return w.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _consts(w: torch.Tensor) -> dict:
    it = INT_OF[w.dtype]
    nbits = torch.iinfo(it).bits
    # bit patterns widened for their differences: 16-bit floats in int32, 32-bit ones in int64
    return dict(INT_T=tl.int16 if nbits == 16 else tl.int32, ORD_T=tl.int32 if nbits == 16 else tl.int64)


def k_tile(rank: int) -> int:
    """The K tile of ΔW's product for an adapter of this rank (a constexpr: one kernel variant each)."""
    return max(16, min(64, triton.next_power_of_2(rank)))


def variant(rank: int) -> tuple[int, bool, bool]:
    """What of the rank the merge kernels are specialised on: the K tile, whether it is a multiple of 16, and
    whether it is 1 (Triton specialises integers equal to 1 too)."""
    return k_tile(rank), rank % 16 == 0, rank == 1


def _tiles(out: int, inn: int, bm: int, bn: int) -> tuple[int, int]:
    return triton.cdiv(out, bm), triton.cdiv(inn, bn)


# Tile of both kernels: (BM, BN, warps). ``benchmarks/bench_merge.py --sweep`` times the alternatives.
# On an H100 on 2026-11-22 (32, 128, 4) had the fastest merge + unmerge for Llama-2-7B shapes at rank 64 with
# the exceptions in per-row slots (38.0 + 18.4 ms in the sweep, against 43.2 + 16.3 ms for (64, 128, 8):
# benchmarks/results/h100-2026-11-22/merge-nvidia-h100-80gb-hbm3.json); without a record (64, 128, 4) was fastest
# (9.6 against 12.5 ms: benchmarks/results/h100-2026-11-22-merge/breakdown/). Not swept on an H200.
TILE = (32, 128, 4)
UNMERGE_WALK = (256, 3)      # the unmerge's strip: rows (a multiple of BM) and pipeline stages


@dataclass
class SliceRestore:
    """What the unmerge of one slice needs besides ΔW: the codes and the exceptions' original bits."""

    codes: torch.Tensor          # uint8 [L, out, in/2]: two 4-bit codes a byte
    exc_index: torch.Tensor      # int64 flat indices into the stacked weights [L, out_packed, in]
    exc_bits: torch.Tensor       # their original bit patterns
    tile: tuple[int, int, int]   # the merge's tile: the unmerge and a merge that reuses this record compute ΔW with it

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.exc_index, self.exc_bits]


def stacked_index(idx: torch.Tensor, w: torch.Tensor, row0: int, out: int) -> torch.Tensor:
    """Flat indices into the slice ``w[:, row0:row0 + out]`` (shape [L, out, in]) -> flat indices into ``w``."""
    per_layer = out * w.shape[2]
    return idx + (idx // per_layer) * ((w.shape[1] - out) * w.shape[2]) + row0 * w.shape[2]


def merge_slice_(w: torch.Tensor, row0: int, a: torch.Tensor, b: torch.Tensor, scale: float,
                 tile: tuple[int, int, int] | None = None, restore: bool = True) -> SliceRestore | None:
    """Merge ``scale * (A B)^T`` into rows ``[row0, row0 + out)`` of every layer of ``w``, in place.

    Shape: w [L, out_packed, in] contiguous; a [L, in, r], b [L, r, out] in w's dtype (float32 weights: the
    products in IEEE fp32). Returns the slice's restore record. ``restore=False`` writes no restore record
    (returns None; not undoable exactly unless a record of the same merge, made with the same ``tile``, is
    kept): a merge that reuses a record, and the benchmarks' cost-of-exactness baseline.
    """
    assert w.is_contiguous() and a.dtype == b.dtype == w.dtype and w.shape[2] % 2 == 0
    L, _, inn = w.shape
    r, out = b.shape[1], b.shape[2]
    tile = tuple(tile or TILE)
    bm, bn, num_warps = tile
    to, ti = _tiles(out, inn, bm, bn)
    programs = L * to * ti
    int_t = INT_OF[w.dtype]
    codes = torch.empty((L, out, inn // 2) if restore else (1,), dtype=torch.uint8, device=w.device)
    count = torch.empty(programs if restore else 1, dtype=torch.int32, device=w.device)
    a, b, bk = a.contiguous(), b.contiguous(), k_tile(r)
    args = (row0, r, inn, out, w.stride(0), w.stride(1), scale, to, ti)
    _merge_kernel[(programs,)](w, a, b, codes, count, *args, BM=bm, BN=bn, BK=bk, IEEE=_ieee(w),
                               num_warps=num_warps, RESTORE=restore, **_consts(w))
    if not restore:
        return None
    ends = torch.cumsum(count, 0)
    total = int(ends[-1].item())
    exc_idx = torch.empty(total, dtype=torch.int64, device=w.device)
    exc_bits = torch.empty(total, dtype=int_t, device=w.device)
    if total:
        _finish_kernel[(programs,)](w, a, b, codes, count, ends - count, exc_idx, exc_bits, *args, BM=bm, BN=bn,
                                    BK=bk, IEEE=_ieee(w), num_warps=num_warps, INT_T=_consts(w)["INT_T"])
    return SliceRestore(codes, stacked_index(exc_idx, w, row0, out), exc_bits, tile)


def unmerge_slice_(w: torch.Tensor, row0: int, a: torch.Tensor, b: torch.Tensor, scale: float,
                   rec: SliceRestore) -> None:
    """Undo :func:`merge_slice_` bit for bit: the kernel (ΔW, codes), then the exceptions' bits scattered back."""
    L, _, inn = w.shape
    r, out = b.shape[1], b.shape[2]
    bm, bn, num_warps = rec.tile
    rows, stages = UNMERGE_WALK
    rows = max(bm, rows // bm * bm)
    tiles_i, strips = triton.cdiv(inn, bn), triton.cdiv(out, rows)
    bk = k_tile(r)
    _unmerge_kernel[(L * tiles_i * strips,)](w, a.contiguous(), b.contiguous(), rec.codes, row0, r, inn, out,
                                             w.stride(0), w.stride(1), scale, tiles_i, strips, BM=bm, BN=bn, BK=bk,
                                             ROWS=rows, STAGES=stages, HOIST=r <= bk, IEEE=_ieee(w),
                                             num_warps=num_warps, **_consts(w))
    if rec.exc_index.numel():
        w.view(INT_OF[w.dtype]).view(-1)[rec.exc_index] = rec.exc_bits
