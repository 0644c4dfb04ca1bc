"""Each implementation of EngineClient has every member of the protocol, of the same kind (property, attribute,
method, coroutine, async generator) and with a compatible signature; the server uses nothing else."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from vlora.cluster.front import ClusterFront
from vlora.engine.async_engine import AsyncEngine
from vlora.engine.client import EngineClient
from vlora.engine.process_client import EngineProcess

IMPLEMENTATIONS = [AsyncEngine, EngineProcess, ClusterFront]
_MISSING, _ANNOTATED = object(), object()      # no such member; a data attribute declared on the class


def protocol_members(proto) -> dict[str, object]:
    """Name -> the protocol's definition (_ANNOTATED for a declared attribute)."""
    members = {n: v for n, v in vars(proto).items() if not n.startswith("_")}
    members.update({n: _ANNOTATED for n in proto.__annotations__ if n not in members})
    return members


def definition(cls, name: str):
    """What ``cls`` (or the first base that has it) defines ``name`` as: a class attribute, _ANNOTATED, or
    _MISSING."""
    for base in cls.__mro__:
        if name in vars(base):
            return vars(base)[name]
        if name in getattr(base, "__annotations__", {}):
            return _ANNOTATED
    return _MISSING


def kind(obj) -> str:
    if obj is _ANNOTATED:
        return "attribute"
    if isinstance(obj, property):
        return "property"
    if inspect.isasyncgenfunction(obj):
        return "async generator"
    if inspect.iscoroutinefunction(obj):
        return "coroutine"
    if inspect.isfunction(obj):
        return "method"
    return type(obj).__name__


def signature_problems(want: inspect.Signature, got: inspect.Signature) -> list[str]:
    """Why a call written against ``want`` could fail on ``got`` (or its annotations differ)."""
    problems = []
    params = list(got.parameters.values())
    for i, p in enumerate(want.parameters.values()):
        q = got.parameters.get(p.name)
        if q is None:
            problems.append(f"no parameter {p.name!r}")
            continue
        if q.kind != p.kind or (p.kind is p.POSITIONAL_OR_KEYWORD and params.index(q) != i):
            problems.append(f"parameter {p.name!r} is {q.kind.description} at {params.index(q)}, "
                            f"not {p.kind.description} at {i}")
        if p.default is not p.empty and q.default is q.empty:
            problems.append(f"parameter {p.name!r} has no default")
        if p.annotation is not p.empty and q.annotation is not q.empty and p.annotation != q.annotation:
            problems.append(f"parameter {p.name!r} is {q.annotation}, not {p.annotation}")
    for q in params:
        if q.name not in want.parameters and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            problems.append(f"extra parameter {q.name!r} has no default")
    if want.return_annotation is not want.empty and got.return_annotation is not got.empty \
            and want.return_annotation != got.return_annotation:
        problems.append(f"returns {got.return_annotation}, not {want.return_annotation}")
    return problems


def annotation(cls, name: str) -> str | None:
    for base in cls.__mro__:
        if name in getattr(base, "__annotations__", {}):
            return base.__annotations__[name]
    return None


def conformance(cls, proto=EngineClient) -> list[str]:
    """What ``cls`` lacks or gets wrong of ``proto``; empty when it implements it."""
    problems = []
    for name, want in protocol_members(proto).items():
        got = definition(cls, name)
        if got is _MISSING:
            problems.append(f"{name}: missing")
            continue
        wk, gk = kind(want), kind(got)
        if wk == "property":
            # a read-only property is satisfied by a property or by a data attribute
            if gk not in ("property", "attribute"):
                problems.append(f"{name}: a {gk}, not a property")
                continue
            want_type = inspect.signature(want.fget).return_annotation
            got_type = annotation(cls, name) if gk == "attribute" else inspect.signature(got.fget).return_annotation
            if got_type not in (None, inspect.Signature.empty) and got_type != want_type:
                problems.append(f"{name}: {got_type}, not {want_type}")
        elif wk == "attribute":
            # the server sets it: a declared attribute, or a property with a setter
            if not (gk == "attribute" or (gk == "property" and got.fset is not None)):
                problems.append(f"{name}: a {gk}, not a writable attribute")
            elif gk == "attribute" and annotation(cls, name) != proto.__annotations__[name]:
                problems.append(f"{name}: {annotation(cls, name)}, not {proto.__annotations__[name]}")
        elif wk != gk:
            problems.append(f"{name}: a {gk}, not a {wk}")
        else:
            problems += [f"{name}: {p}" for p in signature_problems(inspect.signature(want), inspect.signature(got))]
    return problems


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_implementation_matches_the_protocol(cls):
    assert conformance(cls) == []


def test_the_check_finds_a_missing_member_and_a_wrong_kind():
    class Broken(AsyncEngine):
        def submit(self, jobs, on_finish=None):             # not a coroutine
            return None

        def shutdown(self, timeout):                          # not a coroutine, and no default
            return True

        @property
        def on_fatal(self):                                    # the server cannot set it
            return None

    class Extra(EngineClient):
        async def drain(self) -> None:
            """A member added to the protocol."""

    assert sorted(conformance(Broken)) == ["on_fatal: a property, not a writable attribute",
                                           "shutdown: a method, not a coroutine", "submit: a method, not a coroutine"]
    assert conformance(AsyncEngine, Extra) == ["drain: missing"]


def test_a_signature_change_is_found():
    class Changed(AsyncEngine):
        async def unload_adapter(self, name: str, policy: str, force: bool) -> int:
            return 0

    assert sorted(conformance(Changed)) == ["unload_adapter: extra parameter 'force' has no default",
                                            "unload_adapter: parameter 'policy' has no default"]


def _server_uses() -> set[str]:
    """The attributes the server reads or calls on the engine it serves (``self.engine.X`` and
    ``server.engine.X`` in app.py, ``client.X`` in serve, ``engine.X`` in metrics.py)."""
    root = Path(__file__).resolve().parents[2] / "vlora" / "server"
    used = set()
    for path, names in ((root / "app.py", {"client"}), (root / "metrics.py", {"engine"})):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in names:
                used.add(node.attr)
            elif isinstance(v, ast.Attribute) and v.attr == "engine" and isinstance(v.value, ast.Name) \
                    and v.value.id in ("self", "server"):
                used.add(node.attr)
    return used


def test_the_server_uses_only_the_protocol():
    used = _server_uses()
    assert {"submit", "info", "accepting", "on_fatal"} <= used          # the scan sees the server's calls
    assert used <= set(protocol_members(EngineClient))
