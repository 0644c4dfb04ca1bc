"""Batched sampling: every row of a batch in the same few launches, whatever its parameters.

One pass over the batch's logits ``[S, V]`` (float32, one row per sequence):

1. ``logit_bias`` added, the end-of-sequence and stop ids of rows below ``min_tokens`` set to -inf (one
   indexed write each for the batch), and, for rows with structured output, every token their grammar forbids
   set to -inf (one masked write from the batch's packed bitmask, :mod:`vlora.engine.guided`);
2. penalties from the per-sequence token counts on the device (``token_counts.py``): repetition (logits of
   prompt and generated tokens divided by it when positive, multiplied when negative), then frequency
   (times the count) and presence (once) over generated tokens;
3. greedy rows: the argmax; sampled rows: the logits divided by the temperature, then top-k, top-p inside
   the (renormalised) top-k set, and min-p (relative to the most likely token) as -inf writes on the sorted
   candidates, and one Gumbel-max draw (``kernels/sampling.py``: Philox noise in registers; on the CPU,
   :func:`cpu_noise`) with noise keyed by (the request's seed, the token's position, the token id). When every
   sampled row has a top-k, the candidates are ``torch.topk``'s; otherwise the sorted vocabulary;
4. for the rows that asked for logprobs, the model's own log-probabilities (of the logits before step 1) at the
   chosen token and the top ones: logit - logsumexp, without the full log-softmax.

The per-row parameters are device tensors built once per batch composition (:class:`SamplingBatch`); each
step sends only the rows' positions (and the rows still below ``min_tokens`` when that changes). No launch is
per row: the host's per-step work is reading the rows' lengths and, after the copy, their results.

A row that cannot be sampled (its kept logits are all -inf or not finite, e.g. NaN logits, or stop ids
outside the vocabulary under ``min_tokens``) gets a :class:`~vlora.engine.faults.RowFailed` in place of its
token; the other rows are untouched. The flags come back with the tokens in one copy.

:meth:`Sampler.sample` queues the whole pass and the copy of its results to page-locked memory and returns at
once (:class:`Sampled`); the engine reads them once the next iteration is queued behind them.
"""

from __future__ import annotations

import torch

from vlora.engine import guided
from vlora.engine.faults import RowFailed
from vlora.engine.sequence import Sequence, TokenLogprobs
from vlora.engine.token_counts import TokenCounts
from vlora.kernels import philox

TOPK_CANDIDATES_MAX = 1024
"""Largest top-k served from ``torch.topk`` candidates; a batch with a larger one (or a sampled row without
top-k that truncates by top-p or min-p) sorts the vocabulary."""


