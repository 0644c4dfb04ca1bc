"""Request outputs as they cross from the engine-core process to the server's: what is new since the last one.

A :class:`~vlora.engine.sequence.RequestOutput` carries its request's whole state (prompt ids, every token so
far, the text, every logprob), one per request per engine step: sent whole, a long answer's bytes would grow
with the square of its length. :class:`DeltaEncoder` (engine side) sends each growing field as the tail past
what it sent before, with the length it continues from; :class:`DeltaDecoder` (server side) joins the tails back
into an equal RequestOutput. A field that did not simply grow (never the case in the engine today) is sent whole
(continuing from 0), so the decoded output equals the encoded one whatever the engine does.

Wire form of one output, a tuple:
``(request_id, adapter, prompt_token_ids | None (sent before), tokens_from, tokens_tail, text_from, text_tail,
finished, finish_reason, delta_token_ids | None (= tokens_tail), delta_text | None (= text_tail), error, task,
logprobs_from, logprobs_tail | None (none asked), prompt_logprobs | None (none, or sent before),
cumulative_logprob)``.
"""

from __future__ import annotations

from vlora.engine.sequence import RequestOutput


class _Sent:
    __slots__ = ("tokens", "text", "logprobs", "prompt_logprobs")

    def __init__(self):
        self.tokens = 0              # token ids sent
        self.text = ""               # the text sent
        self.logprobs = 0            # logprobs sent
        self.prompt_logprobs = False  # prompt logprobs sent


def _tail(n_sent: int, items: list) -> tuple[int, list]:
    """(where the tail continues from, the tail) of a list of which ``n_sent`` items were sent."""
    return (n_sent, items[n_sent:]) if len(items) >= n_sent else (0, items)


class DeltaEncoder:
    """The engine side: one per stream; remembers, per request, what it sent."""

    def __init__(self):
        self._sent: dict[str, _Sent] = {}

    def encode(self, out: RequestOutput) -> tuple:
        sent = self._sent.get(out.request_id)
        first = sent is None
        if first:
            sent = self._sent[out.request_id] = _Sent()
        tok_from, tok_tail = _tail(sent.tokens, out.token_ids)
        text = out.text
        text_from = len(sent.text) if text.startswith(sent.text) else 0
        text_tail = text[text_from:]
        lp_from, lp_tail = (0, None) if out.logprobs is None else _tail(sent.logprobs, out.logprobs)
        plp = None
        if out.prompt_logprobs is not None and not sent.prompt_logprobs:
            plp, sent.prompt_logprobs = out.prompt_logprobs, True
        if out.finished:
            del self._sent[out.request_id]
        else:
            sent.tokens, sent.text = len(out.token_ids), text
            sent.logprobs = 0 if out.logprobs is None else len(out.logprobs)
        return (out.request_id, out.adapter, out.prompt_token_ids if first else None, tok_from, tok_tail,
                text_from, text_tail, out.finished, out.finish_reason,
                None if out.delta_token_ids == tok_tail else out.delta_token_ids,
                None if out.delta_text == text_tail else out.delta_text,
                out.error, out.task, lp_from, lp_tail, plp, out.cumulative_logprob)

    def forget(self, request_ids) -> None:
        """Drop what was sent for these requests (their stream ended without a final output)."""
        for rid in request_ids:
            self._sent.pop(rid, None)


class _Held:
    __slots__ = ("prompt", "tokens", "text", "logprobs", "prompt_logprobs")

    def __init__(self, prompt):
        self.prompt = prompt
        self.tokens: list[int] = []
        self.text = ""
        self.logprobs: list | None = None
        self.prompt_logprobs = None


def _join(items: list, start: int, tail: list) -> list:
    """``items[:start] + tail`` as a new list, copying ``items`` once where the tail continues it (every step
    of a request but a rewrite)."""
    return items + tail if start == len(items) else items[:start] + tail


class DeltaDecoder:
    """The server side: one per stream; holds, per request, the state the tails extend."""

    def __init__(self):
        self._held: dict[str, _Held] = {}

    def decode(self, wire: tuple) -> RequestOutput:
        (rid, adapter, prompt, tok_from, tok_tail, text_from, text_tail, finished, finish_reason, delta_ids,
         delta_text, error, task, lp_from, lp_tail, plp, cumulative) = wire
        held = self._held.get(rid)
        if held is None:
            held = self._held[rid] = _Held(prompt)
        held.tokens = _join(held.tokens, tok_from, tok_tail)   # a new list: an earlier output keeps its own
        held.text = held.text[:text_from] + text_tail
        if lp_tail is not None:
            held.logprobs = _join(held.logprobs or [], lp_from, lp_tail)
        if plp is not None:
            held.prompt_logprobs = plp
        if finished:
            del self._held[rid]
        return RequestOutput(rid, adapter, held.prompt, held.tokens, held.text, finished, finish_reason,
                             tok_tail if delta_ids is None else delta_ids,
                             text_tail if delta_text is None else delta_text, error, task,
                             None if lp_tail is None else held.logprobs, held.prompt_logprobs, cumulative)

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)
