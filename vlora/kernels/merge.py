"""Fused exact merge/unmerge of one LoRA slice into stacked base weights, in Triton.

One launch per projection slice covers every layer: each program computes a
``[BM, BN]`` tile of ``ΔW = s·(A·B)^T`` on the tensor cores (adapter factors in
the weights' dtype, fp32 accumulation), reads the weight tile once, writes the
merged tile once, and writes the tile's restore codes: ``c = bits(W) -
bits(round(W' - ΔW))``, the difference of the bit patterns read as integers
(for two floats of one sign, the number of representable values between them),
in 4 bits per element, ``c + 8`` for ``c`` in [-7, 6]. Code 0 marks an
exception (``c`` out of range, or a sign change), whose original bits are kept:

* in the *slots* of its tile row: every row of a tile keeps its first and its
  last exception (``SLOTS`` = 2; column in the tile, original bits), found by a
  min- and a max-reduction along the row. No scan, no atomics: with LoRA-sized
  ΔW about one tile row in five has an exception and one in several hundred
  more than two;
* the rest in one list for the slice (flat index, original bits), one atomic
  slot per element, taken only by tiles that have such an overflow.

An exception that finds no room in the list is left unmerged and marked 15
("pending"); the host then finishes those few elements in torch
(``vlora.lora.merge``). After the launch the slots are gathered into the
slice's list (flat indices into the stacked weights, original bits), so the
record is codes + one list. Unmerge recomputes the identical ΔW (same tiles),
applies ``round(W' - ΔW)`` and the codes, and scatters the list back: the
weights return bit for bit. The record depends only on the base weights, the
adapter and the scale, so a later merge of the same adapter may reuse it and
run the merge without a record (``restore=False``, the record's tile).

Traffic per touched element: merge reads 2 and writes 2.5 bytes (bf16 + half a
byte of code) plus 4 bytes per slot per tile row, unmerge reads 2.5 and writes 2.
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
@compiles.jit(ints=("row0", "capacity", "tiles_o", "tiles_i"))
def _merge_kernel(w_ptr, a_ptr, b_ptr, codes_ptr, slot_col_ptr, slot_bits_ptr, count_ptr, exc_idx_ptr, exc_bits_ptr,
                  row0, R, IN, OUT, stride_wl, stride_wo, scale, capacity, tiles_o, tiles_i,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SLOTS: tl.constexpr, IEEE: tl.constexpr,
                  INT_T: tl.constexpr, ORD_T: tl.constexpr, RESTORE: tl.constexpr = True):
    l, offs_o, offs_i, o_mask, i_mask, w_off, c_off, c_mask = _tile(row0, IN, OUT, stride_wl, stride_wo,
                                                                    tiles_o, tiles_i, BM, BN)
    mask = o_mask[:, None] & i_mask[None, :]
    w = tl.load(w_ptr + w_off, mask=mask, other=0.0)        # issued first: in flight while ΔW is computed
    d = _delta_tile(a_ptr, b_ptr, l, offs_o, offs_i, o_mask, i_mask, R, IN, OUT, scale, BK, IEEE)
    merged = (w.to(tl.float32) + d).to(w.dtype)
    if not RESTORE:                                          # the benchmarks' cost-of-exactness baseline
        tl.store(w_ptr + w_off, merged, mask=mask)
        return
    naive = (merged.to(tl.float32) - d).to(w.dtype)
    # restore code: the distance from round(W' - ΔW) to W in units in the last place, as the difference of the
    # bit patterns (for two floats of one sign it counts the representable values between them)
    wbits = w.to(INT_T, bitcast=True).to(ORD_T)
    nbits = naive.to(INT_T, bitcast=True).to(ORD_T)
    c = wbits - nbits
    rem = (((wbits ^ nbits) < 0) | (c < -7) | (c > 6)) & mask
    nib = tl.where(rem, 0, c + 8).to(tl.int32)
    if SLOTS > 0:
        # the first and the last exception of every tile row (a min- and a max-reduction along the rows); their
        # original bits re-read from the row (in cache: the tile was just loaded, and is stored below)
        col = tl.arange(0, BN)[None, :]
        ti = tl.program_id(0) % tiles_i
        srow = ((l.to(tl.int64) * OUT + offs_o) * tiles_i + ti) * SLOTS
        rows = w_ptr + l.to(tl.int64) * stride_wl + (row0 + offs_o).to(tl.int64) * stride_wo + ti * BN
        first = tl.min(tl.where(rem, col, BN), axis=1)
        has = o_mask & (first < BN)
        tl.store(slot_col_ptr + srow, tl.where(has, first, -1).to(tl.int16), mask=o_mask)
        tl.store(slot_bits_ptr + srow, tl.load(rows + first, mask=has, other=0.0).to(INT_T, bitcast=True),
                 mask=o_mask)
        over = col != first[:, None]
        if SLOTS > 1:
            last = tl.max(tl.where(rem, col, -1), axis=1)
            has = o_mask & (last > first) & (first < BN)
            tl.store(slot_col_ptr + srow + 1, tl.where(has, last, -1).to(tl.int16), mask=o_mask)
            tl.store(slot_bits_ptr + srow + 1, tl.load(rows + last, mask=has, other=0.0).to(INT_T, bitcast=True),
                     mask=o_mask)
            over = over & (col != last[:, None])
        rem = rem & over
    n_over = tl.sum(tl.sum(rem.to(tl.int32), axis=1), axis=0)
    if n_over > 0:                                           # rare: more exceptions in a row than slots
        pos = tl.atomic_add(count_ptr + tl.zeros((BM, BN), dtype=tl.int32), 1, mask=rem)
        stored = rem & (pos < capacity)
        flat_idx = (l.to(tl.int64) * OUT + offs_o[:, None]) * IN + offs_i[None, :]
        tl.store(exc_idx_ptr + pos, flat_idx, mask=stored)
        tl.store(exc_bits_ptr + pos, w.to(INT_T, bitcast=True), mask=stored)
        pending = rem & ~stored
        nib = tl.where(pending, 15, nib)
        merged = tl.where(pending, w, merged)                  # left as it was: the host finishes it
    tl.store(w_ptr + w_off, merged, mask=mask)
    lo, hi = tl.split(tl.reshape(nib, (BM, BN // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    tl.store(codes_ptr + c_off, packed, mask=c_mask)


# The unmerge walks a strip of ROWS rows of one column tile, BM rows at a time, software-pipelined (STAGES), with A's
# tile loaded once per strip when the rank fits one K tile (one tile per program re-read it from L2 for every
# [BM, BN] of weights: 16 KB per 8 KB at rank 64 and (32, 128) tiles). ΔW is the same product of the same tiles
# as the merge's (one dot of [BM, BK] by [BK, BN]), so the restore stays bit for bit (the GPU tests check it).
# On an H100 on 2026-11-22 this took the unmerge of a rank-64 adapter from 20.0 to 14.7 ms in the sweep, 15.0 ms
# in the timed cycles (Llama-2-7B shapes, benchmarks/results/h100-2026-11-22-merge/). The merge stays one tile per
# program: walking strips made it slower (44 -> 62-66 ms in a sweep of that design, attempts/ there). The slots
# are not read here: the merge hands every exception over in its list, which the host scatters back (reading
# the slots cost the unmerge 4 ms of its 14.7: benchmarks/results/h100-2026-11-22-merge/breakdown/).
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
        step = tl.where((nib == 0) | (nib == 15), 0, nib - 8).to(ORD_T)     # exceptions: from the list
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


# Tile of both kernels: (BM, BN, warps). ``benchmarks/bench_merge.py --sweep`` times the alternatives. On an H100 on
# 2026-11-22 (Llama-2-7B shapes, rank 64, 2 slots; benchmarks/results/h100-2026-11-22-merge/reuse/) (64, 64, 4)
# had the fastest merge + unmerge, 38.3 + 12.1 ms in the sweep, against 47.2 + 11.5 for (32, 128, 4) and 58.8 +
# 11.5 for (64, 128, 4). A merge that reuses its record runs the same tile without the record: 10.7-10.8 ms with
# (64, 64, 4) (reuse/), 9.6-9.8 with (64, 128, 4) and 12.1-12.3 with (32, 128, 4) (the sweeps in
# attempts/two-launch/, whose record-less merge is this one). Not swept on an H200.
TILE = (64, 64, 4)
SLOTS = 2                    # exception slots per tile row: 0, 1 (the first) or 2 (the first and the last)
UNMERGE_WALK = (256, 3)      # the unmerge's strip: rows (a multiple of BM) and pipeline stages


@dataclass
class SliceRestore:
    """What the unmerge of one slice needs besides ΔW: the codes and the exceptions' original bits."""

    codes: torch.Tensor          # uint8 [L, out, in/2]: two 4-bit codes a byte
    exc_index: torch.Tensor      # int64 flat indices into the stacked weights [L, out_packed, in]
    exc_bits: torch.Tensor       # their original bit patterns
    tile: tuple[int, int, int]   # the merge's tile: the unmerge and a merge that reuses this record compute ΔW with it
    from_slots: int = 0          # how many of the exceptions the row slots held (the rest: the kernel's list, host)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.exc_index, self.exc_bits]


