"""The server with its engine in a process of its own (EngineProcess, `vlora serve`'s default): the same answers as
the offline engine, refusals as the in-process engine gives them, adapters loaded and unloaded at run time, a
disconnected stream aborted there, a dead engine process answered as a failed engine, and a drained shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest

from tests.helpers import still_alive
from tests.server import process_builds
from tests.server.conftest import ADAPTERS, API_KEY, QUESTIONS, LiveServer
from vlora.bench.processes import descendants
from vlora.config import ConfigError, ServerConfig
from vlora.engine.client import AdapterNotFound, EngineFailed, Job, QueueFull, RequestFailed
from vlora.lora.adapter import AdapterError
from vlora.engine.process_client import EngineProcess, EngineStartFailed
from vlora.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def proc_live(setup):
    client = EngineProcess(partial(process_builds.smollm, {n: setup.adapters[n] for n in ADAPTERS}),
                           max_queued_requests=64, start_loader=True)
    config = ServerConfig(api_key=API_KEY, adapter_dirs=(str(setup.adapter_dir),))
    server = LiveServer(client, config)
    yield server
    server.stop()
    client.close()
    assert client.process.exitcode == 0


def wait_idle(client: EngineProcess, timeout: float = 60) -> None:
    """Until nothing is routed, running or waiting (a bounded wait, not a timing check)."""
    deadline = time.monotonic() + timeout
    while client._routes or client.stats.num_running or client.stats.num_waiting:
        assert time.monotonic() < deadline, "engine did not become idle"
        time.sleep(0.05)


def test_greedy_answers_equal_the_offline_engine(proc_live, ref):
    jobs = [(q, [None, "demo-r8", "demo-r16", "demo-r4"][i % 4]) for i, q in enumerate(QUESTIONS)]
    want = ref.complete(jobs, 24, temperature=0.0)

    def one(i):
        q, adapter = jobs[i]
        body = {"model": adapter or ref.base, "prompt": q, "max_tokens": 24, "temperature": 0,
                "stream": i % 2 == 0}
        with proc_live.http() as h:
            if not body["stream"]:
                r = h.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            with h.stream("POST", "/v1/completions", json=body) as s:
                assert s.status_code == 200
                parts = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            return "".join(p["choices"][0]["text"] for p in parts)

    with ThreadPoolExecutor(len(jobs)) as pool:          # all at once: they share engine steps
        got = list(pool.map(one, range(len(jobs))))
    assert got == want
    wait_idle(proc_live.async_engine)


def test_logprobs_and_usage_cross_the_process(proc_live, ref):
    with proc_live.http() as h:
        r = h.post("/v1/completions", json={"model": "demo-r8", "prompt": QUESTIONS[0], "max_tokens": 6,
                                            "min_tokens": 6, "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["text"] == ref.complete([(QUESTIONS[0], "demo-r8")], 6, temperature=0.0, min_tokens=6)[0]
    assert len(choice["logprobs"]["tokens"]) == out["usage"]["completion_tokens"] == 6
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])


def test_refusals_are_the_in_process_engines(proc_live):
    with proc_live.http() as h:
        r = h.post("/v1/completions", json={"model": "demo-r8", "prompt": "hi", "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = h.post("/v1/completions", json={"model": "no-such", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_adapters_load_and_unload_in_the_engine_process(proc_live, setup, ref):
    with proc_live.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "late-r8", "lora_path": setup.adapters["late-r8"]})
        assert r.status_code == 200, r.text
        assert "late-r8" in proc_live.async_engine.adapter_names
        r = h.post("/v1/completions", json={"model": "late-r8", "prompt": QUESTIONS[1], "max_tokens": 12,
                                            "temperature": 0})
        assert r.json()["choices"][0]["text"] == ref.complete([(QUESTIONS[1], "late-r8")], 12, temperature=0.0)[0]
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "late-r8", "lora_path": setup.adapters["late-r8"]})
        assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "late-r8"})
        assert r.status_code == 200, r.text
        assert "late-r8" not in proc_live.async_engine.adapter_names
        # the server's adapter directory holds it: a request naming it loads it again (on first request)
        r = h.post("/v1/completions", json={"model": "late-r8", "prompt": QUESTIONS[1], "max_tokens": 12,
                                            "temperature": 0})
        assert r.status_code == 200 and "late-r8" in proc_live.async_engine.adapter_names
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "late-r8"}).status_code == 200
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "late-r8"}).status_code == 404


def test_a_disconnected_stream_is_aborted_in_the_engine_process(proc_live):
    body = {"model": "demo-r16", "prompt": QUESTIONS[2], "max_tokens": 400, "min_tokens": 400, "stream": True}
    with proc_live.http() as h, h.stream("POST", "/v1/completions", json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                break                        # running; leaving the block closes the connection
    # its abort output reaches the server's counters (finish "abort"), and the engine's pages are freed
    assert proc_live.wait_metric("vlora_requests_total", 1, adapter="demo-r16", finish_reason="abort") == 1
    wait_idle(proc_live.async_engine)
    deadline = time.monotonic() + 30
    while proc_live.async_engine.stats.num_blocks_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc_live.async_engine.stats.num_blocks_used == 0


# -- the process itself, on the tiny random model ------------------------------------------------------------


def _tiny(**kw) -> EngineProcess:
    return EngineProcess(partial(process_builds.tiny), max_queued_requests=8, log_level="warning", **kw)


def test_a_build_that_fails_raises_its_error():
    with pytest.raises(ConfigError, match="no room"):
        EngineProcess(partial(process_builds.refuses), log_level="warning")


def test_an_engine_process_that_dies_fails_its_requests_and_calls_on_fatal():
    fatal = []
    client = _tiny(on_fatal=fatal.append)

    async def run():
        client.start()
        group = await client.submit([Job([1, 2, 3], None, SamplingParams(max_tokens=10_000, min_tokens=10_000,
                                                                        ignore_eos=True), "long")])
        async for out in group:              # running: kill the process under it
            if out.token_ids:
                os.kill(client.process.pid, signal.SIGKILL)
                break
        with pytest.raises(EngineFailed, match="exited"):
            async for _ in group:
                pass
        with pytest.raises(Exception, match="engine failed"):
            await client.submit([Job([1], None, SamplingParams(max_tokens=2), "after")])
        return await client.shutdown(1)

    try:
        assert asyncio.run(run()) is False
    finally:
        client.close()
    assert len(fatal) == 1 and isinstance(client.failure, EngineFailed)
    assert client.process.exitcode == -signal.SIGKILL


def test_refusals_cross_as_the_engines_exceptions_and_change_nothing():
    client = _tiny()

    async def run():
        client.start()
        with pytest.raises(AdapterNotFound, match="not registered"):
            await client.submit([Job([1, 2, 3], "no-such", SamplingParams(max_tokens=2), "x")])
        with pytest.raises(QueueFull, match="limit 8"):
            await client.submit([Job([1], None, SamplingParams(max_tokens=2), f"q{i}") for i in range(9)])
        with pytest.raises(AdapterError):
            await client.load_adapter("bad/name", "/nonexistent")
        with pytest.raises(AdapterNotFound):
            await client.unload_adapter("no-such")
        outs = await (await client.submit([Job([1, 2], None, SamplingParams(max_tokens=3), "ok")])).results()
        assert len(outs[0].token_ids) == 3 and not client._routes
        return await client.shutdown(10)

    try:
        assert asyncio.run(run()) is True
    finally:
        client.close()


def test_a_failed_request_fails_its_call_and_the_calls_others_finish_as_in_one_process():
    """The call's first request has finished, another fails, the third is aborted: the group gets the
    failure with the failed request's whole output, on_finish sees all three, nothing is left routed."""
    client = _tiny()
    bad = SamplingParams(max_tokens=6, temperature=1.0)
    object.__setattr__(bad, "temperature", 1e-300)      # probabilities not finite: its sampling fails
    finished = {}

    async def run():
        client.start()
        group = await client.submit(
            [Job([1, 2, 3], None, SamplingParams(max_tokens=1), "a0"),
             Job([4, 5], None, SamplingParams(max_tokens=40, ignore_eos=True), "b0"),
             Job([6, 7, 8, 9], None, bad, "c0")],
            lambda out, t: finished.setdefault(out.request_id, out.finish_reason))
        with pytest.raises(RequestFailed, match="c0 failed: sampling failed") as failed:
            await asyncio.wait_for(group.results(), 60)        # a failure that never arrives: TimeoutError
        assert await client.shutdown(10) is True
        return failed.value.output

    try:
        out = asyncio.run(run())
    finally:
        client.close()
    assert out.request_id == "c0" and out.prompt_token_ids == [6, 7, 8, 9] and out.finish_reason == "error"
    assert finished == {"a0": "length", "b0": "abort", "c0": "error"}
    assert not client._routes and not client._decoder._held and client.failure is None


