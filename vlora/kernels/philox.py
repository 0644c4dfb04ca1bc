"""Counter-based random numbers for sampling: Philox4x32-10, and Gumbel noise keyed by (seed, position, token).

Semantics: ``noise(seed, position, token) = -log(max(-log(u), 1e-10))`` with
``u = ((philox(key=seed, counter=(token, position mod 2**32, 0, 0))[0] >> 9) + 0.5) / 2**23``, a uniform in
[2**-24, 1 - 2**-24] (every value exact in float32, so it is never 0 or 1; the clamp keeps the noise finite
where a fast ``log`` rounds ``log(1 - 2**-24)`` to 0).

A sampled row's token is ``argmax_t(logits[t] / temperature + noise(seed, position, t))`` over the kept tokens
(the Gumbel-max trick: the argmax is distributed as softmax of the kept logits). The noise of a token depends on
nothing but the request's seed, the position of the token being sampled and the token's id, so a seeded request
draws the same tokens alone or in any batch, after preemption and recompute, on any rank, and whether the
sampler looks at the whole vocabulary or at a top-k subset of it.

This module is the torch twin (the CPU path and the oracle); ``kernels/sampling.py`` is the Triton kernel,
bit-identical on the random bits (Triton's ``tl.philox`` is the same Philox4x32 with 10 rounds).
"""

from __future__ import annotations

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57           # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85           # key bumps (Weyl sequence)
_MASK = 0xFFFFFFFF


def philox4x32(key: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor | None = None,
               c3: torch.Tensor | None = None, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox4x32 of Random123: ``key`` int64 (the low and high 32 bits are the two key words), counters uint32
    values held in int64 tensors (broadcast together); returns the four uint32 outputs as int64 tensors.

    The 64-bit products below wrap in int64; the low 64 bits of a product of two 32-bit values are the exact
    product, and masking recovers both halves."""
    zero = torch.zeros((), dtype=torch.int64, device=c0.device)
    c2 = zero if c2 is None else c2
    c3 = zero if c3 is None else c3
    k0, k1 = key & _MASK, (key >> 32) & _MASK
    for _ in range(rounds):
        p0 = c0 * _M0
        p1 = c2 * _M1
        c0, c1, c2, c3 = (((p1 >> 32) & _MASK) ^ c1 ^ k0, p1 & _MASK,
                          ((p0 >> 32) & _MASK) ^ c3 ^ k1, p0 & _MASK)
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """uint32 bits (int64 tensor) -> float32 uniforms in (0, 1): the top 23 bits, centred in their interval (exact
    in float32: below 2**23 the halves are representable, so the Triton kernel gets the same values and none
    rounds to 1)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / 2 ** 23)


def noise(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of uniforms ``u`` (finite: see the module's docstring)."""
    return -torch.log(torch.clamp_min(-torch.log(u), EXP_MIN))


EXP_MIN = 1e-10


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [R, K] for ``token_ids`` [R, K] (or [K], shared by the rows) of rows of ``seeds`` [R] and
    ``positions`` [R] (int64)."""
    ids = token_ids.to(torch.int64)
    bits = philox4x32(seeds.to(torch.int64)[:, None], ids if ids.dim() == 2 else ids[None, :],
                      positions.to(torch.int64)[:, None] & _MASK)[0]
    return noise(uniform(bits))


def gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: ``out[r] = ids[r, argmax_k(x[r, k] + noise(seeds[r], positions[r], ids[r, k]))]``.

    Shapes: ``x`` [R, K] float32 (-inf: not kept); ``seeds``, ``positions`` [R] int64; ``token_ids`` [R, K]
    int64, the vocabulary id of each column (None: column k is token k). Returns [R] int64."""
    ids = torch.arange(x.shape[1], device=x.device) if token_ids is None else token_ids
    k = (x + gumbel(seeds, positions, ids)).argmax(dim=-1)
    return k if token_ids is None else token_ids.gather(1, k[:, None])[:, 0]