class SamplingBatch:
    """The per-row parameters of one batch composition as device tensors (shapes: [S] unless noted)."""

    def __init__(self, seqs: list[Sequence], vocab: int, eos_token_ids: tuple[int, ...], device: torch.device,
                 counts: TokenCounts | None):
        self.seqs = seqs
        ps = [s.params for s in seqs]
        n = len(seqs)
        self.errors: dict[int, RowFailed] = {}
        dev = device
        sampled = [i for i, p in enumerate(ps) if not p.greedy]
        self.sampled_rows = sampled
        self.vocab = vocab
        self.all_greedy = len(sampled) == 0
        self.all_sampled = len(sampled) == n
        # -- temperature, truncation, seeds
        top_k = [p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in ps]
        self.truncates = any(top_k[i] < vocab or ps[i].top_p < 1.0 or ps[i].min_p > 0.0 for i in sampled)
        self.any_top_p = any(ps[i].top_p < 1.0 for i in sampled)
        self.any_min_p = any(ps[i].min_p > 0.0 for i in sampled)
        kmax = max((top_k[i] for i in sampled), default=vocab)
        self.candidates = kmax if kmax <= TOPK_CANDIDATES_MAX else vocab   # topk's k, or vocab: sort all
        floats = torch.tensor([[1.0 if p.greedy else p.temperature for p in ps], [p.top_p for p in ps],
                               [p.min_p for p in ps]], dtype=torch.float32).to(dev, non_blocking=True)
        self.temperature, self.top_p, self.min_p = floats[0, :, None], floats[1, :, None], floats[2, :, None]
        ints = torch.tensor([[s.sample_seed for s in seqs], top_k, [int(p.greedy) for p in ps]],
                            dtype=torch.int64).to(dev, non_blocking=True)
        self.seeds, self.top_k, self.greedy = ints[0], ints[1, :, None], ints[2].bool()
        # -- logit_bias: flat (row, id, bias) triples
        bias = [(i, t, b) for i, p in enumerate(ps) for t, b in p.logit_bias]
        self.bias = None
        if bias:
            if any(t >= vocab for _, t, _ in bias):
                for i, p in enumerate(ps):
                    if any(t >= vocab for t, _ in p.logit_bias):
                        self.errors[i] = RowFailed(f"sampling failed: logit_bias names token ids outside the "
                                                       f"vocabulary [0, {vocab})")
                bias = [x for x in bias if x[0] not in self.errors]
            rows_ids = torch.tensor([(i, t) for i, t, _ in bias], dtype=torch.long).to(dev, non_blocking=True)
            self.bias = (rows_ids[:, 0], rows_ids[:, 1],
                         torch.tensor([b for _, _, b in bias], dtype=torch.float32).to(dev, non_blocking=True))
        # -- min_tokens: the ids each such row may not end with yet
        self.min_tokens = {}                          # row -> (min_tokens, banned ids)
        for i, p in enumerate(ps):
            if p.min_tokens:
                banned = sorted(set(eos_token_ids) | set(p.stop_token_ids))
                if any(not 0 <= t < vocab for t in banned):
                    self.errors[i] = RowFailed(f"sampling failed: stop_token_ids hold ids outside the "
                                                   f"vocabulary [0, {vocab})")
                elif banned:
                    self.min_tokens[i] = (p.min_tokens, banned)
        self._banned_key, self._banned = None, None
        # -- penalties: rows, their token-count slots, (presence, frequency, repetition)
        pen = [i for i, p in enumerate(ps) if p.penalized]
        self.penalties = None
        if pen:
            idx = torch.tensor([pen, [counts.slot(seqs[i]) for i in pen]], dtype=torch.long).to(dev,
                                                                                                non_blocking=True)
            vals = torch.tensor([[ps[i].presence_penalty for i in pen], [ps[i].frequency_penalty for i in pen],
                                 [ps[i].repetition_penalty for i in pen]], dtype=torch.float32)
            self.penalties = (idx[0], idx[1], vals.to(dev, non_blocking=True)[:, :, None])
        # -- logprobs: rows, and the most alternatives any of them asked for
        self.lp_rows = [i for i, p in enumerate(ps) if p.logprobs is not None]
        self.lp_k = max((ps[i].logprobs for i in self.lp_rows), default=0)
        self.lp_index = torch.tensor(self.lp_rows, dtype=torch.long).to(dev, non_blocking=True) \
            if self.lp_rows else None

    def same(self, seqs: list[Sequence]) -> bool:
        return len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs))

    def banned(self, device: torch.device):
        """(rows, ids) of this step's rows still below ``min_tokens``, or None."""
        active = tuple(i for i, (m, _) in self.min_tokens.items()
                       if i not in self.errors and len(self.seqs[i].output_token_ids) < m)
        if not active:
            return None
        if active != self._banned_key:
            pairs = [(i, t) for i in active for t in self.min_tokens[i][1]]
            t = torch.tensor(pairs, dtype=torch.long).to(device, non_blocking=True)
            self._banned_key, self._banned = active, (t[:, 0], t[:, 1])
        return self._banned


