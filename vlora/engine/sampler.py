"""Token sampling: greedy rows in one argmax, the others with their own params and RNG.

A request with a seed samples from its own generator, so its tokens do not depend
on what else is in the batch, nor on preemption and recompute.
"""

from __future__ import annotations

import torch

from vlora.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> list[int]:
    """logits [S, V] float32, one row per sequence -> one token id per sequence."""
    for i, seq in enumerate(seqs):
        if len(seq.output_token_ids) < seq.params.min_tokens:     # no stop allowed yet
            logits[i, list(eos_token_ids) + list(seq.params.stop_token_ids)] = float("-inf")
    out = logits.argmax(dim=-1)
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p     # keep the smallest set reaching top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    return out.tolist()
