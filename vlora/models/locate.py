"""Where a model or adapter argument points, checked before any weights load.

``locate_model`` and ``locate_adapter`` turn a command-line argument (a local path, or a Hub id, which is
downloaded into the Hub cache here) into a local directory and check that it is what the argument claims:
a model directory with a ``config.json`` of a supported architecture, a ``.gguf`` file, or a PEFT adapter
directory with its config and safetensors weights. Errors are one line naming the value.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vlora.models.hub import parse_hub_id, resolve_adapter_dir, snapshot_dir
from vlora.models.lmm import RANDOM_LMMS
from vlora.models.loader import RANDOM_PRESETS
from vlora.models.registry import NAMED_MODELS, architecture_of, check_supported


class LocateError(ValueError):
    """An argument that does not point at a usable model or adapter."""


def locate_model(model: str | None) -> str | None:
    """``model`` with a Hub id replaced by its snapshot directory; the embedded default (None), ``random:`` and
    ``demo:`` specs and ``.gguf`` files pass through (they are built or converted when the engine loads)."""
    if model is None or model in NAMED_MODELS:
        return model
    if model.startswith("random:"):
        known = (*RANDOM_PRESETS, *RANDOM_LMMS)
        if model.removeprefix("random:") not in known:
            raise LocateError(f"{model}: unknown random model (known: {', '.join('random:' + k for k in known)})")
        return model
    path = snapshot_dir(model, "model") if parse_hub_id(model) else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if not path.exists():
        raise LocateError(f"{model}: no such file or directory")
    if not path.is_dir():
        raise LocateError(f"{model}: neither a model directory, a .gguf file nor a Hub id (org/name[@revision])")
    if not (path / "config.json").is_file():
        raise LocateError(f"{model}: the directory has no config.json")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LocateError(f"{model}: config.json cannot be read ({e})") from None
    check_supported(architecture_of(config), where=model)
    return str(path)


def locate_adapter(spec: str | os.PathLike) -> Path:
    """The PEFT adapter directory of ``spec`` (a path or a Hub id), with its config and weights present."""
    path = resolve_adapter_dir(spec)
    if not path.is_dir():
        raise LocateError(f"{spec}: no such directory" if not path.exists() else f"{spec}: not a directory")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / name).is_file():
            raise LocateError(f"{spec}: the directory has no {name}")
    return path


def locate_dir(path: str) -> str:
    """``path`` when it is an existing directory."""
    if not os.path.isdir(path):
        raise LocateError(f"{path}: no such directory" if not os.path.exists(path) else f"{path}: not a directory")
    return path