class Sampler:
    """Samples the batch's logits (see the module's docstring); keeps the batch's parameters while the batch
    stays the same, the penalties' token counts, and two page-locked result buffers (two iterations in flight)."""

    def __init__(self, vocab: int, eos_token_ids: tuple[int, ...], device: torch.device):
        self.vocab, self.eos_token_ids, self.device = vocab, eos_token_ids, device
        self._batch: SamplingBatch | None = None
        self._counts: TokenCounts | None = None
        self._host: list[torch.Tensor | None] = [None, None]
        self._slot = 0

    def counts(self) -> TokenCounts:
        if self._counts is None:
            self._counts = TokenCounts(self.vocab, self.device)
        return self._counts

    def batch(self, seqs: list[Sequence]) -> SamplingBatch:
        b = self._batch
        if b is None or not b.same(seqs):
            counts = self.counts() if any(s.params.penalized for s in seqs) else None
            b = self._batch = SamplingBatch(seqs, self.vocab, self.eos_token_ids, self.device, counts)
        return b

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], pinned: bool = False,
               allowed: torch.Tensor | None = None) -> "Sampled":
        """Queue the sampling of ``logits`` [S, V] (one row per sequence of ``seqs``); ``pinned``: copy the results
        into page-locked memory without a wait (CUDA; else :meth:`Sampled.result` copies); ``allowed``: the
        batch's grammar bitmask on the host (int32 [S, ceil(V / 32)], :class:`~vlora.engine.guided.Masks`), or
        None."""
        b = self.batch(seqs)
        dev = logits.device
        positions = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long).to(dev, non_blocking=True)
        x = logits                                      # ``logits`` stays the model's own: each change is a copy
        if b.bias is not None:
            x = x.index_put((b.bias[0], b.bias[1]), b.bias[2], accumulate=True)
        banned = b.banned(dev)
        if banned is not None:
            x = x.index_put(banned, x.new_full((), float("-inf")))
        if allowed is not None:
            x = guided.apply(x, allowed.to(dev, non_blocking=True))
        if b.penalties is not None:
            x = _penalize(x, b.penalties, self._counts)
        tokens, ok = _draw(x, b, positions)
        if b.penalties is not None:
            rows, slots, _ = b.penalties
            self._counts.add(slots, tokens.index_select(0, rows))
        parts = [tokens, ok]
        if b.lp_rows:                 # log-softmax at the chosen and the top tokens only: logit - logsumexp
            every = len(b.lp_rows) == len(seqs)
            raw = logits if every else logits.index_select(0, b.lp_index)
            lse = torch.logsumexp(raw, dim=-1, keepdim=True)
            chosen = tokens if every else tokens.index_select(0, b.lp_index)
            parts.append((raw.gather(1, chosen[:, None]) - lse)[:, 0])
            if b.lp_k:
                top = raw.topk(b.lp_k, dim=-1)
                parts += [(top.values - lse).flatten(), top.indices.flatten()]
        host = None
        if pinned:
            n = sum(p.numel() for p in parts)
            slot, self._slot = self._slot, 1 - self._slot
            buf = self._host[slot]
            if buf is None or buf.numel() < n:
                from vlora.memory.pinned import pinned_empty

                buf = self._host[slot] = pinned_empty((max(n, 2 * len(seqs) + 64),), torch.float64)
            host = buf[:n]
        return Sampled(seqs, tokens, parts, host, b)


def _penalize(x: torch.Tensor, penalties, counts: TokenCounts) -> torch.Tensor:
    """Repetition over prompt and generated tokens, then frequency and presence over generated ones."""
    rows, slots, (presence, frequency, repetition) = penalties
    c = counts.counts.index_select(0, slots)
    generated = c > 0
    seen = counts.in_prompt.index_select(0, slots) | generated
    xp = x.index_select(0, rows)
    xp = torch.where(seen, torch.where(xp > 0, xp / repetition, xp * repetition), xp)
    xp = xp - frequency * c - presence * generated
    return x.index_copy(0, rows, xp)


