"""Bad requests: each gets its status and an OpenAI error body, and the server stays healthy."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.server.conftest import API_KEY

BASE = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi"}]


def chat(**kw):
    return {"model": BASE, "messages": HI, "max_tokens": 2, **kw}


def image_chat(url):
    return chat(messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                       {"type": "image_url", "image_url": {"url": url}}]}])


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def check_error(r: httpx.Response, status: int, param=None, contains: str = ""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    assert contains.lower() in err["message"].lower()
    return err


@pytest.mark.parametrize("body,param,contains", [
    (chat(max_tokens="ten"), "max_tokens", "valid integer"),
    (chat(max_tokens=2.0), "max_tokens", "valid integer"),
    (chat(temperature="hot"), "temperature", "valid number"),
    (chat(temperature=3), "temperature", "less than or equal"),
    (chat(n=0), "n", "greater than"),
    (chat(stream="yes"), "stream", "boolean"),
    (chat(messages="Hi"), "messages", "valid list"),
    (chat(messages=[]), "messages", "at least 1"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", ""),
    (chat(messages=[{"role": "user"}]), "messages[0].content", "missing"),
    (chat(messages=[{"role": "user", "content": [{"type": "video", "video": {}}]}]), "messages[0].content[0]", "video"),
    (chat(use_beam_search=True), "use_beam_search", "not supported"),   # vLLM's, not implemented (test_fields_api)
    ({"messages": HI}, "model", "missing"),
    (chat(max_tokens=100000), "max_tokens", "too large"),
    (chat(min_tokens=5), "min_tokens", "larger than max_tokens"),
    (chat(top_logprobs=2), "top_logprobs", "logprobs"),
    (chat(presence_penalty=2.5), "presence_penalty", "less than or equal"),
    (chat(tool_choice="required"), "tool_choice", "needs tools"),
    (chat(stream_options={"include_usage": True}), "stream_options", "stream is true"),
    (chat(stop=[""]), "stop", "empty"),
    (chat(seed=-1), "seed", "greater than"),
    (chat(task_head=True), "task_head", "task head"),        # the base model has no task head
    (chat(model="demo-r8", task_head=True), "task_head", "task head"),
])
def test_invalid_chat_fields_are_400(live, body, param, contains):
    with live.http() as h:
        check_error(h.post("/v1/chat/completions", json=body), 400, param, contains)


@pytest.mark.parametrize("content", [b"{", b"[1, 2]", b"", b"\xff\xfe"])
def test_malformed_json_is_400(live, content):
    with live.http() as h:
        err = check_error(h.post("/v1/chat/completions", content=content,
                                       headers={"Content-Type": "application/json"}), 400)
    assert "json" in err["message"].lower()


@pytest.mark.parametrize("body,param,contains", [
    ({"model": BASE, "prompt": list(range(1, 6000))}, "prompt", "at most"),          # longer than the context
    ({"model": BASE, "prompt": [1, 2, 10**9]}, "prompt[2]", "vocabulary"),
    ({"model": BASE, "prompt": []}, "prompt", "empty"),
    ({"model": BASE, "prompt": ["a", ""]}, "prompt[1]", "empty"),
    ({"model": BASE, "prompt": [[1, 2], []]}, "prompt[1]", "empty"),
    ({"model": BASE, "prompt": [[1, 2], [3, 10**9]]}, "prompt[1][1]", "vocabulary"),
    ({"model": BASE, "prompt": [1, True]}, None, ""),
    ({"model": BASE, "prompt": "Hi", "suffix": "!"}, "suffix", "not supported"),
    ({"model": BASE, "prompt": "Hi", "best_of": 3, "stream": True}, "best_of", "stream"),
    ({"model": BASE, "prompt": "Hi", "max_tokens": 0}, "max_tokens", "greater than"),
    ({"model": BASE, "prompt": "Hi", "task_head": True}, "task_head", "task head"),
])
def test_invalid_completions_are_400(live, body, param, contains):
    with live.http() as h:
        err = check_error(h.post("/v1/completions", json=body), 400, param, contains)
    if contains == "at most":           # a prompt longer than the context: the code clients truncate on
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_a_missing_or_wrong_api_key_is_401(live, headers):
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/v1/load_lora_adapter")]:
        r = httpx.request(method, f"{live.url}{path}", json=chat(), headers=headers)
        err = check_error(r, 401)
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


def test_unknown_models_and_routes_are_404(live):
    with live.http() as h:
        err = check_error(h.post("/v1/chat/completions", json=chat(model="gpt-4")), 404, "model", "gpt-4")
        assert err["code"] == "model_not_found"
        check_error(h.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model")
        check_error(h.get("/v1/nothing-here"), 404)
        check_error(h.get("/v1/chat/completions"), 405)


def test_an_oversized_body_is_413(live):
    with live.http() as h:
        big = chat(messages=[{"role": "user", "content": "x" * (1 << 20)}])
        check_error(h.post("/v1/chat/completions", json=big), 413, contains="larger than")


@pytest.mark.parametrize("image,status,contains", [
    ("noisy", 413, "bytes"),              # 200x200 noise: > 64 KiB
    ("huge", 413, "pixels"),              # 1500x1000: > 1M pixels, a small file
    ("corrupt", 400, "cannot be decoded"),
    ("ok", 400, "does not accept images"),  # valid, but the model is text-only
])
def test_images_are_checked_then_refused(live, setup, image, status, contains):
    with live.http() as h:
        err = check_error(h.post("/v1/chat/completions", json=image_chat(data_uri(setup.images[image]))),
                          status, "messages", contains)
    assert err["code"] in ("invalid_image", "images_not_supported")


@pytest.mark.parametrize("url,status,contains", [
    ("file://{image_dir}/ok.png", 400, "does not accept images"),
    ("ok.png", 400, "does not accept images"),
    ("file://{root}/outside.png", 403, "outside"),
    ("../outside.png", 403, "outside"),
    ("{image_dir}/missing.png", 404, "not found"),
    ("https://example.com/cat.png", 400, "not fetched"),
    ("data:image/png;base64,@@@@", 400, "base64"),
    ("data:text/plain;base64,aGk=", 400, "not an image"),
])
def test_image_sources(live, setup, url, status, contains):
    url = url.format(image_dir=setup.image_dir, root=setup.root)
    with live.http() as h:
        check_error(h.post("/v1/chat/completions", json=image_chat(url)), status, "messages", contains)


def test_server_is_healthy_after_bad_requests(live):
    live.wait_idle()
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert live.engine.allocator.num_free == live.engine.allocator.num_blocks
    assert live.metric("vlora_http_errors_total", status="400") > 0
