"""The package layering (docs/architecture.md, 'Package layering'), read from the source with ``ast``.

Every import counts: at file level, inside a function, under ``if TYPE_CHECKING:``, ``import x`` and
``from x import y``, relative ones resolved, and ``importlib.import_module`` / ``__import__`` of a literal name.
A package is a folder of ``vlora/``; the modules at the top (``vlora/config.py``, ``vlora/cli.py``, ...) belong
to none.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "vlora"
ENGINE_MUST_NOT_IMPORT = ("parallel", "cluster", "server", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute name) of every import in ``source``, the source of ``module``. ``from a import b`` gives
    ``a.b`` (b may be a module; a name inside ``a`` still lands in ``a``'s package)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.extend((node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base)
                         for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def package_of(name: str) -> str | None:
    """The package of ``vlora`` that the dotted ``name`` lies in; None outside vlora or at its top."""
    parts = name.split(".")
    if parts[0] != "vlora" or len(parts) < 2 or not (ROOT / parts[1]).is_dir():
        return None
    return parts[1]


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> ``module:line imports name`` for every import across packages."""
    edges = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        src = package_of(module) if path.parent != ROOT else None      # the top-level modules: no package
        if src is None:
            continue
        found = imported_names(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
        for line, name in sorted(found):
            dst = package_of(name)
            if dst is not None and dst != src:
                edges[src, dst].append(f"{module}:{line} imports {name}")
    return edges


EDGES = package_imports()
PACKAGES = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


PAIRS = list(itertools.combinations(PACKAGES, 2))


@pytest.mark.parametrize("a,b", PAIRS, ids=[f"{a}<->{b}" for a, b in PAIRS])
def test_no_two_packages_import_each_other(a, b):
    ab, ba = EDGES.get((a, b), []), EDGES.get((b, a), [])
    assert not (ab and ba), (f"vlora.{a} and vlora.{b} import each other; one of them must stop:\n  "
                             + "\n  ".join(ab + ba))


@pytest.mark.parametrize("upper", ENGINE_MUST_NOT_IMPORT)
def test_the_engine_imports_nothing_above_it(upper):
    found = EDGES.get(("engine", upper), [])
    assert not found, f"vlora.engine imports vlora.{upper}:\n  " + "\n  ".join(found)


def test_the_walk_sees_every_kind_of_import():
    src = '''
from typing import TYPE_CHECKING
import vlora.memory.pool
from vlora.kernels import atmm
from . import batch
from .. import config
from ..models.decoder import DecoderLM
if TYPE_CHECKING:
    from vlora.engine.plan import StepPlan
def f():
    from vlora.parallel.model import ShardModes
    import importlib
    return importlib.import_module("vlora.cluster.front"), __import__("vlora.bench")
'''
    names = {n for _, n in imported_names(src, "vlora.lora.layers", is_package=False)}
    assert {package_of(n) for n in names} - {None} == {"memory", "kernels", "lora", "models", "engine", "parallel",
                                                       "cluster", "bench"}
    assert {"vlora.lora.batch", "vlora.config", "vlora.models.decoder.DecoderLM"} <= names
    init = {n for _, n in imported_names("from .pool import UnifiedPool", "vlora.memory", is_package=True)}
    assert init == {"vlora.memory.pool.UnifiedPool"}
    assert package_of("vlora.config") is None and package_of("torch.nn") is None
    assert len(PACKAGES) >= 8 and ("lora", "kernels") in EDGES      # the walk found the real tree