def stacked_index(idx: torch.Tensor, w: torch.Tensor, row0: int, out: int) -> torch.Tensor:
    """Flat indices into the slice ``w[:, row0:row0 + out]`` (shape [L, out, in]) -> flat indices into ``w``."""
    per_layer = out * w.shape[2]
    return idx + (idx // per_layer) * ((w.shape[1] - out) * w.shape[2]) + row0 * w.shape[2]


def merge_slice_(w: torch.Tensor, row0: int, a: torch.Tensor, b: torch.Tensor, scale: float, capacity: int,
                 tile: tuple[int, int, int] | None = None, slots: int | None = None,
                 restore: bool = True) -> tuple[SliceRestore | None, bool]:
    """Merge ``scale * (A B)^T`` into rows ``[row0, row0 + out)`` of every layer of ``w``, in place.

    Shape: w [L, out_packed, in] contiguous; a [L, in, r], b [L, r, out] in w's dtype (float32 weights: the
    products in IEEE fp32). ``capacity``: length of the overflow list. Returns (the slice's restore record,
    pending): ``pending`` when some exceptions found no room and were left unmerged with code 15 (the caller
    merges them and adds them to the record's list). The slots are gathered into the record's list here (one
    pass over them), so the unmerge reads codes only. ``restore=False`` writes no restore record (returns None;
    not undoable exactly): a merge that reuses a record, and the benchmarks' cost-of-exactness baseline.
    """
    assert w.is_contiguous() and a.dtype == b.dtype == w.dtype and w.shape[2] % 2 == 0
    L, _, inn = w.shape
    r, out = b.shape[1], b.shape[2]
    tile = tuple(tile or TILE)
    slots = SLOTS if slots is None else slots
    assert slots in (0, 1, 2), "slots per tile row: 0, 1 or 2"
    bm, bn, num_warps = tile
    to, ti = _tiles(out, inn, bm, bn)
    int_t = INT_OF[w.dtype]
    record = (L, out, inn // 2), (L, out, ti, slots)
    if not restore:                                         # nothing is written to them
        record = (1,), (1,)
    codes = torch.empty(record[0], dtype=torch.uint8, device=w.device)
    slot_cols = torch.empty(record[1], dtype=torch.int16, device=w.device)
    slot_bits = torch.empty(record[1], dtype=int_t, device=w.device)
    count = torch.zeros(1, dtype=torch.int32, device=w.device)
    exc_idx = torch.empty(max(capacity, 1), dtype=torch.int64, device=w.device)
    exc_bits = torch.empty(max(capacity, 1), dtype=int_t, device=w.device)
    bk = k_tile(r)
    _merge_kernel[(L * to * ti,)](w, a.contiguous(), b.contiguous(), codes, slot_cols, slot_bits, count, exc_idx,
                                  exc_bits, row0, r, inn, out, w.stride(0), w.stride(1), scale, capacity, to, ti,
                                  BM=bm, BN=bn, BK=bk, SLOTS=slots, IEEE=_ieee(w), num_warps=num_warps,
                                  RESTORE=restore, **_consts(w))
    if not restore:
        return None, False
    n = int(count.item())
    keep = min(n, capacity)
    idx, bits = exc_idx[:keep], exc_bits[:keep].clone()
    from_slots = 0
    if slots:                                    # slot (layer, row, column tile, j) -> flat index of its element
        flat_cols = slot_cols.view(-1)
        where = (flat_cols >= 0).nonzero().squeeze(1)
        from_slots = where.numel()
        row, t = where // (ti * slots), (where // slots) % ti
        idx = torch.cat([row * inn + t * bn + flat_cols[where].long(), idx])
        bits = torch.cat([slot_bits.view(-1)[where], bits])
    rec = SliceRestore(codes, stacked_index(idx, w, row0, out), bits, tile, from_slots)
    return rec, n > capacity


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
