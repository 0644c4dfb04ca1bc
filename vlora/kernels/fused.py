"""Fused elementwise kernels of the decoder's hot path, in Triton.

At small batch a decode step is bound by reading the weights; the ~35 small
torch ops per layer around the GEMMs (norm, RoPE, KV write, SiLU, residual
adds) are each a launch of their own. These kernels make them four per layer:

* ``add_rmsnorm_``: ``h += x`` (the residual stream, in place), then
  ``RMSNorm(h) * w``; with ``x=None`` only the norm.
* ``rope_and_cache``: rotate q and k of a packed qkv row (rotate-half RoPE from
  the cos/sin tables), write rotated k and v into their KV-cache slots, return q.
* ``silu_mul``: ``silu(gate) * up`` from the packed gate_up output.

Rounding follows the torch reference path (``reference.rmsnorm_ref`` etc.):
statistics and rotations in fp32, each result rounded once to the data dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(h_ptr, x_ptr, w_ptr, y_ptr, n, eps, stride_h, stride_x, stride_y,
                        HAS_X: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
    if HAS_X:
        h = (h.to(tl.float32) + tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32))
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n + eps)
    normed = (hf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm_(h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += x`` in place (skipped when x is None), returns ``RMSNorm(h) * weight``. h, x [T, H]."""
    assert h.dim() == 2 and h.stride(1) == 1 and (x is None or (x.shape == h.shape and x.stride(1) == 1))
    y = torch.empty_like(h)
    if h.shape[0] == 0:
        return y
    n = h.shape[1]
    block = triton.next_power_of_2(n)
    _add_rmsnorm_kernel[(h.shape[0],)](h, h if x is None else x, weight, y, n, eps, h.stride(0),
                                       h.stride(0) if x is None else x.stride(0), y.stride(0),
                                       HAS_X=x is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return y


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                       stride_qkv, stride_cs, stride_q, stride_blk, stride_slot,
                       PAGE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    kv_row = (slot // PAGE) * stride_blk + (slot % PAGE) * stride_slot
    offs_d = tl.arange(0, HALF)
    d_mask = offs_d < D // 2
    cos = tl.load(cos_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, HQ + HKV, BLOCK_H):            # q heads, then k heads: both rotated
        heads = h0 + offs_h
        hm = heads < HQ + HKV
        m = hm[:, None] & d_mask[None, :]
        base = heads[:, None] * D + offs_d[None, :]
        x1 = tl.load(row + base, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row + base + D // 2, mask=m, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        is_q = heads < HQ
        qo = t * stride_q + heads[:, None] * D + offs_d[None, :]
        tl.store(q_ptr + qo, o1.to(q_ptr.dtype.element_ty), mask=m & is_q[:, None])
        tl.store(q_ptr + qo + D // 2, o2.to(q_ptr.dtype.element_ty), mask=m & is_q[:, None])
        ko = kv_row + (heads[:, None] - HQ) * D + offs_d[None, :]
        km = m & (heads >= HQ)[:, None]
        tl.store(k_ptr + ko, o1.to(k_ptr.dtype.element_ty), mask=km)
        tl.store(k_ptr + ko + D // 2, o2.to(k_ptr.dtype.element_ty), mask=km)
    for h0 in range(0, HKV, BLOCK_H):                 # v heads: copied to the cache as they are
        heads = h0 + offs_h
        m = (heads < HKV)[:, None] & d_mask[None, :]
        src = row + (HQ + HKV) * D + heads[:, None] * D + offs_d[None, :]
        dst = v_ptr + kv_row + heads[:, None] * D + offs_d[None, :]
        tl.store(dst, tl.load(src, mask=m, other=0.0), mask=m)
        tl.store(dst + D // 2, tl.load(src + D // 2, mask=m, other=0.0), mask=m)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rotated q [T, Hq, D]; rotated k and v written to ``k_cache/v_cache`` (flat slot ``slots[t]``).

    Shape: qkv [T, (Hq + 2 Hkv) D] (packed projection output); cos, sin [max_len, D] fp32 tables;
    positions, slots [T] long (slot = block * page + offset); caches [num_blocks, page, Hkv, D], blocks at any
    stride.
    """
    if positions.dim() != 1:
        raise ValueError(f"rope_and_cache takes one position per token ([T]), got {list(positions.shape)}; for "
                         f"M-RoPE pass the tokens' gathered cos/sin rows with positions arange(T)")
    assert qkv.stride(1) == 1 and head_dim % 2 == 0 and k_cache.stride() == v_cache.stride()
    assert cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim and k_cache.stride(1) == num_kv_heads * head_dim
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    half = triton.next_power_of_2(head_dim // 2)
    block_h = max(1, min(triton.next_power_of_2(num_heads + num_kv_heads), 4096 // half))
    _rope_cache_kernel[(t,)](qkv, cos, sin, positions, slots, q, k_cache, v_cache, qkv.stride(0), cos.stride(0),
                             q.stride(0), k_cache.stride(0), num_kv_heads * head_dim, PAGE=k_cache.shape[1],
                             HQ=num_heads, HKV=num_kv_heads, D=head_dim,
                             HALF=half, BLOCK_H=block_h, num_warps=4)
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n + offs, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)          # silu, rounded as torch does
    tl.store(out_ptr + row * stride_out + offs, (act.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gu[:, :I]) * gu[:, I:]`` for the packed gate_up output gu [T, 2I]; returns [T, I]."""
    assert gu.dim() == 2 and gu.stride(1) == 1 and gu.shape[1] % 2 == 0
    n = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], n, dtype=gu.dtype, device=gu.device)
    if gu.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, out, n, gu.stride(0), out.stride(0), BLOCK=block,
                                                          num_warps=4)
    return out
