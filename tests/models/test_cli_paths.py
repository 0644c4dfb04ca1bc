"""`vlora serve|generate|bench` check their path arguments before any weights load; Hub ids through the CLI."""

from __future__ import annotations

import pytest

from vlora import cli


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if a command gets as far as building an engine."""
    def refuse(*a, **k):
        raise AssertionError("the engine was built before the arguments were checked")

    monkeypatch.setattr("vlora.engine.engine.Engine.__init__", refuse)


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--model", "/no/such/model"], "--model"),
    (["generate", "--model", "/no/such/model"], "--model"),
    (["bench", "--model", "/no/such/model"], "--model"),
    (["serve", "--adapter", "sql=/adapters/sql"], "--adapter sql"),
    (["generate", "--adapter", "sql=/adapters/sql"], "--adapter sql"),
    (["serve", "--image-dir", "/no/such/images"], "--image-dir"),
    (["serve", "--adapter-dir", "/no/such/adapters"], "--adapter-dir"),
    (["bench", "--model", "random:no-such-preset"], "--model"),
    (["bench", "--model", "random:tiny-llama", "--workload", "trace", "--trace", "/no/trace.csv"], "--trace"),
])
def test_bad_paths_fail_fast_with_one_line_naming_the_argument(argv, flag, no_engine, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}: ")


def test_model_and_adapter_dirs_must_hold_their_files(tmp_path, no_engine, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text('{"model_type": "gpt2"}')
    for argv, msg in ((["serve", "--model", str(tmp_path / "m")], "has no config.json"),
                      (["serve", "--model", str(tmp_path / "gpt")], "model_type 'gpt2' is not supported"),
                      (["serve", "--adapter", f"x={tmp_path / 'a'}"], "has no adapter_model.safetensors"),
                      (["generate", "--adapter", "x=org/absent-lora"], "adapter 'org/absent-lora'")):
        assert cli.main(argv) == 2
        assert msg in capsys.readouterr().err


def test_uncached_hub_ids_fail_fast_offline(hub, no_engine, capsys):
    assert cli.main(["serve", "--model", "org/absent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model: model 'org/absent'") and "offline" in err
    assert cli.main(["serve", "--model", "org/tiny", "--adapter", "a=org/absent-lora"]) == 2
    assert "error: --adapter a: adapter 'org/absent-lora'" in capsys.readouterr().err


def test_serve_hub_model_and_adapter_from_the_cache_offline(hub, monkeypatch):
    """`vlora serve --model org/tiny --adapter a=org/tiny-lora` with the Hub offline answers a request."""
    from fastapi.testclient import TestClient

    from vlora.server.app import build_app

    answers = []

    def serve(engine, config, log_level="info", stop_client=False):
        with TestClient(build_app(engine, config, stop_client)) as client:
            models = client.get("/v1/models").json()
            r = client.post("/v1/completions", json={"model": "a", "prompt": [1, 2, 3], "max_tokens": 4,
                                                     "ignore_eos": True})
            answers.append((models, r.status_code, r.json()))

    monkeypatch.setattr("vlora.server.app.serve", serve)
    assert cli.main(["serve", "--model", "org/tiny", "--adapter", "a=org/tiny-lora", "--num-blocks", "16",
                     "--device", "cpu"]) == 0
    (models, status, body), = answers
    assert [m["id"] for m in models["data"]] == ["org/tiny", "a"]
    assert status == 200 and body["usage"]["completion_tokens"] == 4
