"""Inputs that once crashed the engine or the server (issue 28): each is refused with a 4xx in OpenAI's error
shape, or served correctly, and afterwards the server is healthy and gives the same greedy answer."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import httpx
import pytest

from tests.server.conftest import LiveServer
from tests.server.test_errors import BASE, check_error, image_chat
from vlora.config import ServerConfig
from vlora.sampling_params import GREEDY_BELOW, SamplingParams

FIXED = "What is 2 + 2?"
N = 2          # tokens of the fixed greedy answer: enough to see a changed model, cheap after every test


@pytest.fixture(autouse=True)
def still_serving(live, ref):
    """After each test: /health is 200 and a fixed greedy request answers as the offline engine does."""
    yield
    assert httpx.get(f"{live.url}/health").status_code == 200
    [want] = ref.chat([(FIXED, None)], N, temperature=0.0)
    with live.http() as h:
        r = h.post("/v1/chat/completions", json={"model": BASE, "messages": [{"role": "user", "content": FIXED}],
                                                 "max_tokens": N, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


@pytest.fixture
def sibling(live):
    """Start another app on the live server's engine with other server settings: ``sibling(**config)``."""
    started = []

    def start(**changes) -> LiveServer:
        server = LiveServer(live.async_engine, replace(live.server_state.config, **changes))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def post_raw(h: httpx.Client, path: str, body: dict, **headers) -> httpx.Response:
    """POST ``body`` as JSON with \\u escapes, so text the client's UTF-8 encoder refuses (a lone surrogate)
    reaches the server as valid JSON."""
    return h.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers})


def chat(**kw):
    return {"model": BASE, "messages": [{"role": "user", "content": FIXED}], "max_tokens": N, **kw}


# -- the engine never sees a request that would fail it ---------------------------------------------------
def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=1e-300).temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


@pytest.mark.parametrize("stream", [False, True])
def test_temperature_1e_300_answers_greedily(live, ref, stream):
    [want] = ref.chat([(FIXED, None)], N, temperature=0.0)
    with live.http() as h:
        r = h.post("/v1/chat/completions", json=chat(temperature=1e-300, stream=stream))
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert not any("error" in e for e in events) and r.text.rstrip().endswith("data: [DONE]")
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    else:
        text = r.json()["choices"][0]["message"]["content"]
    assert text == want


def test_top_p_too_small_for_float32_keeps_the_likeliest_token(live, ref):
    """5e-324 is 0 in float32, where it once kept no token at all (found by the fuzz test)."""
    [want] = ref.chat([(FIXED, None)], N, temperature=0.0)
    with live.http() as h:
        r = h.post("/v1/chat/completions", json=chat(top_p=5e-324, temperature=1.0, seed=1))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


def test_stop_token_ids_are_bounded(live):
    with live.http() as h:
        check_error(h.post("/v1/chat/completions", json=chat(stop_token_ids=[2] * 257)), 400, "stop_token_ids",
                    "at most 256")


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", chat(min_tokens=2, stop_token_ids=[1_000_000_000]), "stop_token_ids[0]"),
    ("/v1/chat/completions", chat(min_tokens=2, stop_token_ids=[2, 2**70]), "stop_token_ids[1]"),
    ("/v1/completions", {"model": BASE, "prompt": "Hi", "min_tokens": 1, "stop_token_ids": [2**70]},
     "stop_token_ids[0]"),
    ("/v1/completions", {"model": BASE, "prompt": [1, 2**70]}, "prompt[1]"),
])
def test_token_ids_outside_the_vocabulary_are_400(live, route, body, param):
    with live.http() as h:
        err = check_error(h.post(route, json=body), 400, param, "outside the vocabulary")
    assert err["code"] == "invalid_token_id"


@pytest.mark.parametrize("field,value", [("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "1e999"),
                                         ("frequency_penalty", "-Infinity")])
def test_numbers_must_be_finite(live, field, value):
    raw = json.dumps(chat())[:-1] + f', "{field}": {value}}}'
    with live.http() as h:
        check_error(h.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}),
                    400, field, "finite")


