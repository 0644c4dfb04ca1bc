"""Logprobs in OpenAI's two wire shapes (chat's ``content`` list, completions' parallel lists), with token text.

A token's text is its id decoded alone (as vLLM does), special tokens included: an end-of-turn token shows as,
say, ``<|im_end|>``. Its ``bytes`` are that text's UTF-8, except for a token that holds part of a character
(a byte-level BPE piece or a SentencePiece ``<0xNN>`` token): its text alone is ``"\\ufffd"``, and its bytes are
the token's own, so a client can join a character's tokens back together. A model without a tokenizer names
each token ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids`` form), with ``bytes`` null.

Logprobs below -9999.0 (``-inf`` for a token the model rules out) are written as -9999.0, as vLLM does: JSON has
no -Infinity.

Everything here runs in a worker thread (see :class:`vlora.server.workers.HeavyWork`): it decodes with that
thread's tokenizer copy, and a long answer's logprobs are many small objects to build.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable

from vlora.engine.sequence import TokenLogprobs
from vlora.server import protocol as P
from vlora.server.workers import HeavyWork

FLOOR = -9999.0
CACHE_SIZE = 1 << 16        # token texts kept; a vocabulary's common tokens fit
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's alphabet: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


class TokenTexts:
    """Token id -> (text, UTF-8 bytes or None), decoded in the calling worker thread and cached."""

    def __init__(self, work: HeavyWork):
        self.work = work
        self.get = functools.lru_cache(maxsize=CACHE_SIZE)(self._decode)

    def _decode(self, token_id: int) -> tuple[str, bytes | None]:
        tok = self.work.tokenizer()
        if tok is None:
            return f"token_id:{token_id}", None
        text = tok.decode([token_id])
        raw = _raw_bytes(tok, token_id) if "\ufffd" in text else None
        return text, text.encode("utf-8", "backslashreplace") if raw is None else raw

    def top(self, token_id: int, logprob: float) -> P.TopLogprob:
        text, raw = self.get(token_id)
        return P.TopLogprob(token=text, logprob=clamp(logprob), bytes=None if raw is None else list(raw))

    def chat(self, entries: Iterable[TokenLogprobs]) -> P.ChatLogprobs:
        """Chat's shape: per token its text, logprob, bytes and the top alternatives."""
        content = []
        for e in entries:
            text, raw = self.get(e.token_id)
            content.append(P.TokenLogprob(token=text, logprob=clamp(e.logprob),
                                          bytes=None if raw is None else list(raw),
                                          top_logprobs=[self.top(t, lp) for t, lp in e.top]))
        return P.ChatLogprobs(content=content)

    def completion(self, items: Iterable[tuple[int, TokenLogprobs | None]],
                   offset: int = 0) -> tuple[P.CompletionLogprobs, int]:
        """The completions shape of (token id, its logprobs or None) pairs, and the text offset after them.
        ``text_offset`` counts from ``offset`` by each token's text length, as vLLM does (a token that holds part
        of a character counts its replacement character). ``top_logprobs`` holds the alternatives and the chosen
        token (OpenAI: up to logprobs + 1 entries)."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, e in items:
            text = self.get(token_id)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if e is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(clamp(e.logprob))
            top = {self.get(t)[0]: clamp(lp) for t, lp in e.top}
            top.setdefault(text, clamp(e.logprob))
            tops.append(top)
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops,
                                    text_offset=offsets), offset


def generated(entries: list[TokenLogprobs] | None) -> list[tuple[int, TokenLogprobs | None]]:
    return [(e.token_id, e) for e in entries or ()]


def prompt_items(prompt_ids: list[int], entries: list[TokenLogprobs | None] | None
                 ) -> list[tuple[int, TokenLogprobs | None]]:
    """The prompt's (token id, logprobs) pairs; a position the engine reported nothing for has None."""
    entries = entries or []
    return [(t, entries[i] if i < len(entries) else None) for i, t in enumerate(prompt_ids)]


def clamp(logprob: float) -> float:
    return FLOOR if math.isnan(logprob) or logprob < FLOOR else logprob


def _raw_bytes(tok, token_id: int) -> bytes | None:
    """A token's own bytes, read from its vocabulary entry: ``<0xNN>`` byte tokens and byte-level BPE pieces;
    None for any other kind of entry."""
    piece = tok.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str) or not piece:
        return None
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    if all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None
