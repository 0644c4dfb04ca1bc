"""Tool calls in a model's answer: one parser per output format, for whole answers and for streams.

Formats (``--tool-call-parser``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and the system-prompt fallback of models whose template shows no tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, after optional text;
- ``llama3_json`` (Llama 3.1 to 3.3): the whole answer is ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``; several calls are separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. ``[TOOL_CALLS]`` is a special token that
  the answer's text leaves out, so an answer that starts with the JSON array is taken too.

``arguments`` and ``parameters`` are taken in every format. Text that is not a well-formed call stays the
answer's content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from vlora.config import TOOL_CALL_PARSERS

PARSERS = TOOL_CALL_PARSERS[1:]         # the formats; "auto" picks one by the model's family


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str          # JSON text of the arguments object


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Parser:
    """One output format. ``markers`` open the calls anywhere in the answer; ``leading`` only at its start (after
    whitespace); ``block``: the (opening, closing) tags around each call, which let a stream send a call as soon
    as its block closes (None: the calls are known only once the answer is complete). Tags begin with, and hold,
    no whitespace."""

    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()
    block: tuple[str, str] | None = None

    def start(self, text: str) -> int | None:
        """Where the calls begin in ``text``, or None if they have not begun."""
        body = text.lstrip()
        if self.leading and body.startswith(self.leading):
            return len(text) - len(body)
        at = _first(text, self.markers)
        return None if at < 0 else at

    def calls(self, region: str) -> list[ToolCall] | None:
        """The calls in ``region`` (the whole answer from :meth:`start` on), or None if it is not a sequence of
        well-formed calls."""
        raise NotImplementedError


class HermesParser(Parser):
    block = ("<tool_call>", "</tool_call>")
    markers = block[:1]
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def calls(self, region: str) -> list[ToolCall] | None:
        calls = []
        for block in self._BLOCK.finditer(region):      # the last block may be unclosed
            call = _call(_load(block.group(1)))
            if call is None:            # not a call: the calls before it stand, if there are any
                return calls or None
            calls.append(call)
        return calls


class JSONParser(Parser):
    """Calls written as JSON at the start of the answer, after an optional ``tag``: objects separated by ``;``
    (llama3_json), or one array of them (``array``: mistral). They are known only once the answer is complete:
    text after them makes them no calls."""

    tag = ""
    array = False

    def calls(self, region: str) -> list[ToolCall] | None:
        text = region.lstrip()
        text = text[len(self.tag):].lstrip() if text.startswith(self.tag) else text
        values, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(text):
            try:
                value, end = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            values.extend(value if self.array and isinstance(value, list) else [value])
            pos = _skip_space(text, end)
            if self.array or not text.startswith(";", pos):
                break
            pos = _skip_space(text, pos + 1)
        calls = [_call(v) for v in values]
        if not calls or None in calls or pos < len(text):      # nothing, not calls, or text after them
            return None
        return calls


class Llama3JSONParser(JSONParser):
    tag = "<|python_tag|>"
    leading = (tag, "{")


class MistralParser(JSONParser):
    tag = "[TOOL_CALLS]"
    markers = (tag,)
    leading = (tag, "[")
    array = True


_PARSERS: dict[str, type[Parser]] = {"llama3_json": Llama3JSONParser, "hermes": HermesParser,
                                     "mistral": MistralParser}
assert tuple(_PARSERS) == PARSERS


def parser_for(name: str) -> Parser:
    return _PARSERS[name]()


def parse_answer(p: Parser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer: the text before the calls (None if only whitespace) and the calls; the
    whole text and no calls when it holds no well-formed ones."""
    start = p.start(text)
    calls = None if start is None else p.calls(text[start:])
    if not calls:
        return text, []
    return (text[:start] if text[:start].strip() else None), calls


