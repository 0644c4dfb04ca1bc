"""ATMM: adaptive-tiling batched LoRA kernels (V-LoRA §4.3), in Triton.

Tokens of an iteration fall in segments; segment ``s`` covers rows
``[start_s, start_s + len_s)`` and applies one adapter at its own rank ``r_s``
with scale ``scale_s`` (a negative scale subtracts: the deLoRA pair is a second
pass with the merged adapter and ``-scale``). Rows in no segment are untouched.

Adapter weights live in one flat buffer ``w`` and are addressed by offsets, so
the memory pool may place every adapter (and every layer) anywhere:

* shrink, for one packed group of ``NS`` slices (e.g. q, k, v):
  ``A_s`` = ``w[a_off_s : a_off_s + R_s * K].view(R_s, K)``, the A of the present
  slices stacked along the rank (``R_s = n_present * r_s``);
  ``v[rows_s, :R_s] = x[rows_s] @ A_s^T`` (fp32).
* expand, per slice ``j``: ``B_sj`` = ``w[b_off_sj : + r_s * width_j].view(r_s, width_j)``
  (``b_off_sj < 0``: the adapter does not target slice ``j``);
  ``y[rows_s, col_j : col_j + width_j] += scale_s * v[rows_s, vcol_sj : vcol_sj + r_s] @ B_sj``.

A segment may carry a second (adapter, scale) pair on the same rows (mixed mode: the merged adapter with
``-scale``; ``pair`` arguments, ``SegmentMeta.pair_ranks/pair_scales``, rank 0 = none): the shrink stacks the
second adapter's A rows after the first's (``v[rows_s, R_s : R_s + R2_s]``, the A rows picked per column from
either adapter's offset), and each expand program adds both products, ``scale_s * v1 @ B1 + scale2_s * v2 @ B2``,
to its tile of y in one read-modify-write. Two segments over the same rows in one launch would race on y; one
segment with two adapters does not, and a mixed iteration costs one shrink and one expand per group.

Tile sizes come from :mod:`vlora.kernels.tuning` (one table lookup per call).

On Hopper and later the expand is launched as a programmatic dependent of the shrink (PDL): the shrink lets
it launch as soon as all its programs have started, and the expand's programs read their metadata and set up
while the shrink finishes, then wait for it (``griddepcontrol.wait``: the shrink complete, its writes visible)
before they read v. A pair's launch latency and ramp-up then overlap the shrink instead of following it.
``LoRAConfig.lora_pdl=False`` launches them one after the other.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from vlora.kernels import compiles
from vlora.kernels.limits import device_limits
from vlora.kernels.segments import SegmentMeta


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    m_loop: int = 1            # expand: M tiles each program walks (amortises metadata, reuses B from cache)
    n_loop: int = 1            # expand: N tiles each program walks (decode: a few rows, a long strip of B)
    hoist: int = 0             # expand: v loaded once (block_k covers the rank), the strip walked as the innermost,
    #                            software-pipelined loop (1); or a K loop inside every tile of the strip (0)
    reduce: int = 0            # shrink, split_k > 1: the last part of a tile sums the planes (1), or the expand sums
    #                            them, once per column tile (0; what tables of 9 fields were tuned with)

    def as_list(self) -> list[int]:
        return [self.block_m, self.block_n, self.block_k, self.split_k, self.num_warps, self.num_stages, self.m_loop,
                self.n_loop, self.hoist, self.reduce]

    @property
    def planes(self) -> int:
        """Planes of v a shrink with this config hands to the expand."""
        return self.split_k if self.split_k > 1 and not self.reduce else 1


# Arguments that change with the batch are not specialised on (v's strides follow T and the batch's largest rank,
# the row-tile count its longest segment, the offset rows are views [layer] of [L, S] tables): the variants left
# are the tile configs', which vlora.engine.warmup builds at start-up.
@compiles.jit(ints=("stride_vk", "stride_vm", "m_tiles"),
              pointers=("a_off_ptr", "rtot_ptr", "count_ptr", "a_off2_ptr", "rtot2_ptr", "pranks_ptr"))
def _shrink_kernel(x_ptr, w_ptr, v_ptr, a_off_ptr, rtot_ptr, starts_ptr, lens_ptr, count_ptr,
                   K, stride_xm, stride_vk, stride_vm, m_tiles, a_off2_ptr, rtot2_ptr, pranks_ptr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, REDUCE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                   ALIGNED: tl.constexpr, GDC: tl.constexpr = False, PAIR: tl.constexpr = False):
    if GDC:                                     # the expand may launch now; it waits for this grid before reading v
        tl.extra.cuda.gdc_launch_dependents()
    pid0 = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    seg = pid0 // m_tiles
    m0 = (pid0 % m_tiles) * BLOCK_M
    seg_len = tl.load(lens_ptr + seg)
    rtot = tl.load(rtot_ptr + seg)
    rtot1 = rtot
    if PAIR:                                    # the second adapter's A rows follow the first's
        rtot = rtot1 + tl.where(tl.load(pranks_ptr + seg) > 0, tl.load(rtot2_ptr + seg), 0)
    n0 = pid_n * BLOCK_N
    if (m0 < seg_len) & (n0 < rtot):
        start = tl.load(starts_ptr + seg).to(tl.int64)
        a_off = tl.load(a_off_ptr + seg)
        if ALIGNED:                             # offsets from memory: promise 16-element alignment so
            a_off = tl.multiple_of(a_off, 16)   # loads vectorise (the buffer layout guarantees it)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < seg_len
        n_mask = offs_n < rtot
        x_ptrs = x_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        if PAIR:                                # each column's A row from whichever adapter owns it
            a_off2 = tl.load(a_off2_ptr + seg)
            rows = offs_n.to(tl.int64)
            a_rows = tl.where(rows < rtot1, a_off + rows * K, a_off2 + (rows - rtot1) * K)
            if ALIGNED:
                a_rows = tl.multiple_of(a_rows, 16)
            a_ptrs = w_ptr + a_rows[None, :] + offs_k[:, None]
        else:
            a_ptrs = w_ptr + a_off + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        k_span = tl.cdiv(K, BLOCK_K * SPLIT_K) * BLOCK_K
        k_begin = pid_k * k_span
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_begin, tl.minimum(k_begin + k_span, K), BLOCK_K):
            if EVEN_K:                          # K splits evenly into tiles: no K mask on the loads
                xt = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
                at = tl.load(a_ptrs + k, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = (k + offs_k) < K
                xt = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                at = tl.load(a_ptrs + k, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xt, at, input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        # split-K partials go to their own plane (no zero fill, no atomics on data); with REDUCE the last part of
        # a tile to finish sums the planes, in plane order (the same bits whichever finishes last), into plane 0
        v_rows = v_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_vm + offs_n[None, :]
        v_mask = m_mask[:, None] & n_mask[None, :]
        tl.store(v_rows + pid_k * stride_vk, acc, mask=v_mask)
        if REDUCE:
            tl.debug_barrier()                  # every thread's partial issued before the tile's count moves
            tile = pid0 * tl.num_programs(1) + pid_n
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                total = tl.load(v_rows, mask=v_mask, other=0.0, cache_modifier=".cg")    # from L2, not L1
                for p in tl.static_range(1, SPLIT_K):
                    total += tl.load(v_rows + p * stride_vk, mask=v_mask, other=0.0, cache_modifier=".cg")
                tl.store(v_rows, total, mask=v_mask)
                tl.atomic_xchg(count_ptr + tile, 0)                  # ready for the next launch


@compiles.jit(ints=("stride_vk", "stride_vm", "m_progs"),
              pointers=("b_off_ptr", "vcol_ptr", "b_off2_ptr", "vcol2_ptr", "rtot1_ptr", "pranks_ptr",
                        "pscales_ptr"))
def _expand_kernel(v_ptr, w_ptr, y_ptr, b_off_ptr, vcol_ptr, tiles_ptr, widths_ptr, cols_ptr,
                   starts_ptr, lens_ptr, ranks_ptr, scales_ptr, stride_vk, stride_vm, stride_ym, m_progs,
                   b_off2_ptr, vcol2_ptr, rtot1_ptr, pranks_ptr, pscales_ptr,
                   NS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   M_LOOP: tl.constexpr, N_LOOP: tl.constexpr, SPLIT_V: tl.constexpr, IEEE: tl.constexpr,
                   ALIGNED: tl.constexpr, HOIST: tl.constexpr, STAGES: tl.constexpr, GDC: tl.constexpr = False,
                   PAIR: tl.constexpr = False):
    pid0 = tl.program_id(0)
    pid_t = tl.program_id(1)
    seg = pid0 // m_progs
    m_first = (pid0 % m_progs) * (BLOCK_M * M_LOOP)
    seg_len = tl.load(lens_ptr + seg)
    sl = tl.load(tiles_ptr + 2 * pid_t)
    b_off = tl.load(b_off_ptr + seg * NS + sl)
    n0 = tl.load(tiles_ptr + 2 * pid_t + 1)
    width = tl.load(widths_ptr + sl)
    col0 = tl.load(cols_ptr + sl)
    r = tl.load(ranks_ptr + seg)
    vcol = tl.load(vcol_ptr + seg * NS + sl)
    scale = tl.load(scales_ptr + seg)
    start = tl.load(starts_ptr + seg).to(tl.int64)
    if PAIR:                                    # the segment's second adapter on this slice (rank 0: none)
        r2 = tl.load(pranks_ptr + seg)
        b_off2 = tl.where(r2 > 0, tl.load(b_off2_ptr + seg * NS + sl), -1)
        work = (b_off >= 0) | (b_off2 >= 0)
        r = tl.where(b_off >= 0, r, 0)          # an adapter that skips this slice adds nothing: rank 0, and a
        r2 = tl.where(b_off2 >= 0, r2, 0)       # valid, aligned offset that is never read
        b_off = tl.maximum(b_off, 0)
        b_off2 = tl.maximum(b_off2, 0)
        vcol2 = tl.load(rtot1_ptr + seg) + tl.load(vcol2_ptr + seg * NS + sl)
        scale2 = tl.load(pscales_ptr + seg)
    else:
        work = b_off >= 0
    if GDC:
        # launched early (PDL): the metadata above was written before the shrink (a plain launch) started, so it
        # may be read before the wait; from here on every grid this one depends on is complete and its writes
        # visible: the shrink, and under CUDA-graph capture also the kernels of other streams it waits on (their
        # edges are captured as programmatic too). Every program waits, those with no work too, so that this grid
        # never completes before them: a later launch ordered after it alone (the next PDL expand) then finds
        # them done as well. No program may leave before this line.
        tl.extra.cuda.gdc_wait()
    if (m_first < seg_len) & work:
        if ALIGNED:                             # see the shrink kernel
            n0 = tl.multiple_of(n0, BLOCK_N)
            width = tl.multiple_of(width, 16)
            col0 = tl.multiple_of(col0, 16)
            b_off = tl.multiple_of(b_off, 16)
            vcol = tl.multiple_of(vcol, 8)
            if PAIR:
                b_off2 = tl.multiple_of(b_off2, 16)
                vcol2 = tl.multiple_of(vcol2, 8)
        offs_k = tl.arange(0, BLOCK_K)
        if HOIST:                               # one M tile, rank <= BLOCK_K: v once, then a pipelined strip of B
            offs_m = m_first + tl.arange(0, BLOCK_M)
            m_mask = offs_m < seg_len
            k_mask = offs_k < r
            v_rows = v_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_vm + offs_k[None, :]
            vt = _planes(v_rows + vcol, m_mask[:, None] & k_mask[None, :], stride_vk, SPLIT_V)
            vt = vt.to(w_ptr.dtype.element_ty)
            y_rows = y_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_ym + col0
            b_rows = w_ptr + b_off + offs_k[:, None].to(tl.int64) * width
            if PAIR:
                k_mask2 = offs_k < r2
                vt2 = _planes(v_rows + vcol2, m_mask[:, None] & k_mask2[None, :], stride_vk, SPLIT_V)
                vt2 = vt2.to(w_ptr.dtype.element_ty)
                b_rows2 = w_ptr + b_off2 + offs_k[:, None].to(tl.int64) * width
            for ni in tl.range(0, N_LOOP, num_stages=STAGES):
                offs_n = n0 + ni * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = offs_n < width
                bt = tl.load(b_rows + offs_n[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                mask = m_mask[:, None] & n_mask[None, :]
                y = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0)
                out = y.to(tl.float32) + scale * _mma(vt, bt, IEEE)
                if PAIR:
                    bt2 = tl.load(b_rows2 + offs_n[None, :], mask=k_mask2[:, None] & n_mask[None, :], other=0.0)
                    out += scale2 * _mma(vt2, bt2, IEEE)
                tl.store(y_rows + offs_n[None, :], out.to(y.dtype), mask=mask)
        else:
            for ni in range(N_LOOP):                # a strip of N_LOOP column tiles of one slice
                offs_n = n0 + ni * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = offs_n < width
                b_ptrs = w_ptr + b_off + offs_k[:, None].to(tl.int64) * width + offs_n[None, :]
                if PAIR:
                    b_ptrs2 = w_ptr + b_off2 + offs_k[:, None].to(tl.int64) * width + offs_n[None, :]
                for mi in range(M_LOOP):            # this program's M tiles share metadata and B (cached)
                    offs_m = m_first + mi * BLOCK_M + tl.arange(0, BLOCK_M)
                    m_mask = offs_m < seg_len
                    v_rows = v_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_vm + offs_k[None, :]
                    y_ptrs = y_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_ym + col0 + offs_n[None, :]
                    mask = m_mask[:, None] & n_mask[None, :]
                    y = tl.load(y_ptrs, mask=mask, other=0.0)    # issued before the K loop: overlaps it
                    out = y.to(tl.float32) + scale * _k_loop(v_rows + vcol, b_ptrs, r, width, stride_vk, m_mask,
                                                             n_mask, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_V, IEEE)
                    if PAIR:
                        out += scale2 * _k_loop(v_rows + vcol2, b_ptrs2, r2, width, stride_vk, m_mask, n_mask,
                                                offs_k, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_V, IEEE)
                    tl.store(y_ptrs, out.to(y.dtype), mask=mask)


@triton.jit
def _mma(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _planes(v_ptrs, mask, stride_vk, SPLIT_V: tl.constexpr):
    """A tile of v: the sum of the shrink's split-K planes."""
    vt = tl.load(v_ptrs, mask=mask, other=0.0)
    for p in tl.static_range(1, SPLIT_V):
        vt += tl.load(v_ptrs + p * stride_vk, mask=mask, other=0.0)
    return vt


