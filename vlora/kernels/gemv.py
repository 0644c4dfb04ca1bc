"""Skinny GEMM for decode at small batch: ``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` with ``M <= 4``, in Triton.

A decode step at batch 1-4 is a stream of the weights through the SMs; the
product itself is negligible. cuBLAS picks tensor-core tiles at least 8 rows
high and, for the narrow projections, split-K with a second reduce launch.
This kernel has no tensor-core padding, no split-K and no second launch: each
program owns ``BLOCK_N`` output columns, walks K in long contiguous ``BLOCK_K``
strips, keeps an elementwise fp32 partial product per (row, column, lane) and
reduces it once at the end.

It beats cuBLAS on the wide projections (gate_up, LM head) at M = 1 and 2, is
slower at M = 4, and is no faster on the narrow projections (qkv, o, down) at
any M; over a whole decode step at batch 1 it still saves time. :func:`linear`
therefore uses it for M <= ``DISPATCH_M`` only (docs/decisions.md, 'Skinny
GEMM up to two rows').

Rounding: fp32 accumulation, one rounding to the output dtype (like cuBLAS; the
summation order differs, so results agree to the dtype's precision, not bitwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 4
DISPATCH_M = 2          # linear(): rows up to which the kernel beats cuBLAS (see above)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            w = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): ~8K fp32 partials per program (64 per thread at 4 warps), at
    least ~4 programs per SM on the narrowest projections. ``benchmarks/bench_gemv.py`` measures the grid."""
    m_pad = triton.next_power_of_2(max(1, m))
    block_k = min(1024, triton.next_power_of_2(k))
    block_n = max(1, 8192 // (m_pad * block_k))
    return block_n, block_k, 4


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x`` [M <= 4, K] (rows contiguous), ``w`` [N, K] with unit column stride."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_M or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"gemv takes x [M<={MAX_M}, K] and w [N, K] with unit inner strides, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n, block_k, warps = config or gemv_config(m, n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0, num_warps=warps)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's projection on the fused path: the skinny kernel for decode at batch <= ``DISPATCH_M`` on
    a GPU, cuBLAS otherwise."""
    if x.is_cuda and x.shape[0] <= DISPATCH_M and x.dim() == 2 and x.stride(1) == 1 and w.stride(1) == 1:
        return gemv(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)
