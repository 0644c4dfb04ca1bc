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
    whitespace)."""

    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()

    def start(self, text: str) -> int | None:
        """Where the calls begin in ``text``, or None if they have not begun."""
        body = text.lstrip()
        if self.leading and body.startswith(self.leading):
            return len(text) - len(body)
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found, default=None)

    def hold(self, text: str) -> int:
        """Characters at the end of ``text`` (in which no call has begun) that may still begin one, and the
        whitespace before them (dropped if a call follows): a stream holds them back until it knows."""
        body = text.lstrip()
        if self.leading and (not body or any(m.startswith(body) for m in self.leading)):
            return len(text)
        k = max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        return len(text) - len(text[:len(text) - k].rstrip())

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        """The calls in ``region`` (the answer from :meth:`start` on). ``final`` (the whole answer): None if it is
        not a sequence of well-formed calls; else (a stream's text so far) the calls complete so far."""
        raise NotImplementedError


class HermesParser(Parser):
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        calls = []
        for block in self._BLOCK.finditer(region):
            closed = block.group(0).endswith("</tool_call>")
            call = _call(_load(block.group(1))) if closed or final else None
            if call is None:            # unfinished, or not a call: the calls before it stand, if there are any
                return calls if calls or not final else None
            calls.append(call)
        return calls


class JSONParser(Parser):
    """Calls written as JSON at the start of the answer, after an optional ``tag``: objects separated by ``;``
    (llama3_json), or one array of them (``array``: mistral). They are known only once the answer is complete:
    text after them makes them no calls."""

    tag = ""
    array = False

    def calls(self, region: str, final: bool) -> list[ToolCall] | None:
        if not final:
            return []
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
    calls = None if start is None else p.calls(text[start:], final=True)
    if not calls:
        return text, []
    return (text[:start] if text[:start].strip() else None), calls


class ToolStream:
    """One streamed answer: its text goes out as content until its calls begin (text that may begin one is held
    back until it is known not to), then each call goes out once it is complete."""

    def __init__(self, p: Parser):
        self.p, self.text, self.sent, self.start, self.done = p, "", 0, None, 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to send, calls completed) after ``delta``."""
        self.text += delta
        if self.start is None:
            self.start = self.p.start(self.text)
            if self.start is None:
                return self._content(len(self.text) - self.p.hold(self.text)), []
        content = self._content(self.start) if self.text[:self.start].strip() else ""   # whitespace: no content
        return content, self._new(self.p.calls(self.text[self.start:], final=False))

    def finish(self) -> tuple[str, list[ToolCall], bool]:
        """(content to send, calls not sent yet, whether the answer made calls) once the answer is complete."""
        if self.start is None:
            return self._content(len(self.text)), [], False
        calls = self.p.calls(self.text[self.start:], final=True)
        if calls is None and not self.done:         # not calls after all: the held text is content
            return self._content(len(self.text)), [], False
        return "", self._new(calls or []), True

    def _content(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def _new(self, calls: list[ToolCall]) -> list[ToolCall]:
        new = calls[self.done:]
        self.done = max(self.done, len(calls))
        return new


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
