"""Paged attention in Triton: decode (one query per sequence) and prefill over a cached prefix.

KV lives in pages: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]`` views (a block's
tokens dense, blocks at any stride: one layer's slice of the unified pool's pages)
and a sequence's token ``p`` sits in block ``table[p // block_size]`` at offset
``p % block_size``. Both kernels read keys and values only through the block
table, so a prefill chunk attends to its cached prefix and to its own tokens
(written to the cache before the call) the same way. GQA: query head ``h`` reads
KV head ``h // (Hq // Hkv)``. ``window`` > 0 keeps only the last ``window``
keys up to each query (Mistral's sliding window). Softmax is online, in fp32.

Every launch has a grid fixed by host ints that do not depend on the data
(batch rows, heads, the longest chunk), so decode launches can be captured in a
CUDA graph and replayed with new tables and lengths. References:
``reference.paged_decode_ref`` and ``reference.paged_prefill_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlora.kernels import compiles
from vlora.kernels.limits import device_limits


@compiles.jit(ints=("stride_tb",))       # stride_tb: the batch's longest block table
def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, lens_ptr, part_ptr, scale, window,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_blk, stride_slot, stride_kh, stride_tb,
                   GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D: tl.constexpr, SPLIT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    kvh = h // GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < D
    q = tl.load(q_ptr + b * stride_qt + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32) * scale
    lo = tl.maximum(ctx - window, 0)             # window: huge when there is none
    hi = ctx
    if SPLIT:       # this sequence's own span cut in equal parts, so every part has work at any length
        part_len = tl.cdiv(tl.cdiv(hi - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = lo + part * part_len
        hi = tl.minimum(hi, lo + part_len)
    m_i = -1.0e30
    l_i = 0.0
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        pos = n0 + offs
        n_mask = (pos < hi) & (pos >= lo)
        blk = tl.load(tables_ptr + b * stride_tb + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        kv_row = blk * stride_blk + (pos % PAGE) * stride_slot
        kv_off = kv_row[:, None] + kvh * stride_kh + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)
        s = tl.where(n_mask, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(n_mask, tl.exp(s - m_new), 0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    if SPLIT:       # partial result of this part of the context: (max, sum, unnormalised acc) for the reduce
        nparts = tl.num_programs(2)
        base = (b * tl.num_programs(1) + h) * nparts + part
        tl.store(part_ptr + base * (HEAD_DIM + 2) + offs_d, acc)
        tl.store(part_ptr + base * (HEAD_DIM + 2) + HEAD_DIM, m_i)
        tl.store(part_ptr + base * (HEAD_DIM + 2) + HEAD_DIM + 1, l_i)
    else:
        out = tl.where(l_i > 0, acc / tl.maximum(l_i, 1.0e-30), 0.0)     # ctx == 0: padded row, zeros
        tl.store(o_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


@compiles.jit(ints=("nparts",))      # the part count follows the batch: one variant per power of two
def _decode_reduce_kernel(part_ptr, o_ptr, stride_ot, stride_oh, nparts, PARTS_P: tl.constexpr,
                          HEAD_DIM: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, PARTS_P)
    p_mask = offs_p < nparts
    offs_d = tl.arange(0, HEAD_DIM)
    base = ((b * tl.num_programs(1) + h) * nparts + offs_p) * (HEAD_DIM + 2)
    m = tl.load(part_ptr + base + HEAD_DIM, mask=p_mask, other=-1.0e30)
    l = tl.load(part_ptr + base + HEAD_DIM + 1, mask=p_mask, other=0.0)
    acc = tl.load(part_ptr + base[:, None] + offs_d[None, :], mask=p_mask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp(m - m_all), 0.0)
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0)
    out = tl.where(total > 0, out / tl.maximum(total, 1.0e-30), 0.0)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=offs_d < D)


@compiles.jit(ints=("stride_tb",))
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, starts_ptr, qlens_ptr, ctx_ptr, scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_blk, stride_slot, stride_kh, stride_tb,
                    GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_len = tl.load(qlens_ptr + c)
    m0 = mt * BLOCK_M
    if m0 < q_len:
        q_start = tl.load(starts_ptr + c)
        ctx = tl.load(ctx_ptr + c)
        prefix = ctx - q_len
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        qpos = prefix + offs_m
        offs_d = tl.arange(0, HEAD_DIM)
        d_mask = offs_d < D
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        hi = tl.minimum(ctx, prefix + m0 + BLOCK_M)            # causal: no key after the tile's last query
        lo = tl.maximum(prefix + m0 - window + 1, 0)
        m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        offs = tl.arange(0, BLOCK_N)
        for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            pos = n0 + offs
            n_mask = pos < hi
            blk = tl.load(tables_ptr + c * stride_tb + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
            kv_row = blk * stride_blk + (pos % PAGE) * stride_slot
            kv_off = kv_row[:, None] + kvh * stride_kh + offs_d[None, :]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            allowed = (pos[None, :] <= qpos[:, None]) & (pos[None, :] > qpos[:, None] - window) & n_mask[None, :]
            s = tl.where(allowed, s * scale, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(allowed, tl.exp(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & d_mask[None, :])


def _window(window: int | None) -> int:
    return window if window and window > 0 else 1 << 30


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    assert q.dim() == 3 and q.stride(2) == 1 and out.shape == q.shape and out.stride(2) == 1
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[-1] == q.shape[-1]
    for c in (k_cache, v_cache):        # a block's tokens dense; blocks anywhere (pages of the unified pool)
        d = c.shape[3]
        assert c.stride(3) == 1 and c.stride(2) == d and c.stride(1) == c.shape[2] * d and c.stride() == k_cache.stride()
    assert q.shape[1] % k_cache.shape[2] == 0, "query heads must be a multiple of KV heads"


def decode_parts(batch: int, heads: int, max_ctx: int, block_n: int, target_programs: int = 512) -> int:
    """How many parts each sequence's context is split into so that a small batch still fills the GPU: enough
    programs for the GPU, no more parts than ``max_ctx`` has key blocks. Each program cuts its own sequence's
    length in that many parts, so a graph captured for ``max_model_len`` splits a short context as finely as
    an eager call would."""
    return max(1, min(-(-target_programs // max(1, batch * heads)), -(-max_ctx // block_n)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, window: int = 0, out: torch.Tensor | None = None,
                 max_ctx: int | None = None, block_n: int = 64, num_warps: int = 4,
                 parts: int | None = None) -> torch.Tensor:
    """out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b over the first ``lens[b]`` tokens of ``tables[b]``.

    Shape: q [B, Hq, D]; caches [num_blocks, page, Hkv, D]; tables [B, nb] int32; lens [B] int32
    (0: padded row, output zeros). ``max_ctx`` (host int, >= every length; default: the table's capacity)
    decides how many parts each context is split into when B * Hq programs would leave the GPU idle
    (flash-decoding: partial softmax per part, then a reduce). Returns out [B, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, out)
    bsz, heads = q.shape[0], q.shape[1]
    if bsz == 0:
        return out
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    head_dim = triton.next_power_of_2(d)
    max_ctx = max(1, max_ctx or tables.shape[1] * page)
    if parts is None:
        parts = decode_parts(bsz, heads, max_ctx, block_n)
    split = parts > 1
    partial = torch.empty(bsz * heads * parts * (head_dim + 2) if split else 1, dtype=torch.float32,
                          device=q.device)
    _decode_kernel[(bsz, heads, parts)](
        q, k_cache, v_cache, out, tables, lens, partial, scale, _window(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), hkv * d, d, tables.stride(0),
        GROUP=heads // hkv, PAGE=page, BLOCK_N=block_n, HEAD_DIM=head_dim, D=d, SPLIT=split,
        num_warps=num_warps)
    if split:
        _decode_reduce_kernel[(bsz, heads)](partial, out, out.stride(0), out.stride(1), parts,
                                            PARTS_P=triton.next_power_of_2(parts), HEAD_DIM=head_dim, D=d,
                                            num_warps=4)
    return out


PREFILL_STAGES = 2


def prefill_shared(bm: int, bn: int, head_dim: int, elem: int) -> int:
    """Estimated shared memory (bytes) of the prefill kernel: the Q tile, the pipelined K and V tiles, and the
    probabilities' tile P converted for P @ V."""
    return bm * head_dim * elem + PREFILL_STAGES * 2 * bn * head_dim * elem + bm * bn * elem


def prefill_tiles(head_dim: int, elem: int, shared_bytes: int, block_m: int | None = None,
                  block_n: int | None = None) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the prefill kernel: the given or default tiles, the key tile (then the query tile)
    halved until they fit the device's shared memory."""
    bm = block_m or (64 if head_dim <= 128 else 32)
    bn = block_n or (64 if head_dim <= 64 else 32)
    while prefill_shared(bm, bn, head_dim, elem) > shared_bytes and max(bm, bn) > 16:
        if bn > 16:
            bn //= 2
        else:
            bm //= 2
    return bm, bn


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor, max_q_len: int,
                  scale: float, window: int = 0, out: torch.Tensor | None = None,
                  block_m: int | None = None, block_n: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Causal attention of each chunk's new tokens over its cached prefix and themselves.

    Chunk ``c`` owns rows ``[starts[c], starts[c] + q_lens[c])`` of q/out; its queries sit at positions
    ``ctx_lens[c] - q_lens[c] + i`` and see keys at positions ``<=`` their own from ``tables[c]``
    (the chunk's own K/V already written there). Rows of no chunk are left as they are in ``out``.
    Shape: q [T, Hq, D]; tables [C, nb] int32; starts, q_lens, ctx_lens [C] int32; max_q_len host int.
    """
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, out)
    if starts.shape[0] == 0 or max_q_len == 0:
        return out
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    head_dim = triton.next_power_of_2(d)
    bm, bn = prefill_tiles(head_dim, q.element_size(), device_limits(q.device).shared_bytes, block_m, block_n)
    grid = (starts.shape[0], q.shape[1], triton.cdiv(max_q_len, bm))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, tables, starts, q_lens, ctx_lens, scale, _window(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), hkv * d, d, tables.stride(0),
        GROUP=q.shape[1] // hkv, PAGE=page, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=head_dim, D=d,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=PREFILL_STAGES)
    return out
