"""Skinny decode GEMM against an fp64 reference: ragged N and K, 1-4 rows, bias, every output written."""

from __future__ import annotations

import pytest
import torch

from vlora.kernels.gemv import MAX_M, gemv, gemv_config, linear


def _check(m, n, k, bias, dtype=torch.float32, config=None):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = gemv(x, w, b, config)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * k ** 0.5)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(37, 100), (64, 256), (5, 2048)])
def test_gemv_matches_reference(m, n, k):
    _check(m, n, k, bias=False)


@pytest.mark.parametrize("config", [(4, 64, 4), (16, 32, 2), (1, 128, 1)])
def test_gemv_bias_and_configs(config):
    _check(3, 50, 200, bias=True, config=config)


def test_gemv_bf16():
    _check(2, 48, 512, bias=True, dtype=torch.bfloat16)


def test_gemv_strided_rows_and_errors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 96, generator=g)
    x = base[:, :64]                       # rows strided, columns contiguous
    w = torch.randn(24, 64, generator=g)
    torch.testing.assert_close(gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.randn(MAX_M + 1, 64), w)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.randn(1, 63), w)


def test_config_fits_budget_and_linear_falls_back_on_cpu():
    for m in range(1, MAX_M + 1):
        bn, bk, _ = gemv_config(m, 4096, 11008)
        assert bn >= 1 and bk <= 1024 and bn * bk * m <= 8192 * 2
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    torch.testing.assert_close(linear(x, w), x @ w.T)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008), (1000, 4000), (32000, 4096)])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_gemv_gpu_bf16(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    y = linear(x, w, b)
    want = x.double() @ w.double().T + b.double()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