def _draw(x: torch.Tensor, b: SamplingBatch, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [S] int64, ok [S] bool): the argmax for greedy rows, a Gumbel-max draw for sampled ones."""
    if b.all_greedy:
        return x.argmax(dim=-1), torch.isfinite(x.amax(dim=-1))
    greedy = None if b.all_sampled else x.argmax(dim=-1)
    x = x / b.temperature
    ids = None
    if b.truncates:
        if b.candidates < x.shape[1]:
            x, ids = x.topk(b.candidates, dim=-1)
        else:
            x, ids = x.sort(dim=-1, descending=True)
        col = torch.arange(x.shape[1], device=x.device)
        x = x.masked_fill(col >= b.top_k, float("-inf"))
        if b.any_top_p or b.any_min_p:
            probs = torch.softmax(x, dim=-1)            # renormalised inside the top-k set
            drop = None
            if b.any_top_p:                             # keep the smallest prefix reaching top_p
                drop = probs.cumsum(dim=-1) - probs >= b.top_p
            if b.any_min_p:
                low = probs < b.min_p * probs[:, :1]
                drop = low if drop is None else drop | low
            x = x.masked_fill(drop, float("-inf"))
    ok = torch.isfinite(x.amax(dim=-1))
    ids = None if ids is None else ids.contiguous()
    if x.is_cuda:
        from vlora.kernels.sampling import gumbel_argmax

        drawn = gumbel_argmax(x.contiguous(), b.seeds, positions, ids)
    else:
        drawn = cpu_gumbel_argmax(x, b, positions, ids)
    if b.all_sampled:
        return drawn, ok
    return torch.where(b.greedy, greedy, drawn), ok


def cpu_gumbel_argmax(x: torch.Tensor, b: SamplingBatch, positions: torch.Tensor,
                      ids: torch.Tensor | None) -> torch.Tensor:
    """The Gumbel-max draw on the CPU: each sampled row's noise over the whole vocabulary from a generator seeded
    by (seed, position) (:func:`cpu_noise`), indexed by token id; the greedy rows' results are discarded."""
    noise = torch.zeros(x.shape[0], b.vocab)
    seeds, pos = b.seeds.tolist(), positions.tolist()
    for r in b.sampled_rows:
        noise[r] = cpu_noise(seeds[r], pos[r], b.vocab)
    k = (x + (noise if ids is None else noise.gather(1, ids))).argmax(dim=-1)
    return k if ids is None else ids.gather(1, k[:, None])[:, 0]


def cpu_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Gumbel noise [vocab] for the token at ``position`` of a request of ``seed``, on the CPU: -log(-log(u)) of
    uniforms from torch's generator seeded by a mix of the two. A function of (seed, position, token id) alone,
    as the GPU kernel's Philox noise is, but a different stream: the torch twin of that noise
    (``kernels/philox.py``) runs ten rounds of int64 tensor ops over the vocabulary, many times the cost of one
    generator draw on a CPU."""
    g = torch.Generator().manual_seed(_splitmix64(_splitmix64(seed) ^ (position & _M64)) >> 1)
    u = torch.rand(vocab, generator=g).clamp_min_(2.0 ** -25)      # [2**-25, 1): never 0
    return -torch.log(torch.clamp_min(-torch.log(u), philox.EXP_MIN))


_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's output function: mixes a 64-bit value (neighbouring positions give unrelated seeds)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class Sampled:
    """Sampled tokens on their way to the host: ``tokens`` [S] on the device; :meth:`result` waits for them."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, parts: list[torch.Tensor],
                 host: torch.Tensor | None, batch: SamplingBatch):
        self.seqs, self.tokens, self._batch = seqs, tokens, batch
        payload = torch.cat([p.to(torch.float64) for p in parts])      # one copy, one wait
        self._event = None
        self._host = payload
        if host is not None:              # page-locked: the copy is queued, nothing waits
            host.copy_(payload, non_blocking=True)
            self._host = host
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> list[int | TokenLogprobs | RowFailed]:
        """One token id per sequence (a :class:`TokenLogprobs` for rows that asked for logprobs; why it could not
        be had for rows that failed)."""
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        b, seqs, n = self._batch, self.seqs, len(self.seqs)
        out: list = [int(t) for t in values[:n]]
        for i, ok in enumerate(values[n:2 * n]):
            if not ok and i not in b.errors:
                p = seqs[i].params
                out[i] = RowFailed("sampling failed: no token can be sampled (the kept logits are not finite"
                                       + ("" if p.greedy else f" at temperature {p.temperature!r}") + ")")
        for i, e in b.errors.items():
            out[i] = e
        if b.lp_rows:
            m, k = len(b.lp_rows), b.lp_k
            chosen = values[2 * n:2 * n + m]
            top_v = values[2 * n + m:2 * n + m + m * k]
            top_i = values[2 * n + m + m * k:]
            for j, i in enumerate(b.lp_rows):
                if isinstance(out[i], RowFailed):
                    continue
                own = seqs[i].params.logprobs
                top = tuple((int(top_i[j * k + a]), top_v[j * k + a]) for a in range(own))
                out[i] = TokenLogprobs(out[i], chosen[j], top)
        return out