@triton.jit
def _k_loop(v_ptrs, b_ptrs, r, width, stride_vk, m_mask, n_mask, offs_k, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_V: tl.constexpr, IEEE: tl.constexpr):
    """v[rows, :r] @ B[:r, cols] in fp32, over K tiles of the rank (v's planes summed as they are read)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, r, BLOCK_K):
        k_mask = (k + offs_k) < r
        vt = _planes(v_ptrs + k, m_mask[:, None] & k_mask[None, :], stride_vk, SPLIT_V)
        bt = tl.load(b_ptrs + k * width, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += _mma(vt.to(bt.dtype), bt, IEEE)
    return acc


@lru_cache(maxsize=256)
def _column_tiles(widths: tuple[int, ...], block_n: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiles [n_tiles, 2] = (slice, first column in slice), widths [NS], column starts [NS]) for a group."""
    tiles, cols, c = [], [], 0
    for j, w in enumerate(widths):
        tiles.extend((j, n) for n in range(0, w, block_n))
        cols.append(c)
        c += w
    dev = torch.device(device)
    return (torch.tensor(tiles, dtype=torch.int32, device=dev).flatten(),
            torch.tensor(widths, dtype=torch.int32, device=dev),
            torch.tensor(cols, dtype=torch.int32, device=dev))


