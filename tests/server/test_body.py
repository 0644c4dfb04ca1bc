"""Body parsing without a server: nesting depth on raw bytes, UTF-8, lone surrogates, quoting user values."""

from __future__ import annotations

import json

import pytest

from vlora.server.body import BodyError, find_surrogate, nesting_depth, parse_json, quote


@pytest.mark.parametrize("text,depth", [
    ("{}", 1), ('{"a": [1, {"b": []}]}', 4), ("[" * 5000 + "]" * 5000, 5000), ('"[[["', 0),
    ('{"a": "x\\"[[[\\\\", "b": [[]]}', 3),          # brackets after escaped quotes and backslashes are in strings
    ("[[]][[[]]]", 3), ("", 0),
])
def test_nesting_depth_ignores_brackets_inside_strings(text, depth):
    assert nesting_depth(text.encode()) == depth
    if 0 < depth < 100:                             # the same as the parsed value's depth
        try:
            value = json.loads(text)
        except ValueError:
            return
        assert _depth(value) == depth


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    return 0


@pytest.mark.parametrize("body,contains", [
    (b'{"a": "\xff"}', "not UTF-8 at byte 7"),
    (b"[" * 100_000 + b"]" * 100_000, "nested 100000 levels"),
    (b'{"a": ', "not valid JSON"),
    (b"[1]", "must be a JSON object"),
    (b'{"a": "' + b"1" * 5000 + b'", "b": ' + b"9" * 5000 + b"}", "not valid JSON"),    # past int digit limit
])
def test_bad_bodies(body, contains):
    with pytest.raises(BodyError, match=contains):
        parse_json(body, max_depth=32)


def test_lone_surrogates_are_found_with_their_path():
    with pytest.raises(BodyError, match="messages\\[1\\].content holds a lone UTF-16 surrogate") as e:
        parse_json(b'{"messages": [{"content": "ok"}, {"content": "a\\ud800"}]}', 32)
    assert e.value.param == "messages[1].content"
    assert find_surrogate({"a": {"\udfff": 1}}) == "a"                    # a key: its parent's path
    # a pair is one character, escaped or not
    assert parse_json(json.dumps({"p": "\U0001f600"}).encode(), 32) == {"p": "\U0001f600"}


def test_quote_cuts_long_values():
    assert quote("abc") == "'abc'"
    q = quote("x" * 10_000)
    assert len(q) < 130 and q.endswith("(10000 long)")
    assert quote(2**70) == str(2**70)
