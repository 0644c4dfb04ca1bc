"""Fixtures of the model tests: a pre-filled Hugging Face Hub cache, offline."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.helpers import make_peft_adapter, make_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"


def put_in_hub_cache(cache: Path, repo: str, src: Path, commit: str, refs=("main",)) -> Path:
    """Lay out ``src``'s files as huggingface_hub does: blobs by content hash, snapshot symlinks, refs."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for f in src.iterdir():
        data = f.read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (folder / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hub cache in a temporary HF_HOME holding org/tiny (two commits: main and tag v1) and the
    adapter org/tiny-lora; returns (cache, local model dir, local adapter dir)."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    cache = home / "hub"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))    # read at import: point it at this test's cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    local = tmp_path / "local"
    path, hf = make_tiny_model(local)
    adapter = make_peft_adapter(hf, local / "lora", rank=8, seed=3)
    put_in_hub_cache(cache, "org/tiny", path, COMMIT)
    other, _ = make_tiny_model(local, name="other", seed=1)
    put_in_hub_cache(cache, "org/tiny", other, OTHER, refs=("v1",))
    put_in_hub_cache(cache, "org/tiny-lora", adapter, COMMIT)
    return cache, path, adapter