@lru_cache(maxsize=16)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1"


def pdl(device: torch.device, wanted: bool = True) -> bool:
    """Whether the expand is launched as a programmatic dependent of the shrink on ``device``: ``wanted``
    (``LoRAConfig.lora_pdl``) and Hopper or later (compute capability 9)."""
    if not wanted or device.type != "cuda":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


_pdl = pdl                   # for the launchers, whose flag argument shadows the name


def shared_need(cfg: TileConfig, a_bytes: int, b_bytes: int) -> int:
    """Estimated shared memory (bytes) of ``cfg``: its pipeline stages of operand tiles, A [BM, BK] and B [BK, BN]
    (the expand's v tile counted as A, at 4 bytes)."""
    return max(cfg.num_stages, 1) * (cfg.block_m * cfg.block_k * a_bytes + cfg.block_k * cfg.block_n * b_bytes)


def _smaller(cfg: TileConfig) -> TileConfig | None:
    """The next config down: one pipeline stage fewer, then half the K tile, then half the N tile."""
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_k > 16:
        return dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    if cfg.block_n > 16:
        return dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    return None


def fit_shared(cfg: TileConfig, a_bytes: int, b_bytes: int, shared_bytes: int | None = None) -> TileConfig:
    """``cfg`` with fewer pipeline stages, then a shorter K tile (then a narrower N tile), until its operand tiles
    fit in ``shared_bytes`` (default: the current device's opt-in shared memory per block). Tables are tuned for
    16-bit data; float32 doubles a config's footprint, and smaller GPUs have less room."""
    limit = device_limits().shared_bytes if shared_bytes is None else shared_bytes
    while shared_need(cfg, a_bytes, b_bytes) > limit:
        smaller = _smaller(cfg)
        if smaller is None:
            break
        cfg = smaller
    return cfg


