"""The model registry: one table from model_type to builder, and no import cycles among the model modules."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from vlora.models import registry


def test_every_architecture_names_a_builder_that_exists():
    for model_type, arch in registry.ARCHITECTURES.items():
        assert callable(arch.build()), model_type
    for spec, (module, fn) in registry.NAMED_MODELS.items():
        assert callable(getattr(__import__(module, fromlist=[fn]), fn)), spec


def test_an_unsupported_model_type_names_the_supported_ones(tmp_path):
    from vlora.models.locate import locate_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(registry.UnsupportedArchitecture, match=r"'gpt2' is not supported.*gemma3_text.*qwen3"):
        locate_model(str(tmp_path))


def test_the_model_modules_import_without_cycles():
    """Every import among vlora/models/*.py (at module level or inside functions) points one way: the graph has
    no cycle, and the registry imports no vlora module (it names builders by module and function)."""
    models = Path(registry.__file__).parent
    graph = {}
    for f in models.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlora.models."):
                deps.add(node.module.removeprefix("vlora.models."))
            elif isinstance(node, ast.ImportFrom) and node.module == "vlora.models":
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name.removeprefix("vlora.models.") for a in node.names
                            if a.name.startswith("vlora.models."))
        graph[f.stem] = deps
    assert not any(n.module and n.module.startswith("vlora") for n in ast.walk(ast.parse(Path(registry.__file__)
                   .read_text())) if isinstance(n, ast.ImportFrom))
    done, path = set(), []

    def visit(m):
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done:
            return
        path.append(m)
        for d in graph.get(m, ()):
            visit(d)
        path.pop()
        done.add(m)

    for m in graph:
        visit(m)
