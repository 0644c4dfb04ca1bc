"""Gumbel-max sampling of a batch in one Triton launch, with counter-based noise per (seed, position, token).

Semantics (``kernels/philox.py`` is the torch twin and the oracle)::

    out[r] = ids[r, argmax_k(x[r, k] + noise(seeds[r], positions[r], ids[r, k]))]

Shapes: ``x`` [R, K] float32 (a row's scaled, filtered logits; -inf where a token is not kept); ``ids`` [R, K]
int64, the vocabulary id of each column (None: column k is token k); ``seeds``, ``positions`` [R] int64.

The noise is generated in registers and never stored. The columns are split into blocks, one program per (row,
block) so a batch of a few rows still fills the GPU; each program writes its block's best value and token, and one
argmax over the blocks picks the row's token. Ties go to the lowest column, as ``torch.argmax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlora.kernels.compiles import jit

BLOCK = 2048


# the sizes follow the batch (top-k, vocabulary): unspecialised, two variants in all (with and without ids)
@jit(ints=("K", "stride_x", "stride_ids", "num_blocks"), pointers=("x_ptr", "ids_ptr", "seed_ptr", "pos_ptr"))
def _gumbel_argmax_kernel(x_ptr, ids_ptr, seed_ptr, pos_ptr, val_ptr, tok_ptr, K, stride_x, stride_ids, num_blocks,
                          HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=float("-inf"))
    if HAS_IDS:
        tid = tl.load(ids_ptr + row.to(tl.int64) * stride_ids + offs, mask=mask, other=0)
    else:
        tid = offs
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row).to(tl.uint32)
    c0 = tid.to(tl.uint32)
    zero = tl.zeros_like(c0)
    bits, _, _, _ = tl.philox(seed, c0, zero + pos, zero, zero)
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    y = x - tl.log(tl.maximum(-tl.log(u), 1e-10))
    best = tl.max(y, 0)
    k = tl.min(tl.where(y == best, offs, K), 0)       # the first column holding the block's best
    k = tl.minimum(k, K - 1)                          # a block of NaN / -inf only: any column (the row fails)
    if HAS_IDS:
        tok = tl.load(ids_ptr + row.to(tl.int64) * stride_ids + k)
    else:
        tok = k
    tl.store(val_ptr + row * num_blocks + blk, best)
    tl.store(tok_ptr + row * num_blocks + blk, tok.to(tl.int64))


def gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One sampled token per row [R] int64 (see the module's docstring)."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1, "x: [R, K] float32, rows contiguous"
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64, "seeds and positions: int64"
    R, K = x.shape
    assert seeds.shape == (R,) and positions.shape == (R,), "one seed and one position per row"
    if token_ids is not None:
        assert token_ids.shape == x.shape and token_ids.dtype == torch.int64 and token_ids.stride(1) == 1, \
            "token_ids: [R, K] int64 like x"
    nb = triton.cdiv(K, BLOCK)
    vals = torch.empty(R, nb, dtype=torch.float32, device=x.device)
    toks = torch.empty(R, nb, dtype=torch.int64, device=x.device)
    if R == 0:
        return toks[:, 0]
    ids = x if token_ids is None else token_ids
    _gumbel_argmax_kernel[(R, nb)](x, ids, seeds, positions, vals, toks, K, x.stride(0), ids.stride(0), nb,
                                   HAS_IDS=token_ids is not None, BLOCK=BLOCK, num_warps=8)
    if nb == 1:
        return toks[:, 0]
    return toks.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0]


def build_variants(device: torch.device) -> int:
    """Launch both variants once (start-up, before the first request); returns the launches."""
    x = torch.zeros(2, 3, dtype=torch.float32, device=device)
    z = torch.zeros(2, dtype=torch.int64, device=device)
    gumbel_argmax(x, z, z)
    gumbel_argmax(x, z, z, torch.zeros(2, 3, dtype=torch.int64, device=device))
    return 2
