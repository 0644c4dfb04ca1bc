"""Structured output: a request's grammar (JSON schema, regex, choice, Lark grammar) as a mask over tokens.

llguidance does the grammar work, on the host:

- :class:`Grammars` compiles each request's :class:`~vlora.sampling_params.GuidedSpec` once, at
  ``Engine.add_request``: an LRU of compiled matchers keyed by the spec's text; each request gets a copy;
- :class:`Guide` is one sequence's matcher, advanced by the engine with each token it accepts. Output tokens
  are never taken back (a preempted sequence keeps them and recomputes their KV), so the matcher never rolls
  back: a recompute samples its next token from the state those tokens left;
- :class:`Masks` writes the allowed tokens of every constrained row of a batch into one packed bitmask in
  page-locked memory. The runner fills it right after the forward is queued, so that the host work overlaps
  the forward on the device; the sampler copies it with the batch and applies it in one masked write
  (:func:`apply`).

Bitmask layout (llguidance's): int32 [S, ceil(V / 32)], bit ``t % 32`` of word ``t // 32`` set where token ``t``
is allowed; a row without a grammar is all ones.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import torch

from vlora.sampling_params import GuidedSpec

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


class GrammarError(ValueError):
    """A spec the grammar engine cannot compile, or a token its grammar refuses."""


class Guide:
    """One sequence's grammar state."""

    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        """Consume an accepted token; True once the grammar is complete (nothing but the end may follow).
        Raises :class:`GrammarError` if the grammar refuses it (a token the mask did not allow)."""
        m = self.matcher
        if not m.consume_token(token):
            raise GrammarError(f"the output left its grammar at token {token}: {m.get_error()}")
        return m.is_stopped()


class Grammars:
    """Compiles specs into matchers over one tokenizer; the llguidance tokenizer is built on first use (about a
    second for a 50k vocabulary)."""

    def __init__(self, tokenizer, vocab: int, eos_token_ids: tuple[int, ...], capacity: int = CACHE_SIZE):
        """``tokenizer``: a Hugging Face fast tokenizer; ``vocab``: the model's vocabulary (the mask's width: ids
        the tokenizer lacks are never allowed); ``eos_token_ids``: what may end a complete output."""
        self._hf, self.vocab, self.eos_token_ids, self.capacity = tokenizer, vocab, eos_token_ids, capacity
        self._tok = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()

    def tokenizer(self):
        """llguidance's tokenizer, built once; a tokenizer it cannot take is refused once and remembered."""
        if self._tok is None:
            import llguidance.hf

            try:
                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab,
                                                         eos_token=list(self.eos_token_ids) or None)
            except Exception as e:
                self._tok = GrammarError(f"structured output is not available for this tokenizer: {e}")
        if isinstance(self._tok, GrammarError):
            raise self._tok
        return self._tok

    def compile(self, spec: GuidedSpec) -> Guide:
        """A fresh :class:`Guide` for ``spec``; raises :class:`GrammarError` with the engine's reason."""
        from llguidance import LLMatcher

        key = spec.key
        m = self._cache.get(key)
        if m is None:
            tok = self.tokenizer()
            m = LLMatcher(tok, grammar_text(spec), log_level=0)
            if m.is_error():
                raise GrammarError(f"the {spec.kind} cannot be compiled: {m.get_error().strip()}")
            self._cache[key] = m
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return Guide(m.deep_copy())


JSON_OPTIONS = {"whitespace_flexible": False}
"""JSON is generated compact (no whitespace between its tokens: ``{"a":1}``): free whitespace would let a model
fill its budget with it (vLLM's ``disable_any_whitespace``)."""


def grammar_text(spec: GuidedSpec) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: the matcher reports what is wrong)."""
    from llguidance import LLMatcher

    kind = spec.kind
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec.json_schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        from llguidance import grammar_from

        return grammar_from("grammar", spec.grammar)     # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(f"the {kind} cannot be compiled: {e}") from None


class Masks:
    """The host side of a batch's mask: two page-locked bitmask buffers, alternating (on CUDA the copy of one
    may still be in flight while the next is filled)."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.words, self.device = vocab, (vocab + 31) // 32, device
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._slot = 0

    def fill(self, seqs) -> torch.Tensor | None:
        """The bitmask [S, words] of ``seqs`` (a row per sequence; all ones where it has no grammar), or None if
        none has one."""
        rows = [(s.guide.matcher, i) for i, s in enumerate(seqs) if s.guide is not None]
        if not rows:
            return None
        n = len(seqs)
        slot, self._slot = self._slot, 1 - self._slot
        buf = self._bufs[slot]
        if buf is None or buf.shape[0] < n:
            size = (max(n, 16), self.words)
            if self.device.type == "cuda":
                from vlora.memory.pinned import pinned_empty

                buf = pinned_empty(size, torch.int32)
            else:
                buf = torch.empty(size, dtype=torch.int32)
            self._bufs[slot] = buf
        out = buf[:n]
        if len(rows) < n:
            out.fill_(-1)
        nbytes = self.words * 4
        # one row after another: on a 16-core H100 host llguidance's thread pool (LLExecutor) took longer than
        # this loop, 8.6 vs 5.4 ms for 64 rows and 5.0 vs 1.9 ms for 16 (benchmarks/results/h100-2026-11-28-api)
        for m, i in rows:
            m.unsafe_compute_mask_ptr(out[i].data_ptr(), nbytes)
        return out


_BITS: dict[torch.device, torch.Tensor] = {}


def apply(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``x`` [S, V] with -inf where ``bitmask`` [S, ceil(V / 32)] int32 (on ``x``'s device) forbids a token.

    Semantics: ``out[s, t] = x[s, t] if bitmask[s, t // 32] >> (t % 32) & 1 else -inf``; a copy (``x`` is kept).
    """
    s, v = x.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape == (s, (v + 31) // 32), (bitmask.dtype, bitmask.shape)
    bits = _BITS.get(x.device)
    if bits is None:
        bits = _BITS[x.device] = torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int32,
                                              device=x.device)
    forbid = (bitmask.unsqueeze(-1) & bits).view(s, -1)[:, :v] == 0
    return x.masked_fill(forbid, float("-inf"))
