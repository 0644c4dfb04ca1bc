"""Hub ids (org/name[@revision]) for models and adapters, served offline from a pre-filled Hub cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import make_tiny_model
from tests.models.conftest import COMMIT, OTHER
from vlora import LLM, SamplingParams
from vlora.models.hub import HubError, display_name, parse_hub_id
from vlora.models.loader import resolve_model_dir

SP = SamplingParams(max_tokens=6, ignore_eos=True)


def test_hub_ids_parse_and_local_paths_win(tmp_path, monkeypatch):
    assert parse_hub_id("org/name") == ("org/name", None)
    assert parse_hub_id("org/name@v1.2") == ("org/name", "v1.2")
    for not_hub in (None, "random:tiny-llama", "demo:smollm2-llava", "/abs/path", "./rel/x", "a/b/c", "name"):
        assert parse_hub_id(not_hub) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    path, _ = make_tiny_model(tmp_path / "org", name="name")
    assert parse_hub_id("org/name") is None                  # a local directory of that name wins
    assert resolve_model_dir("org/name") == Path("org/name")


def test_model_and_adapter_from_the_hub_cache_offline(hub):
    cache, path, adapter = hub
    snap = resolve_model_dir("org/tiny")
    assert snap == cache / "models--org--tiny" / "snapshots" / COMMIT
    assert display_name(snap) == "org/tiny"
    from_hub = LLM("org/tiny", adapters={"a": "org/tiny-lora"}, num_blocks=16)
    local = LLM(str(path), adapters={"a": str(adapter)}, num_blocks=16)
    assert from_hub.engine.model_name == "org/tiny"
    prompts, names = [[1, 2, 3], [5, 6, 7, 8]], [None, "a"]
    got = [o.token_ids for o in from_hub.generate(prompts, names, SP)]
    assert got == [o.token_ids for o in local.generate(prompts, names, SP)]


def test_revision_pins_a_branch_tag_or_commit(hub):
    cache, _, _ = hub
    snaps = cache / "models--org--tiny" / "snapshots"
    assert resolve_model_dir("org/tiny@main") == snaps / COMMIT
    assert resolve_model_dir("org/tiny@v1") == snaps / OTHER
    assert resolve_model_dir(f"org/tiny@{OTHER}") == snaps / OTHER


def test_uncached_id_offline_is_a_clear_error_naming_it(hub):
    with pytest.raises(HubError, match=r"model 'org/absent'.*not in the Hugging Face cache.*offline"):
        resolve_model_dir("org/absent")
    with pytest.raises(HubError, match=r"model 'org/tiny@v9'.*offline"):
        resolve_model_dir("org/tiny@v9")
    llm = LLM("org/tiny", num_blocks=16)
    with pytest.raises(HubError, match=r"adapter 'org/absent-lora'"):
        llm.register_adapter("b", "org/absent-lora")


def test_server_loads_hub_adapters_only_when_allowed(hub):
    from fastapi.testclient import TestClient

    from vlora.config import ServerConfig
    from vlora.server.app import build_app

    engine = LLM("org/tiny", num_blocks=16).engine
    with TestClient(build_app(engine, ServerConfig())) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "org/tiny-lora"})
        assert r.status_code == 403 and "--allow-hub-adapters" in r.json()["error"]["message"]
    with TestClient(build_app(engine, ServerConfig(allow_hub_adapters=True))) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "org/absent-lora"})
        assert r.status_code == 404 and "'org/absent-lora'" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/not/a/hub/id"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "org/tiny-lora"})
        assert r.status_code == 200
        r = client.post("/v1/completions", json={"model": "a", "prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200
