"""Fused exact merge/unmerge of one LoRA slice into stacked base weights, in Triton.

One launch per projection slice covers every layer: each program computes a
``[BM, BN]`` tile of ``ΔW = s·(A·B)^T`` on the tensor cores (adapter factors in
the weights' dtype, fp32 accumulation) as two column halves, reads the weight
tile once, writes the merged tile once, and writes the tile's restore codes:
``c = bits(W) - bits(round(W' - ΔW))``, the difference of the bit patterns read
as integers (for two floats of one sign, the number of representable values
between them), in 4 bits per element, ``c + 8`` for ``c`` in [-7, 6]. A byte
holds the codes of columns ``j`` and ``j + BN/2`` of its tile, so the codes of
the two halves pair up element by element (no shuffle). Code 0 marks an
exception (``c`` out of range, which every sign change is), whose original bits
are kept elsewhere:

* the first of each tile row in the row's *slot*: one integer holding its
  column and its original bits, found by a min-reduction along the row. Most
  tile rows have no exception, so one slot a row catches most of them;
* any further one of that row is left unmerged by the kernel, with code 15,
  and the slot is flagged. They are a small share of the exceptions: two
  small kernels (:func:`_finish_rows`) find them through the flagged slots,
  merge them and list their original bits. No atomics and no list in the
  merge kernel: both cost it registers, and with them time, even where no
  tile needs them (docs/decisions.md, 'Exact merge: one slot per tile row,
  no atomics').

After the launch the slots and the finished elements are gathered into the
slice's list (flat indices into the stacked weights, original bits), so the
record is codes + one list. Unmerge recomputes the identical ΔW (same tiles,
same halves), applies ``round(W' - ΔW)`` and the codes, and scatters the list
back: the weights return bit for bit. The record depends only on the base
weights, the adapter and the scale, so a later merge of the same adapter may
reuse it and run the merge without a record (``restore=False``, the record's
tile). Tiles that divide the slice exactly run without masks (``EVEN``).

Traffic per touched element: merge reads 2 and writes 2.5 bytes (bf16 + half a
byte of code) plus 4 bytes per tile row, unmerge reads 2.5 and writes 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vlora.kernels import compiles
from vlora.kernels.limits import device_limits

INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@triton.jit
def _dot(bt, at, IEEE: tl.constexpr):
    """B's tile [BM, BK] times A's [BK, BN/2], fp32; the one product all kernels compute ΔW with."""
    if IEEE:
        return tl.dot(bt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
    return tl.dot(bt, at)


@triton.jit
def _delta_halves(al, bl, rows, c0, c1, R, IN, OUT, scale, BK: tl.constexpr, H: tl.constexpr, IEEE: tl.constexpr):
    """scale * sum_k B[k, o] * A[i, k] of one layer for the tile's rows and its two column halves, fp32."""
    acc0 = tl.zeros((rows.shape[0], H), dtype=tl.float32)
    acc1 = tl.zeros((rows.shape[0], H), dtype=tl.float32)
    ks = tl.arange(0, BK)
    for k0 in range(0, R, BK):
        k = k0 + ks
        bt = tl.load(bl + k[None, :] * OUT + rows[:, None], mask=(k < R)[None, :] & (rows < OUT)[:, None], other=0.0)
        a0 = tl.load(al + c0[None, :] * R + k[:, None], mask=(k < R)[:, None] & (c0 < IN)[None, :], other=0.0)
        a1 = tl.load(al + c1[None, :] * R + k[:, None], mask=(k < R)[:, None] & (c1 < IN)[None, :], other=0.0)
        acc0 += _dot(bt, a0, IEEE)
        acc1 += _dot(bt, a1, IEEE)
    return acc0 * scale, acc1 * scale


@triton.jit
def _codes(w, d, INT_T: tl.constexpr, ORD_T: tl.constexpr, UORD_T: tl.constexpr):
    """The merged values, their 4-bit restore codes (0: exception) and the exception mask, for one half."""
    merged = (w.to(tl.float32) + d).to(w.dtype)
    naive = (merged.to(tl.float32) - d).to(w.dtype)
    c = w.to(INT_T, bitcast=True).to(ORD_T) - naive.to(INT_T, bitcast=True).to(ORD_T)
    rem = (c + 7).to(UORD_T, bitcast=True) > 13              # c outside [-7, 6]; every sign change is
    return merged, tl.where(rem, 0, c + 8).to(tl.int32), rem


