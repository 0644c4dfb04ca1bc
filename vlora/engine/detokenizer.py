"""Incremental detokenization and stop strings.

The text of a sequence is the decode of its output tokens (special tokens
skipped); a stop string ends the output before it. Streaming holds back an
incomplete UTF-8 character and any tail that could still become a stop string.

Each step decodes only the tokens after the sequence's read offset when the
tokenizer's decode is a byte-level one (GPT-2 style BPE: SmolLM2, Llama 3,
Qwen): its text is the lossy UTF-8 decode of the tokens' bytes joined, so a
prefix that ends on a complete character decodes the same alone as inside the
whole. Other tokenizers (SentencePiece byte fallback, WordPiece, a cleanup of
spaces, a class with its own decode) decode the whole output each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vlora.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# tokens left open when a long undecodable tail is split (an incomplete character is in the last few)
_OPEN_TOKENS = 4
_CLEANUP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're"


@dataclass
class DetokState:
    """``text`` is the decode of ``output_token_ids[:read]``, which ends on a clean UTF-8 boundary: the
    decode of any tokens after it is ``text`` + the decode of those tokens alone. ``last`` is the token at
    ``read - 1``: output tokens only grow, and a list found cut or changed there starts over."""

    read: int = 0
    text: str = ""
    last: int | None = None


class Detokenized(Protocol):
    """What the detokenizer reads and advances: a :class:`vlora.engine.sequence.Sequence`, or the text the
    cluster front keeps of a request it moved between replicas (:mod:`vlora.cluster.resumed_text`)."""

    params: SamplingParams
    output_token_ids: list[int]
    text: str                           # the decode so far, stop string excluded
    detok_state: DetokState | None
    num_emitted_chars: int              # streamed so far

    @property
    def is_finished(self) -> bool: ...


def incremental_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when its decode is exact per window (see the module
    docstring), else None. Read from what the tokenizer is, not assumed from its name."""
    from tokenizers import Tokenizer, decoders
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None                             # a class that decodes its own way
    # the cleanup of spaces rewrites patterns (" ." -> ".") that span token boundaries; transformers skips it
    # for some models whatever the setting, so what counts is whether it changes a text made of its patterns
    probe = backend.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
    if tokenizer.decode(probe, skip_special_tokens=True) != backend.decode(probe, skip_special_tokens=True):
        return None
    return backend


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = None if tokenizer is None else incremental_backend(tokenizer)

    def update(self, seq: Detokenized) -> bool:
        """Refresh ``seq.text``; True when a stop string was found (text cut before it)."""
        if self.tokenizer is None:
            return False
        ids = seq.output_token_ids
        n = len(ids)
        if n and ids[-1] in seq.params.stop_token_ids:
            n -= 1
        text = self.decode(seq, n) if self.backend is not None else \
            self.tokenizer.decode(ids[:n], skip_special_tokens=True)
        stops = seq.params.stop
        if stops:
            longest = max(len(s) for s in stops)
            # a trailing replacement character may have become part of a complete one: search from before it
            start = max(0, len(seq.text.rstrip(_REPLACEMENT)) - longest)
            hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
            if hits:
                seq.text = text[:min(hits)]
                return True
        seq.text = text
        return False

    def decode(self, seq: Detokenized, n: int) -> str:
        """The decode of ``seq.output_token_ids[:n]`` from the sequence's state, which it advances: the tokens
        after the read offset are decoded, and taken in when they end on a complete character."""
        st, ids = seq.detok_state, seq.output_token_ids
        if st is None or st.read > n or (st.read and ids[st.read - 1] != st.last):
            st = seq.detok_state = DetokState()     # new, or its tokens were cut or replaced: start over
        decode = self.backend.decode
        tail = decode(ids[st.read:n], skip_special_tokens=True)
        if not tail.endswith(_REPLACEMENT):
            st.text += tail
            st.read, st.last = n, ids[n - 1] if n else None
            return st.text
        if n - st.read > 2 * _OPEN_TOKENS:
            # invalid bytes keep the tail open: take in all but the last tokens when that split leaves the
            # decode unchanged and the rest has bytes. Then the bytes before the split are complete, or the
            # first byte after it does not continue them (else the rest would decode to more characters):
            # no later token changes the text before the split
            cut = n - _OPEN_TOKENS
            head = decode(ids[st.read:cut], skip_special_tokens=True)
            rest = decode(ids[cut:n], skip_special_tokens=True)
            if rest and head + rest == tail:
                st.text += head
                st.read, st.last = cut, ids[cut - 1]
                tail = rest
        return st.text + tail

    def stream_delta(self, seq: Detokenized) -> str:
        """Text not yet emitted that is safe to emit now; advances the emitted mark."""
        if self.tokenizer is None:                 # token ids in and out: there is no text
            return ""
        end = len(seq.text)
        if not seq.is_finished:
            while end > seq.num_emitted_chars and seq.text[end - 1] == _REPLACEMENT:
                end -= 1                           # incomplete multi-byte character
            if seq.params.stop:
                end = max(seq.num_emitted_chars, end - max(len(s) for s in seq.params.stop) + 1)
        delta = seq.text[seq.num_emitted_chars:end]
        seq.num_emitted_chars = max(seq.num_emitted_chars, end)
        return delta
