"""Fused decoder kernels (norm + residual, RoPE + KV write, SiLU-mul) against the torch references."""

from __future__ import annotations

import pytest
import torch

from vlora.kernels.fused import add_rmsnorm_, rope_and_cache, silu_mul
from vlora.kernels.reference import rmsnorm_ref, rope_ref, silu_mul_ref
from vlora.models.decoder import RotaryEmbedding


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rmsnorm(with_residual, hidden):
    g = torch.Generator().manual_seed(hidden)
    h = torch.randn(5, hidden, generator=g)
    x = torch.randn(5, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    want_h = h + x if with_residual else h.clone()
    y = add_rmsnorm_(h, x if with_residual else None, w, 1e-5)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(y, rmsnorm_ref(want_h, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (3, 1, 48), (2, 2, 16)])
def test_rope_and_cache(hq, hkv, d):
    g = torch.Generator().manual_seed(d)
    t, page, blocks = 6, 4, 5
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    rope = RotaryEmbedding(inv, 1.0, 64)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    positions = torch.tensor([0, 5, 9, 17, 33, 63])
    slots = torch.tensor([3, 7, 8, 12, 0, 19])
    k_cache = torch.full((blocks, page, hkv, d), float("nan"))
    v_cache = torch.full((blocks, page, hkv, d), float("nan"))
    q = rope_and_cache(qkv, rope.cos, rope.sin, positions, slots, k_cache, v_cache, hq, hkv, d)
    cos, sin = rope.cos[positions], rope.sin[positions]
    qr, kr, vr = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    torch.testing.assert_close(q, rope_ref(qr.view(t, hq, d), cos, sin), rtol=1e-5, atol=1e-5)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    torch.testing.assert_close(flat_k[slots], rope_ref(kr.view(t, hkv, d), cos, sin), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat_v[slots], vr.view(t, hkv, d), rtol=0, atol=0)
    untouched = torch.ones(blocks * page, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_silu_mul():
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(7, 2 * 80, generator=g) * 3
    torch.testing.assert_close(silu_mul(gu), silu_mul_ref(gu), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_kernels(dtype):
    """Llama-2-7B widths on the GPU: rounding as the torch path's (at most one unit in the last place)."""
    dev = "cuda"
    h = torch.randn(64, 4096, device=dev).to(dtype)
    x = torch.randn(64, 4096, device=dev).to(dtype)
    w = torch.randn(4096, device=dev).to(dtype)
    want = rmsnorm_ref(h + x, w, 1e-5)
    y = add_rmsnorm_(h, x, w, 1e-5)
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2)
    gu = torch.randn(64, 2 * 11008, device=dev).to(dtype)
    torch.testing.assert_close(silu_mul(gu).float(), silu_mul_ref(gu).float(), rtol=1e-2, atol=1e-2)
    inv = 1.0 / (10000 ** (torch.arange(0, 128, 2).float() / 128))
    rope = RotaryEmbedding(inv, 1.0, 4096).to(dev)
    qkv = torch.randn(64, 3 * 4096, device=dev).to(dtype)
    pos = torch.randint(0, 4096, (64,), device=dev)
    slots = torch.randperm(256, device=dev)[:64]
    kc = torch.zeros(16, 16, 32, 128, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    q = rope_and_cache(qkv, rope.cos, rope.sin, pos, slots, kc, vc, 32, 32, 128)
    ref = rope_ref(qkv[:, :4096].view(64, 32, 128), rope.cos[pos], rope.sin[pos])
    torch.testing.assert_close(q.float(), ref.float(), rtol=1e-2, atol=1e-2)
