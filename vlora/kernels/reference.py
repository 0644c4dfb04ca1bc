"""Torch references for every kernel. They are the test oracle and the CPU path.

Each function states its semantics in one line and the shape of each argument.
The batched LoRA op on a whole ``LoRABatch`` (the CPU path of ``lora_linear``)
has its reference in the LoRA package, ``vlora/lora/layers.py``
(``lora_add_``): the kernels import nothing from ``vlora.lora``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence attends to its cached context through its block table.

    Semantics: out[b] = softmax(q[b] · K_b^T * scale, masked) · V_b, K_b = the blocks block_tables[b].
    Shape: q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
    block_tables [B, nb] long; mask [B, 1, 1, nb * block_size] bool (True = attend).
    Returns [B, H, D].
    """
    bsz, nb = block_tables.shape
    _, block_size, hkv, d = k_cache.shape
    flat = block_tables.flatten()                  # index_select: ~2x faster than fancy indexing on CPU
    k = k_cache.index_select(0, flat).view(bsz, nb * block_size, hkv, d).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(bsz, nb * block_size, hkv, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != hkv)
    return out.squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """New tokens of one sequence attend causally to its cached prefix and themselves.

    Semantics: out = softmax(q · k^T * scale + causal/offset mask) · v.
    Shape: q [n, H, D]; k, v [L, Hkv, D] with L >= n (the last n rows are the new tokens);
    mask [n, L] bool (True = attend) or None for plain causal (L == n). Returns [n, H, D].
    """
    # 4-D inputs take torch's fused CPU kernel (3-D ones fall back to the math path)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Semantics: the first ``length`` tokens stored in the blocks of ``block_table``.

    Shape: cache [num_blocks, block_size, Hkv, D]; block_table [nb] long. Returns [length, Hkv, D].
    """
    return cache.index_select(0, block_table).flatten(0, 1)[:length]


def lora_shrink_ref(x: torch.Tensor, w: torch.Tensor, a_off: list[int], rtot: list[int], starts: list[int],
                    lens: list[int], r_max: int) -> torch.Tensor:
    """Oracle of ``atmm.lora_shrink`` (same flat-buffer layout); computed in float64.

    Semantics: v[rows_s, :R_s] = x[rows_s] @ w[a_off_s : a_off_s + R_s*K].view(R_s, K)^T.
    """
    t, k = x.shape
    v = torch.zeros(t, max(r_max, 1), dtype=torch.float64, device=x.device)
    for off, r, s, n in zip(a_off, rtot, starts, lens):
        a = w[off:off + r * k].view(r, k).double()
        v[s:s + n, :r] = x[s:s + n].double() @ a.T
    return v


def lora_expand_ref(y: torch.Tensor, v: torch.Tensor, w: torch.Tensor, b_off: list[list[int]],
                    vcol: list[list[int]], widths: tuple[int, ...], starts: list[int], lens: list[int],
                    ranks: list[int], scales: list[float]) -> torch.Tensor:
    """Oracle of ``atmm.lora_expand``; returns a float64 copy of y with the deltas added.

    Semantics: y[rows_s, col_j:col_j+width_j] += scale_s * v[rows_s, vcol_sj:vcol_sj+r_s] @ B_sj.
    """
    out = y.double().clone()
    cols = [sum(widths[:j]) for j in range(len(widths))]
    for s, n, r, sc, offs, vcs in zip(starts, lens, ranks, scales, b_off, vcol):
        for j, (off, vc) in enumerate(zip(offs, vcs)):
            if off < 0:
                continue
            b = w[off:off + r * widths[j]].view(r, widths[j]).double()
            out[s:s + n, cols[j]:cols[j] + widths[j]] += sc * (v[s:s + n, vc:vc + r].double() @ b)
    return out


def _attend_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q [n, H, D], k/v [L, Hkv, D], allowed [n, L] -> [n, H, D] float64 (GQA by head repetition)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v)


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Oracle of ``attention.paged_decode``, float64; rows with lens 0 are zeros.

    Semantics: out[b] = softmax(scale * q[b] . K_b^T) V_b over tokens [max(0, len_b - window), len_b).
    """
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        k = gather_blocks(k_cache, tables[b].long(), n)
        v = gather_blocks(v_cache, tables[b].long(), n)
        allowed = torch.ones(1, n, dtype=torch.bool, device=q.device)
        if window:
            allowed[:, :max(0, n - window)] = False
        out[b] = _attend_fp64(q[b:b + 1], k, v, allowed, scale)[0]
    return out


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                      window: int = 0) -> torch.Tensor:
    """Oracle of ``attention.paged_prefill``, float64; rows of no chunk are zeros.

    Semantics: chunk c's query i (position p = ctx_c - n_c + i) attends to keys at positions
    (p - window, p] of its block table (all positions <= p without a window).
    """
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for c, (s, n, ctx) in enumerate(zip(starts.tolist(), q_lens.tolist(), ctx_lens.tolist())):
        if n == 0:
            continue
        k = gather_blocks(k_cache, tables[c].long(), ctx)
        v = gather_blocks(v_cache, tables[c].long(), ctx)
        qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        kpos = torch.arange(ctx, device=q.device).unsqueeze(0)
        allowed = kpos <= qpos
        if window:
            allowed &= kpos > qpos - window
        out[s:s + n] = _attend_fp64(q[s:s + n], k, v, allowed, scale)
    return out


def rmsnorm_ref(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: weight * round(h / sqrt(mean(h^2) + eps)) (statistics in fp32, as the decoder's RMSNorm)."""
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32, rounded once. x [T, heads, D]; cos, sin [T, D] (rows of the tables)."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.float().unsqueeze(1) + rotated * sin.float().unsqueeze(1)).to(x.dtype)


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """Semantics: silu(gate) * up over the packed [T, 2I] gate_up output, silu rounded as torch rounds it."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up
