"""Tool calls in a model's answer: one parser per output format, for whole answers and for streams.

Formats (``--tool-call-parser``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and the system-prompt fallback of models whose template shows no tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, after optional text;
- ``llama3_json`` (Llama 3.1 to 3.3): the whole answer is ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``; several calls are separated by ``;``;
- ``mistral``, by the tokenizer's version: before v11 (Mistral 7B v0.3, Nemo),
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; from v11 (Mistral Small 3.1 and later, Magistral,
  Devstral), one call per marker, ``[TOOL_CALLS]name[ARGS]{...}``, or ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``.
  The tags are special tokens that the answer's text leaves out, so an answer that starts with the JSON array, or
  with a function name and its arguments (``name{...}``, several in a row), is taken too.

``arguments`` and ``parameters`` are taken in every format. Text that is not a well-formed call stays the
answer's content; in the formats of one block per call (hermes, mistral's ``name[ARGS]{...}``) the calls before
such a block stand, since a stream has sent them by then.
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


class Reader:
    """A stream's reader of its calls' text, piece by piece from where they begin: :attr:`calls` holds those
    complete so far. This one completes none: in the JSON formats the calls are known once the answer is."""

    def __init__(self):
        self.calls: list[ToolCall] = []

    def read(self, text: str) -> None:
        """Take ``text``, the next piece of the calls' text."""


class Parser:
    """One output format. ``markers`` open the calls anywhere in the answer; ``leading`` only at its start (after
    whitespace). Tags begin with, and hold, no whitespace."""

    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()

    def start(self, text: str) -> int | None:
        """Where the calls begin in ``text``, or None if they have not begun."""
        body = text.lstrip()
        if self.leads(body):
            return len(text) - len(body)
        at = _first(text, self.markers)
        return None if at < 0 else at

    def leads(self, text: str) -> bool | None:
        """Whether the calls begin at the start of ``text`` (an answer from its first non-whitespace character):
        None while ``text`` is too short to tell."""
        if text.startswith(self.leading):
            return True
        return None if any(t.startswith(text) for t in self.leading) else False

    def calls(self, region: str) -> list[ToolCall] | None:
        """The calls in ``region`` (the whole answer from :meth:`start` on), or None if it is not a sequence of
        well-formed calls."""
        raise NotImplementedError

    def reader(self) -> Reader:
        """What reads a stream's calls as they come, to send each once it is complete."""
        return Reader()


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

    def reader(self) -> Reader:
        return Blocks(*self.block)


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
    """Mistral's two formats, told apart by what follows the first marker: a JSON array of calls (known once the
    answer is complete), or calls written ``name[ARGS]{...}`` (:class:`NamedCalls`: each streamed once its
    arguments close). With the tags left out of the text, the calls begin at the answer's start only; a call id
    then runs into the name before it, which cannot be told apart."""

    tag = "[TOOL_CALLS]"
    markers = (tag,)
    leading = (tag, "[")
    array = True

    def leads(self, text: str) -> bool | None:
        found = (super().leads(text), _leads_named(text))
        return True if True in found else None if None in found else False

    def calls(self, region: str) -> list[ToolCall] | None:
        body = region.lstrip()
        body = body[len(self.tag):].lstrip() if body.startswith(self.tag) else body
        return super().calls(region) if body.startswith("[") else _named_calls(region)

    def reader(self) -> Reader:
        return NamedCalls()


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
    back is whitespace (in pieces) and, after it, the start of a tag (or of a leading function name); after, the
    parser's :class:`Reader` keeps what it needs."""

    def __init__(self, p: Parser):
        self.p = p
        self.pieces: list[str] = []         # the answer's text so far
        self.size = 0                       # its length
        self.sent = 0                       # characters of it sent as content
        self.space: list[str] = []          # held whitespace, at the end of the text (before the calls begin)
        self.tag = ""                       # held text after it: the start of a marker or of a leading tag
        self.leading = bool(p.leading)      # a leading tag may still begin the answer
        self.start: int | None = None       # where the calls begin
        self.reader = p.reader()            # the calls' text, once they begin
        self.done = 0                       # calls sent

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to send, calls completed) after ``delta``."""
        self.pieces.append(delta)
        self.size += len(delta)
        if self.start is not None:
            self.reader.read(delta)
            return "", self._new(self.reader.calls)
        return self._before(delta), self._new(self.reader.calls)

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
            leads = self.p.leads(text)
            if leads:
                return self._begin(text, 0)
            if leads is None and _first(text, self.p.markers) < 0:
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
        self.reader.read(window[at:])
        return content

    def _new(self, calls: list[ToolCall]) -> list[ToolCall]:
        new = calls[self.done:]
        self.done = max(self.done, len(calls))
        return new


class Blocks(Reader):
    """Calls in blocks between an ``opening`` and a ``closing`` tag (hermes): each is decoded once its block
    closes, until one is not a call. Kept: the text's end, where a tag may begin, and the open block's text (in
    pieces)."""

    def __init__(self, opening: str, closing: str):
        super().__init__()
        self.tags = (opening, closing)
        self.tail = ""                      # the text's end, where a tag may begin
        self.body: list[str] | None = None  # the open block's text so far; None between blocks
        self.body_size = 0                  # its length
        self.stopped = False                # a block was not a call: no more calls go out before the end

    def read(self, text: str) -> None:
        opening, closing = self.tags
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


class NamedCalls(Reader):
    """Mistral's calls written ``name[ARGS]{...}`` (v11 on): each is decoded once its arguments' object closes,
    until one is not a call. Kept: the text since the last call (its head) until an object opens, then the
    object's text (in pieces) and where the scan of its braces stands."""

    def __init__(self):
        super().__init__()
        self.head: list[str] = []           # the text since the last call, no object open
        self.name: str | None = None        # the open call's name
        self.body: list[str] = []           # its arguments' text so far
        self.braces = _Braces()             # the scan of its braces
        self.stopped = False                # a call was malformed: no more calls go out before the end

    def read(self, text: str) -> None:
        while text and not self.stopped:
            if self.name is None:
                at = text.find("{")
                if at < 0:
                    self.head.append(text)
                    return
                head = _HEAD.fullmatch("".join(self.head) + text[:at])
                self.head, self.stopped = [], head is None
                if head is None:
                    return
                self.name, self.braces, text = head[1], _Braces(), text[at:]
            end = self.braces.end(text)
            if end < 0:
                self.body.append(text)
                return
            call = _named(self.name, _load("".join(self.body) + text[:end]))
            self.name, self.body, self.stopped, text = None, [], call is None, text[end:]
            if call is not None:
                self.calls.append(call)


