"""Torch references for every kernel. They are the test oracle and the CPU path.

Each function states its semantics in one line and the shape of each argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlora.lora.batch import LoRABatch


def lora_add_(y: torch.Tensor, x: torch.Tensor, lora: LoRABatch, layer: int, group: str) -> None:
    """Batched LoRA delta, in place, for one layer and one packed projection group.

    Semantics: for each segment (rows [s, e), adapter i) and each slice j of the group:
        y[s:e, cols_j] += scale_s * (x[s:e] @ A_ij) @ B_ij   (scale_s: the segment's, usually s_i)
    Shape: x [T, in], y [T, out_packed]; A_ij [in, r_i]; B_ij [r_i, out_j].
    Tokens are grouped by adapter; each adapter runs at its own rank (no padding).
    """
    for seg in lora.segments:
        gw = seg.adapter.layers[layer].get(group)
        if gw is None:
            continue
        r = seg.adapter.rank
        v = x[seg.start:seg.end] @ gw.a                       # shrink: [n, r * slices]
        rows = y[seg.start:seg.end]
        for sl in gw.slices:                                  # expand, scaling fused via alpha
            out = rows[:, sl.col_start:sl.col_start + sl.b.shape[1]]
            out.addmm_(v[:, sl.rank_start:sl.rank_start + r], sl.b, alpha=seg.scale)


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