def test_max_completion_tokens_errors_name_it(live):
    with live.http() as h:
        err = check_error(h.post("/v1/chat/completions", json=chat(max_completion_tokens=10**12)), 400,
                          "max_completion_tokens", "max_completion_tokens")
        assert "max_tokens=" not in err["message"]
        check_error(h.post("/v1/chat/completions", json=chat(max_completion_tokens=2, min_tokens=3)), 400,
                    "min_tokens", "max_completion_tokens=2")


# -- paths ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["ok\x00.png", "file://{image_dir}/ok\x00.png", "file://{image_dir}/ok%00.png"])
def test_nul_in_an_image_path_is_400(live, setup, url):
    with live.http() as h:
        err = check_error(h.post("/v1/chat/completions", json=image_chat(url.format(image_dir=setup.image_dir))),
                          400, "messages", "NUL")
    assert err["code"] == "invalid_image"


def test_nul_in_lora_path_is_400(live):
    with live.http() as h:
        check_error(h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "late-r8\x00"}),
                    400, "lora_path", "NUL")


def test_adapter_errors_do_not_show_server_paths(live, setup):
    bad = setup.adapter_dir / "pickle_only"
    bad.mkdir(exist_ok=True)
    (bad / "adapter_config.json").write_text((setup.adapter_dir / "late-r8" / "adapter_config.json").read_text())
    (bad / "adapter_model.bin").write_bytes(b"not read")
    with live.http() as h:
        err = check_error(h.post("/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": "pickle_only"}),
                          400, "lora_path", "pickle")
    assert str(setup.root) not in err["message"] and "pickle_only" in err["message"]
    assert "p" not in live.async_engine.adapter_names


def test_a_taken_or_malformed_lora_name_is_400_naming_it_without_server_paths(live, setup, sibling, tmp_path):
    """A name already served names lora_name (not lora_path) and never shows where the served adapter lives,
    even when that is outside the adapter directories (an adapter given at start-up)."""
    import shutil

    shutil.copytree(setup.adapter_dir / "late-r8", tmp_path / "copy")
    server = sibling(adapter_dirs=(str(tmp_path),))
    with server.http() as h:
        err = check_error(h.post("/v1/load_lora_adapter", json={"lora_name": "demo-r8", "lora_path": "copy"}),
                          400, "lora_name", "demo-r8")
        assert str(setup.root) not in err["message"]
        check_error(h.post("/v1/load_lora_adapter", json={"lora_name": " spaced", "lora_path": "copy"}),
                    400, "lora_name", "spaces")
    assert " spaced" not in live.async_engine.adapter_names


# -- bodies ---------------------------------------------------------------------------------------------
def test_a_body_nested_100000_levels_is_400(live):
    deep = '{"model": "' + BASE + '", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with live.http() as h:
        check_error(h.post("/v1/chat/completions", content=deep, headers={"Content-Type": "application/json"}),
                    400, None, "nested 100001 levels")


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"model": BASE, "prompt": "ab\ud800cd"}, "prompt"),
    ("/v1/completions", {"model": BASE, "prompt": ["ab\udfff"]}, "prompt[0]"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "ab\ud800cd"}]), "messages[0].content"),
    ("/v1/chat/completions", chat(model="x\ud800"), "model"),
    ("/v1/chat/completions", {**chat(), "\ud800": 1}, None),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a\ud800"}, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": "\udc00"}, "lora_name"),
])
def test_lone_surrogates_are_400_in_every_route(live, route, body, param):
    with live.http() as h:
        check_error(post_raw(h, route, body), 400, param, "surrogate")