class _Braces:
    """A scan of a JSON object's text, piece by piece, for where it ends: the depth of its braces outside
    strings."""

    # a backslash and the character it escapes (in the next piece when it ends this one), a brace, a quote
    _SYNTAX = re.compile(r'\\.?|[{}"]', re.DOTALL)

    def __init__(self):
        self.depth = 0
        self.quoted = False                 # inside a string
        self.escaped = False                # the last piece ended in a backslash: it escapes the next character

    def end(self, text: str) -> int:
        """Where the object ends in ``text``, its next piece (just after its closing brace), or -1."""
        pos, self.escaped = int(self.escaped), False
        for m in self._SYNTAX.finditer(text, pos):
            c = m.group()
            if c[0] == "\\":
                self.escaped = len(c) == 1
            elif c == '"':
                self.quoted = not self.quoted
            elif not self.quoted:
                self.depth += 1 if c == "{" else -1
                if self.depth == 0:
                    return m.end()
        return -1


_NAME = "[A-Za-z0-9_-]{1,64}"       # a function name as tools' names are checked
_NAME_AT = re.compile(_NAME)
# what comes before a call's arguments in mistral's v11 format, each tag optional (left out of the text)
_HEAD = re.compile(rf"\s*(?:\[TOOL_CALLS\]\s*)?({_NAME})(?:\[CALL_ID\][A-Za-z0-9]+)?(?:\[ARGS\])?")
_AFTER_NAME = ("{", "[ARGS]", "[CALL_ID]")


def _leads_named(text: str) -> bool | None:
    """Whether ``text`` starts with a call written ``name[ARGS]{...}``, its marker left out (None: it may yet)."""
    name = _NAME_AT.match(text)
    if name is None:
        return False
    rest = text[name.end():]
    if rest.startswith(_AFTER_NAME):
        return True
    return None if any(t.startswith(rest) for t in _AFTER_NAME) else False      # rest "": the name may go on


def _named_calls(region: str) -> list[ToolCall] | None:
    """The calls written ``name[ARGS]{...}`` in ``region``, up to the first that is not one (None: no call)."""
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while (brace := region.find("{", pos)) >= 0 and (head := _HEAD.fullmatch(region, pos, brace)):
        try:
            args, pos = decoder.raw_decode(region, brace)
        except ValueError:
            break
        call = _named(head[1], args)
        if call is None:
            break
        calls.append(call)
    return calls or None


def _named(name: str, args) -> ToolCall | None:
    """A call of ``name`` with ``args`` (a decoded JSON value), if they are an object."""
    return ToolCall(name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


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
