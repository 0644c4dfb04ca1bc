"""Queue limits (429), the abort unload policy, graceful shutdown (503 + drain), and SIGTERM on `vlora serve`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import still_alive
from tests.server.conftest import API_KEY, LiveServer, make_llm
from vlora.bench.processes import descendants
from vlora.config import ServerConfig

HI = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def small(setup):
    """One sequence per batch, at most two waiting requests, unload policy abort."""
    config = ServerConfig(api_key=API_KEY, adapter_dirs=(str(setup.adapter_dir),), max_queued_requests=2,
                          unload_policy="abort")
    server = LiveServer(make_llm(setup, names=("demo-r8",), max_num_seqs=1).engine, config)
    yield server
    server.stop()


def long_stream(model: str, tokens: int = 300) -> dict:
    return {"model": model, "messages": HI, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0,
            "stream": True}


def events_until_content(lines):
    """Read SSE events until one carries generated text (the request is running)."""
    for line in lines:
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
            return


def test_a_full_queue_is_429(small):
    with small.http() as h, h.stream("POST", "/v1/chat/completions", json=long_stream("demo-r8")) as a:
        lines = a.iter_lines()          # keep it: a discarded line iterator closes the connection
        events_until_content(lines)                                   # running: the batch holds one sequence
        with h.stream("POST", "/v1/chat/completions", json=long_stream("demo-r8")) as b, \
                h.stream("POST", "/v1/chat/completions", json=long_stream("demo-r8")) as c:
            assert b.status_code == c.status_code == 200              # both waiting
            r = httpx.post(f"{small.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"model": "demo-r8", "messages": HI, "max_tokens": 2})
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    small.wait_idle()                                                 # the three disconnected: aborted
    assert small.engine.allocator.num_free == small.engine.allocator.num_blocks


def test_more_choices_than_the_queue_holds_is_400_naming_n(small):
    """n above --max-queued-requests could never be queued: a 400 naming n, not a 429 that no retry cures."""
    with small.http() as h:
        r = h.post("/v1/chat/completions", json={"model": "demo-r8", "messages": HI, "max_tokens": 2, "n": 3})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n" and "max-queued-requests" in r.json()["error"]["message"]
        r = h.post("/v1/chat/completions", json={"model": "demo-r8", "messages": HI, "max_tokens": 2, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    small.wait_idle()


def test_unload_with_policy_abort_ends_the_adapters_requests(small):
    with small.http() as h:
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late-r8"}).status_code == 200
        with h.stream("POST", "/v1/chat/completions", json=long_stream("late")) as s:
            lines = s.iter_lines()
            events_until_content(lines)
            r = h.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
            assert r.status_code == 200 and r.json()["aborted_requests"] == 1
            events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    small.wait_idle()
    assert small.engine.allocator.num_free == small.engine.allocator.num_blocks


def test_shutdown_refuses_new_requests_and_drains_running_ones(small):
    """Last in this module: it stops the server."""
    with small.http() as h, h.stream("POST", "/v1/chat/completions", json=long_stream("demo-r8", 12)) as s:
        lines = s.iter_lines()
        events_until_content(lines)
        small.async_engine.begin_shutdown()                           # what SIGTERM does first
        with small.http() as h2:
            r = h2.post("/v1/chat/completions", json={"model": "demo-r8", "messages": HI, "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            assert h2.get("/health").status_code == 503
        small.uvicorn.should_exit = True                               # then uvicorn's graceful shutdown
        events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    small.thread.join(60)
    assert not small.thread.is_alive() and not small.async_engine.is_running
    assert small.engine.allocator.num_free == small.engine.allocator.num_blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vlora_serve_drains_on_sigterm():
    port = _free_port()
    env = {**os.environ, "VLORA_API_KEY": "cli-key"}
    proc = subprocess.Popen([sys.executable, "-m", "vlora.cli", "serve", "--port", str(port),
                             "--kv-cache-memory-gb", "0.1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer cli-key"}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "vlora serve did not come up"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        engine_procs = descendants(proc.pid)    # the engine's process (vlora serve's default) and its own
        assert engine_procs
        ids = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]]
        # the demo adapters by default: the trained ones where `vlora adapters demo` has built them, else random ones
        assert ids[0] == "SmolLM2-135M-Instruct"
        assert ids[1:] in (["demo-r16", "demo-r8"], ["demo-sentiment", "demo-topic-language"]), ids
        body = {**long_stream(ids[1], 20)}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth, timeout=120) as s:
            lines = s.iter_lines()
            events_until_content(lines)
            os.killpg(proc.pid, signal.SIGTERM)     # the whole group, as a service manager stops a service
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the signal once it has shut down gracefully
        assert proc.wait(60) in (0, -signal.SIGTERM)
        # the adapter readers see their parent go within a second
        assert not (left := still_alive(engine_procs, 10)), f"processes left behind: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