# (kernel, config asked for, element sizes, device) -> the smaller config that launched where Triton found the
# first one needs more shared memory than the device has (the estimate above undercounts it)
_refitted: dict[tuple, TileConfig] = {}


def _launch_fitting(kernel: str, cfg: TileConfig, sizes: tuple[int, int], device: torch.device, launch) -> None:
    """``launch(cfg)``, stepping down to smaller configs while Triton refuses it for shared memory (it refuses
    before running anything, so a retry computes nothing twice)."""
    key = (kernel, cfg, sizes, str(device))
    cfg = _refitted.get(key, cfg)
    while True:
        try:
            launch(cfg)
            return
        except OutOfResources:
            smaller = _smaller(cfg)
            if smaller is None:
                raise
            cfg = _refitted[key] = smaller


def expand_hoisted(cfg: TileConfig, max_rank: int | None) -> bool:
    """Whether expand runs ``cfg`` (already :func:`fit_shared`) hoisted: the config asks for it and the
    segments' largest rank is known and fits its K tile."""
    return bool(cfg.hoist) and max_rank is not None and max_rank <= cfg.block_k


def shrink_output(x: torch.Tensor, r_max: int, cfg: TileConfig) -> torch.Tensor:
    """An uninitialised buffer for :func:`lora_shrink`: [split_k, T, r_max] fp32, one plane per split-K part."""
    return torch.empty(cfg.split_k, x.shape[0], max(r_max, 1), dtype=torch.float32, device=x.device)


