"""Token sampling: greedy rows in one argmax, the others with their own params and RNG.

A request with a seed samples from its own generator, so its tokens do not depend
on what else is in the batch, nor on preemption and recompute.

A row that cannot be sampled (stop ids outside the vocabulary, probabilities
that are not finite, e.g. from a temperature too small to divide by) gets a
:class:`~vlora.engine.faults.RequestFailed` in place of its token; the other
rows are untouched. Such a row's probabilities are replaced before
``torch.multinomial`` sees them (on a GPU it would hit a device-side assert,
which ends the whole process), and the check costs no sync per row: the flags
come back with the tokens in one copy.

:func:`sample_async` queues the sampling and the copy of its tokens to host
memory and returns at once (:class:`Sampled`); the engine reads them once the
next iteration is queued behind them.
"""

from __future__ import annotations

import torch

from vlora.engine.faults import RequestFailed, describe, is_fatal
from vlora.engine.sequence import Sequence


class Sampled:
    """Sampled tokens on their way to the host: ``tokens`` [S] on the device; :meth:`result` waits for them."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, host: torch.Tensor | None,
                 checks: list[tuple[int, torch.Tensor]], errors: dict[int, RequestFailed]):
        self.seqs, self.tokens, self._checks, self._errors = seqs, tokens, checks, errors
        # the tokens, then the sampled rows' validity flags: one copy, one wait
        payload = tokens if not checks else torch.cat([tokens, torch.stack([c for _, c in checks]).long()])
        self._host = payload
        self._event = None
        if host is not None:              # page-locked: the copy is queued, nothing waits
            self._host = host[:payload.shape[0]]
            self._host.copy_(payload, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> list[int | RequestFailed]:
        """One token id per sequence (or why it could not be had)."""
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        n, errors, seqs = len(self.seqs), self._errors, self.seqs
        tokens = values[:n] if self._checks else values
        if self._checks:
            for (i, _), ok in zip(self._checks, values[n:]):
                if not ok:
                    errors[i] = RequestFailed(f"sampling failed: the next-token probabilities are not finite at "
                                              f"temperature {seqs[i].params.temperature!r}")
        return [errors.get(i, t) for i, t in enumerate(tokens)] if errors else tokens


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> list[int | RequestFailed]:
    """logits [S, V] float32, one row per sequence -> one token id per sequence (or why it could not be had)."""
    return sample_async(logits, seqs, eos_token_ids).result()


def sample_async(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...],
                 host: torch.Tensor | None = None) -> Sampled:
    """Queue the sampling of ``logits`` [S, V] (one row per sequence); ``host``: a page-locked buffer of at
    least 2 S int64 the result is copied into without a wait (None: :meth:`Sampled.result` copies)."""
    vocab = logits.shape[-1]
    errors: dict[int, RequestFailed] = {}
    for i, seq in enumerate(seqs):
        if seq.params.min_tokens and len(seq.output_token_ids) < seq.params.min_tokens:     # no stop allowed yet
            banned = list(eos_token_ids) + list(seq.params.stop_token_ids)
            if any(not 0 <= t < vocab for t in banned):
                errors[i] = RequestFailed(f"sampling failed: stop_token_ids hold ids outside the vocabulary "
                                          f"[0, {vocab})")
                continue
            logits[i, banned] = float("-inf")
    out = logits.argmax(dim=-1)
    checks: list[tuple[int, torch.Tensor]] = []       # (row, whether its probabilities were valid)
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy or i in errors:
            continue
        try:
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
            ok = torch.isfinite(probs).all() & (probs >= 0).all() & (probs.sum() > 0)
            probs = torch.where(ok, probs, torch.ones_like(probs))   # a placeholder draw, discarded below
            out[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
            checks.append((i, ok))
        except Exception as e:
            if is_fatal(e):
                raise
            errors[i] = RequestFailed(f"sampling failed: {describe(e)}")
    return Sampled(seqs, out, host, checks, errors)
