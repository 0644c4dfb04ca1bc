"""Turn a request body into a JSON object, refusing what would be costly or unsafe to handle later.

The body must be UTF-8 JSON (RFC 8259), an object, nested at most ``max_depth`` levels
(checked on the raw bytes before parsing, so a body nested 100,000 levels deep costs one
vectorised scan instead of a RecursionError), and free of lone UTF-16 surrogates
(``"\\ud800"`` escapes decode to text no tokenizer, path or JSON encoder accepts).
Errors name the field and quote at most :data:`QUOTE_CHARS` characters of what was sent.
"""

from __future__ import annotations

import json
import re

import numpy as np

QUOTE_CHARS = 100           # most characters of a user's value an error message quotes

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')          # a JSON string literal, escapes included
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


class BodyError(ValueError):
    """A body refused before validation: ``status`` (400), a message, and the field when one is known."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def quote(value, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (with the total length when cut): safe to echo back."""
    text = repr(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(value) if isinstance(value, (str, bytes, list, dict)) else len(text)} long)"
    return text


def nesting_depth(body: bytes) -> int:
    """Deepest nesting of arrays and objects in a JSON text (brackets inside strings do not count)."""
    bare = np.frombuffer(_STRING.sub(b"", body), dtype=np.uint8)
    if bare.size == 0:
        return 0
    step = np.isin(bare, _OPEN).astype(np.int64) - np.isin(bare, _CLOSE)
    return int(np.cumsum(step).max(initial=0))


def parse_json(body: bytes, max_depth: int) -> dict:
    """The body as a JSON object, or BodyError (not UTF-8, too deep, not JSON, not an object, a lone surrogate)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not valid JSON: not UTF-8 at byte {e.start}", code="invalid_json") from None
    depth = nesting_depth(body)
    if depth > max_depth:
        raise BodyError(f"request body is nested {depth} levels deep; the limit is {max_depth}", code="invalid_json")
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise BodyError(f"request body is not valid JSON ({quote(str(e), 200)[1:-1]})", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise BodyError(f"request body must be a JSON object, got {type(obj).__name__}")
    if _SURROGATE_ESCAPE.search(text):                    # fast path: no escape, no surrogate
        where = find_surrogate(obj)
        if where is not None:
            raise BodyError(f"{where or 'a field name'} holds a lone UTF-16 surrogate: text must be valid Unicode",
                            param=where or None)
    return obj


def find_surrogate(obj, path: str = "") -> str | None:
    """Path (``messages[0].content``) of the first string or key holding a lone surrogate, else None."""
    if isinstance(obj, str):
        return path if _has_surrogate(obj) else None
    if isinstance(obj, list):
        for i, x in enumerate(obj):
            if (hit := find_surrogate(x, f"{path}[{i}]")) is not None:
                return hit
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if _has_surrogate(k):
                return path
            if (hit := find_surrogate(v, f"{path}.{k}" if path else k)) is not None:
                return hit
    return None


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