# Arguments that differ between the slices of one model are not specialised on. The rank is: A's rows are R
# elements long, and only a known multiple of 16 lets its loads vectorise (docs/decisions.md, 'Merge kernels
# specialised on the rank'). The variants are then one per (K tile, rank a multiple of 16 or not, rank 1), dtype
# and EVEN, which the engine builds at start-up (vlora.engine.warmup.build_merge).
@compiles.jit(ints=("row0", "tiles_o", "tiles_i"))
def _merge_kernel(w_ptr, a_ptr, b_ptr, codes_ptr, slot_ptr, row0, R, IN, OUT, stride_wl, stride_wo, code_row,
                  scale, tiles_o, tiles_i, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVEN: tl.constexpr, IEEE: tl.constexpr, INT_T: tl.constexpr, ORD_T: tl.constexpr,
                  UORD_T: tl.constexpr, SLOT_T: tl.constexpr, BITS: tl.constexpr, RESTORE: tl.constexpr = True):
    pid = tl.program_id(0)
    l = pid // (tiles_o * tiles_i)
    rest = pid % (tiles_o * tiles_i)
    ti = rest % tiles_i
    rows = (rest // tiles_i) * BM + tl.arange(0, BM)
    H: tl.constexpr = BN // 2
    j = tl.arange(0, H)
    c0 = ti * BN + j
    c1 = c0 + H
    wl = w_ptr + l.to(tl.int64) * stride_wl + row0.to(tl.int64) * stride_wo      # offsets in a layer: int32
    off0 = rows[:, None] * stride_wo + c0[None, :]
    off1 = off0 + H
    m0 = (rows < OUT)[:, None] & (c0 < IN)[None, :]
    m1 = (rows < OUT)[:, None] & (c1 < IN)[None, :]
    if EVEN:                                                 # issued first: in flight while ΔW is computed
        w0 = tl.load(wl + off0)
        w1 = tl.load(wl + off1)
    else:
        w0 = tl.load(wl + off0, mask=m0, other=0.0)
        w1 = tl.load(wl + off1, mask=m1, other=0.0)
    d0, d1 = _delta_halves(a_ptr + l.to(tl.int64) * IN * R, b_ptr + l.to(tl.int64) * R * OUT, rows, c0, c1, R, IN,
                           OUT, scale, BK, H, IEEE)
    if not RESTORE:                                          # a merge reusing its record; the cost-of-exactness baseline
        mg0 = (w0.to(tl.float32) + d0).to(w0.dtype)
        mg1 = (w1.to(tl.float32) + d1).to(w1.dtype)
    else:
        mg0, n0, r0 = _codes(w0, d0, INT_T, ORD_T, UORD_T)
        mg1, n1, r1 = _codes(w1, d1, INT_T, ORD_T, UORD_T)
        if not EVEN:
            r0 = r0 & m0
            r1 = r1 & m1
        # the row's first exception goes to its slot, its original bits re-read from the row, then a barrier:
        # the tile's stores below come after every thread's re-read (other threads store these words). Taking
        # the bits from registers instead (one min over a column|bits key) is slower (docs/decisions.md, 'Slot
        # bits re-read from memory'). The others stay unmerged with code 15, the slot flagged, for _finish_rows.
        # (The halves are combined element by element first: one reduction for the first, one for the count.)
        first = tl.min(tl.minimum(tl.where(r0, j[None, :], BN), tl.where(r1, j[None, :] + H, BN)), axis=1)
        many = tl.sum(r0.to(tl.int32) + r1.to(tl.int32), axis=1) > 1
        has = first < BN
        fb = tl.load(wl + rows * stride_wo + ti * BN + tl.where(has, first, 0), mask=has, other=0.0)
        fb = fb.to(INT_T, bitcast=True).to(SLOT_T) & ((1 << BITS) - 1)
        tl.debug_barrier()
        p0 = r0 & (j[None, :] != first[:, None])
        p1 = r1 & (j[None, :] + H != first[:, None])
        pend = many.to(SLOT_T)
        slot = tl.where(has, (pend << (BITS + 8)) | ((first + 1).to(SLOT_T) << BITS) | fb, 0)
        srow = (l.to(tl.int64) * OUT + rows) * tiles_i + ti
        tl.store(slot_ptr + srow, slot, mask=rows < OUT)
        mg0 = tl.where(p0, w0, mg0)
        mg1 = tl.where(p1, w1, mg1)
        packed = (tl.where(p0, 15, n0) | (tl.where(p1, 15, n1) << 4)).to(tl.uint8)
        cl = codes_ptr + l.to(tl.int64) * OUT * code_row
        coff = rows[:, None] * code_row + ti * H + j[None, :]
        if EVEN:
            tl.store(cl + coff, packed)
        else:
            tl.store(cl + coff, packed, mask=(rows < OUT)[:, None])
    if EVEN:
        tl.store(wl + off0, mg0)
        tl.store(wl + off1, mg1)
    else:
        tl.store(wl + off0, mg0, mask=m0)
        tl.store(wl + off1, mg1, mask=m1)


# The unmerge walks a strip of ROWS rows of one column tile, BM rows at a time, software-pipelined (STAGES), with A's
# tile loaded once per strip when the rank fits one K tile. ΔW is the same product of the same tiles as the merge's
# (the same halves, the same K steps), so the restore stays bit for bit (the GPU tests check it). The merge stays
# one tile per program: walking strips makes it slower. The slots are not read here: the merge gathers every
# exception into the record's list, which the host scatters back. Reading the slots in this kernel costs about
# what the gather costs, and the unmerge is the half of a reused switch that cannot be avoided, so the work stays
# with the merge (docs/decisions.md, 'Merge one tile per program, unmerge in strips').
@compiles.jit(ints=("row0", "tiles_i", "strips"))
def _unmerge_kernel(w_ptr, a_ptr, b_ptr, codes_ptr, row0, R, IN, OUT, stride_wl, stride_wo, code_row, scale,
                    tiles_i, strips, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                    STAGES: tl.constexpr, HOIST: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr,
                    INT_T: tl.constexpr, ORD_T: tl.constexpr, UORD_T: tl.constexpr):
    pid = tl.program_id(0)
    l = pid // (tiles_i * strips)
    rest = pid % (tiles_i * strips)
    ti = rest % tiles_i
    o_begin = (rest // tiles_i) * ROWS
    H: tl.constexpr = BN // 2
    j = tl.arange(0, H)
    c0 = ti * BN + j
    c1 = c0 + H
    ks = tl.arange(0, BK)
    wl = w_ptr + l.to(tl.int64) * stride_wl + row0.to(tl.int64) * stride_wo
    al = a_ptr + l.to(tl.int64) * IN * R
    bl = b_ptr + l.to(tl.int64) * R * OUT
    cl = codes_ptr + l.to(tl.int64) * OUT * code_row
    if HOIST:
        a0 = tl.load(al + c0[None, :] * R + ks[:, None], mask=(ks < R)[:, None] & (c0 < IN)[None, :], other=0.0)
        a1 = tl.load(al + c1[None, :] * R + ks[:, None], mask=(ks < R)[:, None] & (c1 < IN)[None, :], other=0.0)
    for o0 in tl.range(o_begin, tl.minimum(o_begin + ROWS, OUT), BM, num_stages=STAGES):
        rows = o0 + tl.arange(0, BM)
        off0 = rows[:, None] * stride_wo + c0[None, :]
        off1 = off0 + H
        coff = rows[:, None] * code_row + ti * H + j[None, :]
        m0 = (rows < OUT)[:, None] & (c0 < IN)[None, :]
        m1 = (rows < OUT)[:, None] & (c1 < IN)[None, :]
        if EVEN:
            w0 = tl.load(wl + off0)
            w1 = tl.load(wl + off1)
            packed = tl.load(cl + coff).to(tl.int32)
        else:
            w0 = tl.load(wl + off0, mask=m0, other=0.0)
            w1 = tl.load(wl + off1, mask=m1, other=0.0)
            packed = tl.load(cl + coff, mask=(rows < OUT)[:, None], other=8 | (8 << 4)).to(tl.int32)
        if HOIST:                       # the same operations as _delta_halves' one K step
            bt = tl.load(bl + ks[None, :] * OUT + rows[:, None], mask=(ks < R)[None, :] & (rows < OUT)[:, None],
                         other=0.0)
            acc0 = tl.zeros((BM, H), dtype=tl.float32)
            acc1 = tl.zeros((BM, H), dtype=tl.float32)
            acc0 += _dot(bt, a0, IEEE)
            acc1 += _dot(bt, a1, IEEE)
            d0 = acc0 * scale
            d1 = acc1 * scale
        else:
            d0, d1 = _delta_halves(al, bl, rows, c0, c1, R, IN, OUT, scale, BK, H, IEEE)
        n0 = packed & 15
        n1 = packed >> 4
        s0 = tl.where(n0 == 0, 0, n0 - 8).to(ORD_T)           # exceptions: from the list, scattered after
        s1 = tl.where(n1 == 0, 0, n1 - 8).to(ORD_T)
        x0 = ((w0.to(tl.float32) - d0).to(w0.dtype).to(INT_T, bitcast=True).to(ORD_T) + s0).to(INT_T)
        x1 = ((w1.to(tl.float32) - d1).to(w1.dtype).to(INT_T, bitcast=True).to(ORD_T) + s1).to(INT_T)
        if EVEN:
            tl.store(wl + off0, x0.to(w0.dtype, bitcast=True))
            tl.store(wl + off1, x1.to(w1.dtype, bitcast=True))
        else:
            tl.store(wl + off0, x0.to(w0.dtype, bitcast=True), mask=m0)
            tl.store(wl + off1, x1.to(w1.dtype, bitcast=True), mask=m1)


# The exceptions past a row's first, which the merge left unmerged with code 15 in the rows whose slot it flagged:
# listed (flat index in the slice, original bits) with their codes set to 0, G flagged rows a program and one
# atomic add each, then merged with ΔW summed in float64. In Triton, not torch: torch would gather [rows, BN]
# index tensors on the host side of the merge and sync on them (docs/decisions.md, 'Flagged rows finished in
# Triton').
@compiles.jit(ints=("P", "row0", "capacity"))
def _list_pending_kernel(w_ptr, codes_ptr, rows_ptr, t_ptr, count_ptr, idx_ptr, bits_ptr, P, row0, IN, OUT,
                         stride_wl, stride_wo, code_row, capacity, BN: tl.constexpr, G: tl.constexpr,
                         INT_T: tl.constexpr):
    g = tl.program_id(0) * G + tl.arange(0, G)
    gm = g < P
    rf = tl.load(rows_ptr + g, mask=gm, other=0)             # layer * OUT + row in the slice
    t = tl.load(t_ptr + g, mask=gm, other=0)
    H: tl.constexpr = BN // 2
    j = tl.arange(0, H)[None, :]
    cp = codes_ptr + rf[:, None] * code_row + t[:, None] * H + j
    byte = tl.load(cp, mask=gm[:, None], other=0).to(tl.int32)
    p0 = (byte & 15) == 15
    p1 = (byte >> 4) == 15
    f0 = tl.reshape(p0.to(tl.int32), (G * H,))
    f1 = tl.reshape(p1.to(tl.int32), (G * H,))
    n0 = tl.sum(f0, axis=0)
    base = tl.atomic_add(count_ptr, n0 + tl.sum(f1, axis=0))
    pos0 = tl.reshape(base + tl.cumsum(f0, axis=0) - 1, (G, H))
    pos1 = tl.reshape(base + n0 + tl.cumsum(f1, axis=0) - 1, (G, H))
    p0 = p0 & (pos0 < capacity)                              # no room: left pending for another pass
    p1 = p1 & (pos1 < capacity)
    col0 = t[:, None] * BN + j
    l = rf // OUT
    wl = w_ptr + l[:, None] * stride_wl + (row0 + rf[:, None] % OUT) * stride_wo
    tl.store(idx_ptr + pos0, rf[:, None] * IN + col0, mask=p0)
    tl.store(idx_ptr + pos1, rf[:, None] * IN + col0 + H, mask=p1)
    tl.store(bits_ptr + pos0, tl.load(wl + col0, mask=p0, other=0.0).to(INT_T, bitcast=True), mask=p0)
    tl.store(bits_ptr + pos1, tl.load(wl + col0 + H, mask=p1, other=0.0).to(INT_T, bitcast=True), mask=p1)
    lo = tl.where(p0, 0, byte & 15)
    hi = tl.where(p1, 0, byte >> 4)
    tl.store(cp, (lo | (hi << 4)).to(tl.uint8), mask=p0 | p1)


@compiles.jit(ints=("n", "row0"))
def _merge_listed_kernel(w_ptr, a_ptr, b_ptr, idx_ptr, n, row0, R, IN, OUT, stride_wl, stride_wo, scale,
                         BLOCK: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = e < n
    f = tl.load(idx_ptr + e, mask=m, other=0)                # flat index in the slice [L, OUT, IN]
    l = f // (OUT * IN)
    rest = f % (OUT * IN)
    o = rest // IN
    i = rest % IN
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    for k in range(0, R):
        av = tl.load(a_ptr + (l * IN + i) * R + k, mask=m, other=0.0).to(tl.float64)
        bv = tl.load(b_ptr + (l * R + k) * OUT + o, mask=m, other=0.0).to(tl.float64)
        acc += av * bv
    wp = w_ptr + l * stride_wl + (row0 + o) * stride_wo + i
    wv = tl.load(wp, mask=m, other=0.0)
    tl.store(wp, (wv.to(tl.float64) + acc * scale).to(tl.float32).to(wv.dtype), mask=m)


def _ieee(w: torch.Tensor) -> bool:
    """fp32 products for fp32 weights, and in the interpreter (its dot of 16-bit inputs is wrong; bf16 x bf16
    products are exact in fp32, so the result is the same)."""
    return w.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _consts(w: torch.Tensor) -> dict:
    it = INT_OF[w.dtype]
    nbits = torch.iinfo(it).bits
    # bit patterns widened for their differences: 16-bit floats in int32, 32-bit ones in int64
    if nbits == 16:
        return dict(INT_T=tl.int16, ORD_T=tl.int32, UORD_T=tl.uint32)
    return dict(INT_T=tl.int32, ORD_T=tl.int64, UORD_T=tl.uint64)


def _slot_consts(w: torch.Tensor) -> tuple[torch.dtype, dict]:
    """A slot: flag << (bits + 8) | (column + 1) << bits | original bits, in int32 (16-bit floats) or int64."""
    if INT_OF[w.dtype] == torch.int16:
        return torch.int32, dict(SLOT_T=tl.int32, BITS=16)
    return torch.int64, dict(SLOT_T=tl.int64, BITS=32)


def k_tile(rank: int) -> int:
    """The K tile of ΔW's product for an adapter of this rank (a constexpr: one kernel variant each)."""
    return max(16, min(64, triton.next_power_of_2(rank)))


def variant(rank: int) -> tuple[int, bool, bool, bool]:
    """What of the rank the merge kernels are specialised on: the K tile, whether it is a multiple of 16,
    whether it is 1 (Triton specialises integers equal to 1 too), and whether it fits one K tile (the unmerge
    loads A once per strip then)."""
    return k_tile(rank), rank % 16 == 0, rank == 1, rank <= k_tile(rank)


def _tiles(out: int, inn: int, bm: int, bn: int) -> tuple[int, int]:
    return triton.cdiv(out, bm), triton.cdiv(inn, bn)


# Tile of both kernels: (BM, BN, warps). ``benchmarks/bench_merge.py --sweep`` times the alternatives. (64, 128, 4)
# gives the fastest merge with a record and without one, and an unmerge walking strips of 512 rows about as fast
# as the best (docs/decisions.md, 'Exact merge tiles').
TILE = (64, 128, 4)
UNMERGE_WALK = (512, 3)      # the unmerge's strip: rows (a multiple of BM) and pipeline stages


def unmerge_shared(bm: int, bn: int, bk: int, w_bytes: int, f_bytes: int, stages: int) -> int:
    """Estimated shared memory (bytes) of the unmerge: per pipeline stage a row tile of W, its codes and B's
    tile; A's tile loaded once per strip."""
    return stages * (bm * bn * w_bytes + bm * bn // 2 + bm * bk * f_bytes) + bk * bn * f_bytes


def unmerge_stages(bm: int, bn: int, bk: int, w_bytes: int, f_bytes: int, stages: int, shared_bytes: int) -> int:
    """The unmerge's pipeline stages, fewer where the device's shared memory cannot hold them."""
    while stages > 1 and unmerge_shared(bm, bn, bk, w_bytes, f_bytes, stages) > shared_bytes:
        stages -= 1
    return stages


@dataclass
class SliceRestore:
    """What the unmerge of one slice needs besides ΔW: the codes and the exceptions' original bits."""

    codes: torch.Tensor          # uint8 [L, out, tiles_i * BN/2]: a byte holds columns j and j + BN/2 of its tile
    exc_index: torch.Tensor      # int64 flat indices into the stacked weights [L, out_packed, in]
    exc_bits: torch.Tensor       # their original bit patterns
    tile: tuple[int, int, int]   # the merge's tile: the unmerge and a merge that reuses this record compute ΔW with it
    from_slots: int = 0          # how many of the exceptions the row slots held (the rest: finished by _finish_rows)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.exc_index, self.exc_bits]


def stacked_index(idx: torch.Tensor, w: torch.Tensor, row0: int, out: int) -> torch.Tensor:
    """Flat indices into the slice ``w[:, row0:row0 + out]`` (shape [L, out, in]) -> flat indices into ``w``."""
    per_layer = out * w.shape[2]
    return idx + (idx // per_layer) * ((w.shape[1] - out) * w.shape[2]) + row0 * w.shape[2]


@dataclass
class LaunchedMerge:
    """A merge whose kernel is queued and whose record is not made yet (:func:`finish_merge`)."""

    w: torch.Tensor
    row0: int
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    codes: torch.Tensor
    slots: torch.Tensor
    tile: tuple[int, int, int]
    done: torch.cuda.Event | None = None     # recorded after the kernel on CUDA


def merge_slice_(w: torch.Tensor, row0: int, a: torch.Tensor, b: torch.Tensor, scale: float,
                 tile: tuple[int, int, int] | None = None, restore: bool = True) -> SliceRestore | None:
    """Merge ``scale * (A B)^T`` into rows ``[row0, row0 + out)`` of every layer of ``w``, in place.

    Shape: w [L, out_packed, in] contiguous; a [L, in, r], b [L, r, out] in w's dtype (float32 weights: the
    products in IEEE fp32). Returns the slice's restore record: the kernel's codes and one list of the
    exceptions, the slots' gathered and the rows' further ones, which are merged here (:func:`_finish_rows`).
    ``restore=False`` writes no restore record (returns None; not undoable exactly): a merge that reuses a
    record, and the benchmarks' cost-of-exactness baseline.
    """
    launched = launch_merge_(w, row0, a, b, scale, tile, restore)
    return finish_merge(launched) if restore else None


def launch_merge_(w: torch.Tensor, row0: int, a: torch.Tensor, b: torch.Tensor, scale: float,
                  tile: tuple[int, int, int] | None = None, restore: bool = True) -> LaunchedMerge:
    """The kernel of :func:`merge_slice_`, queued: the weights merged but for the further exceptions of the
    flagged rows, codes and slots written. :func:`finish_merge` makes the record (it waits for the kernel only,
    so a caller may queue the kernels of every slice first and finish each on a side stream)."""
    assert w.is_contiguous() and a.dtype == b.dtype == w.dtype
    L, _, inn = w.shape
    r, out = b.shape[1], b.shape[2]
    bm, bn, num_warps = tuple(tile or TILE)
    assert bn <= 128 and bn & (bn - 1) == 0, "BN: a power of two up to 128 (a slot holds the column + 1 in 8 bits)"
    assert out * inn < 2 ** 31, "offsets within a layer are int32"
    to, ti = _tiles(out, inn, bm, bn)
    code_row = ti * bn // 2
    slot_dtype, slot_consts = _slot_consts(w)
    if restore:
        codes = torch.empty(L, out, code_row, dtype=torch.uint8, device=w.device)
        slots = torch.empty(L * out * ti, dtype=slot_dtype, device=w.device)
    else:                                                    # nothing is written to them
        codes = torch.empty(1, dtype=torch.uint8, device=w.device)
        slots = torch.empty(1, dtype=slot_dtype, device=w.device)
    a, b = a.contiguous(), b.contiguous()
    _merge_kernel[(L * to * ti,)](w, a, b, codes, slots, row0, r, inn, out, w.stride(0), w.stride(1), code_row, scale,
                                  to, ti, BM=bm, BN=bn, BK=k_tile(r), EVEN=out % bm == 0 and inn % bn == 0,
                                  IEEE=_ieee(w), num_warps=num_warps, RESTORE=restore, **_consts(w), **slot_consts)
    done = None
    if restore and w.is_cuda:                                # what finish_merge waits for
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(w.device))
    return LaunchedMerge(w, row0, a, b, scale, codes, slots, (bm, bn, num_warps), done)


def finish_merge(m: LaunchedMerge) -> SliceRestore:
    """The record of a launched merge: the slots gathered into the list, the flagged rows finished, on the
    current stream (which first waits for the merge's kernel)."""
    if m.done is not None:
        torch.cuda.current_stream(m.w.device).wait_event(m.done)
    w, bn = m.w, m.tile[1]
    inn, out = w.shape[2], m.b.shape[2]
    ti = m.slots.numel() // (w.shape[0] * out)
    nbits = torch.iinfo(INT_OF[w.dtype]).bits
    where = m.slots.nonzero().squeeze(1)                     # tile rows with an exception
    v = m.slots[where]
    row, t = where // ti, where % ti                         # row: layer * out + row in the slice
    first = ((v >> nbits) & 0xFF) - 1
    idx = [row * inn + t * bn + first]
    bits = [(v & ((1 << nbits) - 1)).to(INT_OF[w.dtype])]    # the low bits, wrapped into the signed type
    pending = ((v >> (nbits + 8)) & 1).nonzero().squeeze(1)
    if pending.numel():
        more_idx, more_bits = _finish_rows(w, m.row0, m.a, m.b, m.scale, m.codes, row[pending], t[pending], bn)
        idx.append(more_idx)
        bits.append(more_bits)
    return SliceRestore(m.codes, stacked_index(torch.cat(idx), w, m.row0, out), torch.cat(bits), m.tile,
                        int(where.numel()))


def pending_capacity(rows: int) -> int:
    """The first pass's room for the exceptions of ``rows`` flagged tile rows (rows rarely hold more than two)."""
    return max(1024, 4 * rows)


def _finish_rows(w: torch.Tensor, row0: int, a: torch.Tensor, b: torch.Tensor, scale: float, codes: torch.Tensor,
                 row: torch.Tensor, t: torch.Tensor, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the elements the kernel left (code 15) in the flagged tile rows ``(row, t)`` of the slice at ``row0``
    of ``w``, mark them exceptions (code 0) and return their (flat indices in the slice, original bits). Their
    ΔW is summed in float64 and the merged value rounded to float32, then to the weights' dtype, not as on the
    tensor cores: it may differ from the kernel's in the last place, and the record restores it from the list
    either way."""
    L, _, inn = w.shape
    out = b.shape[2]
    P = row.numel()
    count = torch.zeros(1, dtype=torch.int32, device=w.device)
    capacity = pending_capacity(P)
    idx, bits = [], []
    G = 16
    while True:
        count.zero_()
        i_buf = torch.empty(capacity, dtype=torch.int64, device=w.device)
        b_buf = torch.empty(capacity, dtype=INT_OF[w.dtype], device=w.device)
        _list_pending_kernel[(triton.cdiv(P, G),)](w, codes, row, t, count, i_buf, b_buf, P, row0, inn, out,
                                                  w.stride(0), w.stride(1), codes.shape[2], capacity, BN=bn, G=G,
                                                  INT_T=_consts(w)["INT_T"], num_warps=4)
        n = int(count.item())
        listed = min(n, capacity)
        if listed:
            _merge_listed_kernel[(triton.cdiv(listed, 256),)](w, a, b, i_buf, listed, row0, a.shape[2], inn, out,
                                                               w.stride(0), w.stride(1), scale, BLOCK=256)
        idx.append(i_buf[:listed])
        bits.append(b_buf[:listed])
        if n <= capacity:
            return torch.cat(idx), torch.cat(bits)
        capacity = n - capacity                              # the rest, still pending, in another pass


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
    stages = unmerge_stages(bm, bn, bk, w.element_size(), a.element_size(), stages,
                            device_limits(w.device).shared_bytes)
    _unmerge_kernel[(L * tiles_i * strips,)](w, a.contiguous(), b.contiguous(), rec.codes, row0, r, inn, out,
                                             w.stride(0), w.stride(1), rec.codes.shape[2], scale, tiles_i, strips,
                                             BM=bm, BN=bn, BK=bk, ROWS=rows, STAGES=stages, HOIST=r <= bk,
                                             EVEN=out % bm == 0 and inn % bn == 0, IEEE=_ieee(w),
                                             num_warps=num_warps, **_consts(w))
    if rec.exc_index.numel():
        w.view(INT_OF[w.dtype]).view(-1)[rec.exc_index] = rec.exc_bits