class ToolStream:
    """One streamed answer: its text goes out as content until its calls begin (text that may begin one is held
    back until it is known not to), then each call goes out once it is complete.

    A delta costs work in proportion to its length and to the few characters before it that a tag may begin in:
    the answer's text is kept in pieces and joined once, by :meth:`finish`; until the calls begin, what is held
    back is whitespace (in pieces) and, after it, the start of a tag; inside a block, its text so far (in
    pieces)."""

    def __init__(self, p: Parser):
        self.p = p
        self.pieces: list[str] = []         # the answer's text so far
        self.size = 0                       # its length
        self.sent = 0                       # characters of it sent as content
        self.space: list[str] = []          # held whitespace, at the end of the text (before the calls begin)
        self.tag = ""                       # held text after it: the start of a marker or of a leading tag
        self.leading = bool(p.leading)      # a leading tag may still begin the answer
        self.start: int | None = None       # where the calls begin
        self.tail = ""                      # calls begun (block formats): the text's end, where a tag may begin
        self.body: list[str] | None = None  # the open block's text so far; None between blocks
        self.body_size = 0                  # its length
        self.calls: list[ToolCall] = []     # the calls complete so far
        self.stopped = False                # a block was not a call: no more calls go out before the end
        self.done = 0                       # calls sent

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to send, calls completed) after ``delta``."""
        self.pieces.append(delta)
        self.size += len(delta)
        if self.start is not None:
            self._blocks(delta)
            return "", self._new(self.calls)
        return self._before(delta), self._new(self.calls)

    def finish(self) -> tuple[str, list[ToolCall], bool]:
        """(content to send, calls not sent yet, whether the answer made calls) once the answer is complete."""
        text = "".join(self.pieces)
        calls = None if self.start is None else self.p.calls(text[self.start:])
        if calls is None and not self.done:         # no calls, or not calls after all: the held text is content
            content, self.sent = text[self.sent:], len(text)
            return content, [], False
        return "", self._new(calls or []), True

    def _before(self, delta: str) -> str:
        """The content to send once ``delta`` ends the text, the calls not begun before it; sets :attr:`start`
        if they begin in it. Held back: the text while it may still be a leading tag (after whitespace), else a
        marker's start at its end and the whitespace before that (an answer whose calls follow only whitespace
        sends none of it)."""
        if self.leading:
            if self.tag:
                text = self.tag + delta
            else:
                text = delta.lstrip()
                self.space.append(delta[:len(delta) - len(text)])
            if not text:
                return ""
            if text.startswith(self.p.leading):
                return self._begin(text, 0)
            if any(m.startswith(text) for m in self.p.leading) and _first(text, self.p.markers) < 0:
                self.tag = text
                return ""
            self.leading, self.tag, delta = False, "", text     # no leading tag: the text read for markers
        window = self.tag + delta       # a marker ending in delta begins here: before the tag is whitespace
        at = _first(window, self.p.markers)
        if at >= 0:
            return self._begin(window, at)
        k = max((k for m in self.p.markers for k in range(1, len(m)) if window.endswith(m[:k])), default=0)
        rest, self.tag = window[:len(window) - k], window[len(window) - k:]
        kept = rest.rstrip()
        if not kept:
            self.space.append(rest)
            return ""
        content = "".join(self.space) + kept
        self.space, self.sent = [rest[len(kept):]], self.sent + len(content)
        return content

    def _begin(self, window: str, at: int) -> str:
        """The calls begin at ``window[at]`` (``window``: the text's end, after the held whitespace); the content
        before them, unless that is only whitespace."""
        self.start = self.size - len(window) + at
        content = ""
        if self.sent or window[:at].strip():
            content, self.sent = "".join(self.space) + window[:at], self.start
        self.space, self.tag = [], ""
        self._blocks(window[at:])
        return content

    def _blocks(self, text: str) -> None:
        """Read ``text``, the next of the calls' text, for the blocks it closes; their calls join :attr:`calls`
        until a block is not a call (formats with blocks; in the others the calls are known at the end)."""
        if self.p.block is None:
            return
        opening, closing = self.p.block
        while not self.stopped:
            tag = opening if self.body is None else closing
            window = self.tail + text
            at = _first(window, (tag,))
            if at < 0:
                if self.body is not None:
                    self.body.append(text)
                    self.body_size += len(text)
                self.tail = window[max(0, len(window) - len(tag) + 1):]
                return
            if self.body is None:
                self.body, self.body_size = [], 0
            else:
                end = self.body_size - len(self.tail) + at
                call = _call(_load(("".join(self.body) + text)[:end]))
                self.body, self.stopped = None, call is None
                if call is not None:
                    self.calls.append(call)
            self.tail, text = "", window[at + len(tag):]

    def _new(self, calls: list[ToolCall]) -> list[ToolCall]:
        new = calls[self.done:]
        self.done = max(self.done, len(calls))
        return new


def _first(text: str, tags: tuple[str, ...]) -> int:
    """Where the first of ``tags`` in ``text`` begins, or -1."""
    return min((i for t in tags if (i := text.find(t)) >= 0), default=-1)


def _skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


def _load(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(obj) -> ToolCall | None:
    """A call from a decoded JSON value ``{"name": ..., "arguments" (or "parameters"): {...}}``, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):           # some models write the arguments as JSON text
        args = _load(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