def test_surrogate_pairs_are_text(live):
    """An escaped pair (an emoji, as json.dumps writes it) is valid text, not a lone surrogate."""
    with live.http() as h:
        r = post_raw(h, "/v1/completions", {"model": BASE, "prompt": "Hi \U0001f600", "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_post_bodies_must_be_json(live, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    with live.http() as h:
        for route in ("/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter"):
            err = check_error(h.post(route, content=json.dumps(chat()), headers=headers), 415, None, "Content-Type")
            assert err["code"] == "unsupported_media_type"


def test_json_with_a_charset_is_served(live):
    with live.http() as h:
        r = h.post("/v1/chat/completions", content=json.dumps(chat()),
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_errors_quote_at_most_100_characters_of_the_input(live):
    name = "m" * 500_000
    with live.http() as h:
        err = check_error(h.post("/v1/chat/completions", json=chat(model=name)), 404, "model")
        assert len(err["message"]) < 400 and "500000 long" in err["message"]
        err = check_error(h.post("/v1/chat/completions", json={**chat(), "cache_salt": "k" * 100_000}), 400,
                          "cache_salt")
        assert len(err["message"]) < 400
        assert h.post("/v1/chat/completions", json={**chat(), "k" * 100_000: 1}).status_code == 200   # ignored


# -- the event loop stays free ------------------------------------------------------------------------
def test_a_16_mib_message_is_context_length_exceeded_before_tokenizing(live, sibling, monkeypatch):
    """Text longer than the context could hold is refused as any prompt too long is (400
    context_length_exceeded, which clients truncate on), before it is tokenized."""
    server = sibling(max_request_bytes=ServerConfig().max_request_bytes)   # 32 MiB: the text limit refuses it
    monkeypatch.setattr(server.server_state.work, "chat_template", _never)
    big = chat(messages=[{"role": "user", "content": "x" * (16 << 20)}])
    with server.http() as h:
        err = check_error(h.post("/v1/chat/completions", json=big), 400, "messages", "characters")
        assert err["code"] == "context_length_exceeded"
        monkeypatch.setattr(server.server_state.work, "encode", _never)
        err = check_error(h.post("/v1/completions", json={"model": BASE, "prompt": "x" * (16 << 20)}), 400, "prompt")
        assert err["code"] == "context_length_exceeded"
        err = check_error(h.post("/v1/completions", json={"model": BASE, "prompt": ["Hi", "x" * (16 << 20)]}), 400,
                          "prompt[1]")
        assert err["code"] == "context_length_exceeded"
        assert h.get("/health").status_code == 200


def test_health_answers_while_a_request_is_tokenized(live, sibling, monkeypatch):
    server = sibling()
    work = server.server_state.work
    entered, release = threading.Event(), threading.Event()
    encode = work.encode

    def slow_encode(text):
        entered.set()
        assert release.wait(60)
        return encode(text)

    monkeypatch.setattr(work, "encode", slow_encode)
    result = {}
    with server.http() as h:
        t = threading.Thread(target=lambda: result.update(r=h.post("/v1/completions", json={
            "model": BASE, "prompt": FIXED, "max_tokens": 1})))
        t.start()
        try:
            assert entered.wait(60)
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200   # the loop is free
        finally:
            release.set()
            t.join(60)
    assert result["r"].status_code == 200


# -- interactive docs ---------------------------------------------------------------------------------
DOCS = ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"]


def test_docs_routes_are_off_by_default(live):
    with live.http() as h:
        for path in DOCS:
            assert h.get(path).status_code == 404, path


def test_docs_routes_need_the_key_when_enabled(live, sibling):
    server = sibling(enable_docs=True)
    for path in DOCS:
        check_error(httpx.get(f"{server.url}{path}"), 401)
    with server.http() as h:
        for path in DOCS:
            assert h.get(path).status_code == 200, path
        assert "/v1/chat/completions" in h.get("/openapi.json").json()["paths"]
    open_server = sibling(enable_docs=True, api_key=None)
    assert httpx.get(f"{open_server.url}/docs").status_code == 200


def test_a_served_model_name_that_is_an_adapters_name_is_refused(live):
    """Requests naming it would go to the base model and the adapter could never be reached."""
    from vlora.config import ConfigError
    from vlora.server.app import build_app

    with pytest.raises(ConfigError, match="demo-r8"):
        build_app(live.async_engine, replace(live.server_state.config, served_model_name="demo-r8"))


# -- wire format ----------------------------------------------------------------------------------------
def test_answers_carry_no_empty_extension_fields(live):
    with live.http() as h:
        choice = h.post("/v1/chat/completions", json=chat(max_tokens=1)).json()["choices"][0]
        assert "task" not in choice and set(choice) == {"index", "message", "finish_reason", "logprobs"}
        choice = h.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 1}).json()["choices"][0]
        assert "task" not in choice


def _never(*args):
    raise AssertionError("heavy work ran for a request that should have been refused first")