def test_shutdown_drains_what_runs_and_the_process_exits():
    fatal = []
    client = _tiny(on_fatal=fatal.append)

    async def run():
        client.start()
        group = await client.submit([Job([5, 6, 7], None, SamplingParams(max_tokens=40, ignore_eos=True), "a"),
                                     Job([8, 9], None, SamplingParams(max_tokens=20, ignore_eos=True), "b")])
        drained = asyncio.ensure_future(client.shutdown(60))
        outs = await group.results()
        return outs, await drained

    outs, drained = asyncio.run(run())
    assert drained is True
    assert [len(o.token_ids) for o in outs] == [40, 20] and all(o.finish_reason == "length" for o in outs)
    assert client.process.exitcode == 0
    assert client.failure is None and not fatal             # a stop asked for is no failure


def test_start_failure_is_reported_when_the_process_exits_early():
    with pytest.raises(EngineStartFailed, match="exit code 3"):
        EngineProcess(partial(process_builds.exits, 3), log_level="warning")


def test_an_engine_process_whose_server_dies_while_it_builds_exits():
    """The server's process killed during a long build (its atexit never runs): the engine's process does not
    go on building and holding the device."""
    script = ("from functools import partial; from tests.server import process_builds; "
              "from vlora.engine.process_client import EngineProcess; "
              "EngineProcess(partial(process_builds.slow, 300), log_level='warning')")
    server = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while not (engine := descendants(server.pid)):
            assert server.poll() is None and time.monotonic() < deadline, "no engine process started"
            time.sleep(0.1)
        server.kill()
        server.wait()
        assert not (left := still_alive(engine, 30)), f"engine processes left behind: {left}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