_counts: dict[str, list[torch.Tensor]] = {}      # device -> its counter buffers, the newest last (captured CUDA
#                                                   graphs may still point at the older ones: they are kept)


def tile_counts(device: torch.device, tiles: int, lane: int = 0) -> torch.Tensor:
    """Zeroed int32 counters, one per shrink tile, for the split-K parts of a tile to find the last of them (which
    sets its counter back to 0). One buffer per device and ``lane``: split-K shrinks that may run at the same time
    on two streams must use different lanes (the mixed mode's two LoRA passes do). It is allocated, or grown,
    outside CUDA-graph capture only: a buffer made during capture would never be zeroed (the engine's start-up
    launches every kernel variant before it captures)."""
    bufs = _counts.setdefault(f"{device}/{lane}", [])
    if not bufs or bufs[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("lora_shrink: a split-K shrink of this size must run once before CUDA-graph capture")
        size = max(tiles, 1 << 16, 2 * bufs[-1].numel() if bufs else 0)
        bufs.append(torch.zeros(size, dtype=torch.int32, device=device))
    return bufs[-1]


def lora_shrink(x: torch.Tensor, w: torch.Tensor, a_off: torch.Tensor, rtot: torch.Tensor, meta: SegmentMeta,
                r_max: int, cfg: TileConfig, out: torch.Tensor | None = None, aligned: bool = False,
                lane: int = 0, pdl: bool = True,
                pair: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """v[p, rows_s, :R_s] = x[rows_s, K_p] @ A_s[:, K_p]^T for every segment and split-K part p.

    Shape: x [T, K]; w [N_w] flat; a_off [S] int64; rtot [S] int32 (R_s); ``out`` (or a fresh
    :func:`shrink_output`) [split_k, T, r_max] fp32, one plane per part. Returns the ``cfg.planes`` planes whose
    sum is x @ A^T on segment rows: all of them, or with ``cfg.reduce`` plane 0 alone ([1, T, r_max]), into
    which the last part of each tile to finish adds the others up (other entries are left as allocated:
    uninitialised, or ``out``'s contents). Summed here, the expand reads one plane instead of split_k of them
    for every column tile it computes; an expand with v hoisted reads them once per strip, and for a few decode
    rows the sum costs more than it saves. The tuner picks per shape (docs/decisions.md, 'Split-K planes, shrink and expand tuned as a pair, hoisted expands for prefill').
    ``aligned``: the caller guarantees every a_off and K are multiples of 16 (vectorised loads). ``lane``: the
    split-K counters to use (:func:`tile_counts`), distinct for shrinks that may run concurrently. ``pdl``: let a
    programmatic dependent expand start early, where the GPU can (:func:`pdl`); its expand must say the same.
    ``pair``: (a_off2 [S] int64, rtot2 [S] int32) of each segment's second adapter, present where
    ``meta.pair_ranks`` is positive: v[p, rows_s, R_s : R_s + R2_s] = x @ A2_s^T as well (``r_max`` covers
    R_s + R2_s).
    """
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, K] with unit column stride"
    assert w.dim() == 1 and w.is_contiguous() and w.dtype == x.dtype, "w must be a flat buffer of x's dtype"
    assert a_off.dtype == torch.int64 and rtot.dtype == torch.int32
    if out is None:
        v = shrink_output(x, r_max, cfg)
    else:
        assert (out.dtype == torch.float32 and out.is_contiguous()
                and tuple(out.shape) == (cfg.split_k, x.shape[0], max(r_max, 1)))
        v = out
    num_segs = meta.starts.shape[0]
    if num_segs == 0 or meta.max_len == 0:
        return v[:cfg.planes]
    cfg = fit_shared(cfg, x.element_size(), x.element_size(), device_limits(x.device).shared_bytes)

    def launch(cfg: TileConfig) -> None:
        m_tiles = triton.cdiv(meta.max_len, cfg.block_m)
        grid = (num_segs * m_tiles, triton.cdiv(r_max, cfg.block_n), cfg.split_k)
        reduce = cfg.split_k > 1 and bool(cfg.reduce)
        counts = tile_counts(x.device, grid[0] * grid[1], lane) if reduce else v   # v: a pointer never used
        a_off2, rtot2 = (a_off, rtot) if pair is None else pair          # unread without a pair
        _shrink_kernel[grid](x, w, v, a_off, rtot, meta.starts, meta.lens, counts, x.shape[1], x.stride(0),
                             v.stride(0), v.stride(1), m_tiles, a_off2, rtot2,
                             meta.ranks if pair is None else meta.pair_ranks, PAIR=pair is not None,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                             BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, REDUCE=reduce, IEEE=x.dtype == torch.float32,
                             EVEN_K=x.shape[1] % (cfg.block_k * cfg.split_k) == 0,
                             ALIGNED=aligned and x.shape[1] % 16 == 0, GDC=_pdl(x.device, pdl),
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    _launch_fitting("shrink", cfg, (x.element_size(),) * 2, x.device, launch)
    return v[:cfg.planes]


def lora_expand(y: torch.Tensor, v: torch.Tensor, w: torch.Tensor, b_off: torch.Tensor, vcol: torch.Tensor,
                widths: tuple[int, ...], meta: SegmentMeta, cfg: TileConfig, aligned: bool = False,
                max_rank: int | None = None, pdl: bool = True,
                pair: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y[rows_s, col_j:col_j+width_j] += scale_s * v[rows_s, vcol_sj:vcol_sj+r_s] @ B_sj, in place.

    Shape: y [T, sum(widths)]; v [P, T, >= max R_s] fp32 (P planes from :func:`lora_shrink`, summed here);
    b_off [S, NS] int64 (-1 = slice absent); vcol [S, NS] int32. Returns y.
    ``aligned``: the caller guarantees b_off multiples of 16 and vcol multiples of 8. ``max_rank``: an upper
    bound of the segments' ranks; a ``hoist`` config runs hoisted only when it is known and fits ``block_k``.
    ``pdl``: launched as a programmatic dependent of its shrink, where the GPU can (:func:`pdl`).
    ``pair``: (b_off2 [S, NS] int64, vcol2 [S, NS] int32, rtot [S] int32: the shrink's first R_s) of each
    segment's second adapter, present where ``meta.pair_ranks`` is positive: the same tile of y also gets
    ``+= meta.pair_scales_s * v[rows_s, R_s + vcol2_sj : + r2_s] @ B2_sj``, in the same store (``max_rank``
    then bounds both ranks).
    """
    assert v.dim() == 3 and v.stride(2) == 1, "v must be [planes, T, R] as lora_shrink returns it"
    assert y.dim() == 2 and y.stride(1) == 1 and y.shape[1] == sum(widths), "y must be [T, sum(widths)]"
    assert w.dim() == 1 and w.is_contiguous() and w.dtype == y.dtype, "w must be a flat buffer of y's dtype"
    assert b_off.dtype == torch.int64 and vcol.dtype == torch.int32 and b_off.shape == vcol.shape
    num_segs = meta.starts.shape[0]
    if num_segs == 0 or meta.max_len == 0:
        return y
    cfg = fit_shared(cfg, 4, y.element_size(), device_limits(y.device).shared_bytes)

    def launch(cfg: TileConfig) -> None:
        hoist = expand_hoisted(cfg, max_rank)
        if hoist:
            cfg = dataclasses.replace(cfg, m_loop=1)
        tiles, widths_t, cols_t = _column_tiles(tuple(widths), cfg.block_n * cfg.n_loop, str(y.device))
        m_progs = triton.cdiv(meta.max_len, cfg.block_m * cfg.m_loop)
        grid = (num_segs * m_progs, tiles.shape[0] // 2)
        gdc = _pdl(y.device, pdl)
        b_off2, vcol2, rtot1 = (b_off, vcol, meta.ranks) if pair is None else pair     # unread without a pair
        pranks, pscales = (meta.ranks, meta.scales) if pair is None else (meta.pair_ranks, meta.pair_scales)
        _expand_kernel[grid](v, w, y, b_off, vcol, tiles, widths_t, cols_t, meta.starts, meta.lens, meta.ranks,
                             meta.scales, v.stride(0), v.stride(1), y.stride(0), m_progs, b_off2, vcol2, rtot1,
                             pranks, pscales, PAIR=pair is not None, NS=len(widths),
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, M_LOOP=cfg.m_loop,
                             N_LOOP=cfg.n_loop,
                             SPLIT_V=v.shape[0], ALIGNED=aligned and all(wd % 16 == 0 for wd in widths),
                             IEEE=y.dtype == torch.float32, HOIST=hoist, STAGES=max(1, cfg.num_stages), GDC=gdc,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             **({"launch_pdl": True} if gdc else {}))

    _launch_fitting("expand", cfg, (4, y.element_size()), y.device, launch)
    return y
