"""Fault isolation: one request's failure ends that request only; a failed forward ends its iteration's requests
and serving goes on; an engine that cannot go on ends the async engine and the server process."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import make_peft_adapter, make_tiny_model
from vlora import LLM, SamplingParams
from vlora.engine.async_engine import AsyncEngine, EngineFailed, Job, RequestFailed, ShuttingDown
from vlora.engine.faults import EngineFatal

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3, 5, 6]]
PAGES = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    path, hf = make_tiny_model(root)
    return path, {"a": make_peft_adapter(hf, root / "a", 8, seed=1)}


@pytest.fixture
def llm(tiny):
    path, adapters = tiny
    return LLM(str(path), adapters=adapters, num_blocks=PAGES, block_size=4, max_model_len=128,
               max_num_seqs=4, max_num_batched_tokens=8)   # prompts span several chunks: failures land mid-prefill too


def greedy(n=6, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def drain(engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


@pytest.fixture(scope="module")
def reference(tiny):
    path, adapters = tiny
    ref = LLM(str(path), adapters=adapters, num_blocks=PAGES, block_size=4, max_model_len=128)
    return [o.token_ids for o in ref.generate(PROMPTS[:2], [None, "a"], greedy())]


def unsampleable() -> SamplingParams:
    """A temperature that makes the probabilities non-finite. SamplingParams makes such tiny temperatures
    greedy, so the value is forced past it: the engine must still fail only this request if one slips through."""
    sp = SamplingParams(max_tokens=6, temperature=1.0)
    object.__setattr__(sp, "temperature", 1e-300)
    return sp


def idle(engine) -> bool:
    return not engine.has_unfinished() and engine.allocator.num_free == PAGES


@pytest.mark.parametrize("bad", [
    unsampleable(),                                                                  # probabilities not finite
    SamplingParams(max_tokens=6, min_tokens=2, stop_token_ids=[1_000_000_000]),      # stop id outside the vocab
    SamplingParams(max_tokens=6, min_tokens=1, stop_token_ids=[2**70]),
])
def test_a_request_that_cannot_be_sampled_fails_alone(llm, reference, bad):
    e = llm.engine
    ids = [e.add_request(PROMPTS[0], None, greedy()), e.add_request(PROMPTS[2], None, bad),
           e.add_request(PROMPTS[1], "a", greedy())]
    outs = drain(e)
    assert [outs[ids[0]].token_ids, outs[ids[2]].token_ids] == reference
    failed = outs[ids[1]]
    assert failed.finished and failed.finish_reason == "error" and "sampling failed" in failed.error
    assert idle(e)


def test_a_failure_in_one_requests_stop_checks_fails_it_alone(llm, reference, monkeypatch):
    e = llm.engine
    ids = [e.add_request(PROMPTS[0], None, greedy()), e.add_request(PROMPTS[2], None, greedy()),
           e.add_request(PROMPTS[1], "a", greedy())]
    real = e._stop_reason

    def stop_reason(seq, token):
        if seq.request_id == ids[1] and len(seq.output_token_ids) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seq, token)

    monkeypatch.setattr(e, "_stop_reason", stop_reason)
    outs = drain(e)
    assert [outs[ids[0]].token_ids, outs[ids[2]].token_ids] == reference
    assert outs[ids[1]].finish_reason == "error" and "UnicodeDecodeError" in outs[ids[1]].error
    assert idle(e)


def test_a_failed_forward_fails_its_iteration_and_serving_goes_on(llm, reference, monkeypatch):
    e = llm.engine
    real, calls = e.runner.run, []

    def run(scheduled):
        calls.append({s.seq.request_id for s in scheduled})
        if len(calls) == 1:                     # the first iteration: the first prompt takes the token budget
            raise RuntimeError("injected forward failure")
        return real(scheduled)

    monkeypatch.setattr(e.runner, "run", run)
    ids = [e.add_request(PROMPTS[0], None, greedy()), e.add_request(PROMPTS[1], "a", greedy()),
           e.add_request(PROMPTS[2], None, greedy())]
    outs = drain(e)
    assert calls[0] == {ids[0]}
    assert outs[ids[0]].finish_reason == "error" and "injected forward failure" in outs[ids[0]].error
    assert outs[ids[1]].token_ids == reference[1] and outs[ids[2]].finish_reason == "length"
    assert idle(e)
    again = e.add_request(PROMPTS[0], None, greedy())
    assert drain(e)[again].token_ids == reference[0] and idle(e)


def test_repeated_or_device_failures_end_the_engine(llm, monkeypatch):
    e = llm.engine
    monkeypatch.setattr(e.runner, "run", lambda scheduled: (_ for _ in ()).throw(RuntimeError("broken")))
    for _ in range(2):                          # two failed iterations: their requests fail, the engine serves
        rid = e.add_request(PROMPTS[0], None, greedy())
        assert [o.finish_reason for o in e.step() if o.request_id == rid] == ["error"]
    e.add_request(PROMPTS[0], None, greedy())
    with pytest.raises(EngineFatal, match="3 iterations in a row"):
        e.step()
    monkeypatch.setattr(e.runner, "run", lambda scheduled: (_ for _ in ()).throw(
        RuntimeError("CUDA error: an illegal memory access was encountered")))
    e._forward_failures = 0
    with pytest.raises(EngineFatal, match="device failed"):
        e.step()


def test_a_fatal_error_ends_the_async_engine(llm, monkeypatch):
    fatal = []

    async def main():
        ae = AsyncEngine(llm.engine, on_fatal=fatal.append)
        ae.start()
        monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(EngineFatal("device lost")))
        group = await ae.submit([Job(PROMPTS[0], None, greedy(), "r1")])
        with pytest.raises(EngineFailed, match="device lost"):
            await group.results()
        with pytest.raises(ShuttingDown, match="engine failed"):
            await ae.submit([Job(PROMPTS[0], None, greedy(), "r2")])
        await ae.shutdown(timeout=10)
        return ae

    ae = asyncio.run(main())
    assert len(fatal) == 1 and isinstance(fatal[0], EngineFatal) and not ae.is_running
    assert ae._thread is not None and not ae._thread.is_alive()
    assert llm.engine.allocator.num_free == PAGES           # the request in flight was aborted, its pages freed


def test_a_failed_request_fails_its_api_call_only(llm, reference):
    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        bad = unsampleable()
        good = await ae.submit([Job(PROMPTS[0], None, greedy(), "g0"), Job(PROMPTS[1], "a", greedy(), "g1")])
        failing = await ae.submit([Job(PROMPTS[2], None, greedy(n=40), "b0"), Job(PROMPTS[1], None, bad, "b1")])
        with pytest.raises(RequestFailed, match="b1 failed: sampling failed"):
            await failing.results()
        outs = await good.results()
        assert ae.is_running and ae.failure is None
        await ae.shutdown(timeout=10)
        return [o.token_ids for o in outs]

    assert asyncio.run(main()) == reference
    assert idle(llm.engine)                  # the failed call's other request was aborted, its pages freed


def test_a_failed_calls_requests_are_reported_finished(llm):
    """on_finish (the server's request and token counters) sees the failed request (finish "error") and the
    call's other request (aborted), as it sees every finished engine request."""
    finished = {}

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        failing = await ae.submit([Job(PROMPTS[2], None, greedy(n=40), "b0"), Job(PROMPTS[1], None, unsampleable(),
                                                                                  "b1")],
                                  lambda out, t: finished.setdefault(out.request_id, out.finish_reason))
        with pytest.raises(RequestFailed):
            await failing.results()
        await ae.shutdown(timeout=10)          # drains: every abort has been dispatched
        await asyncio.sleep(0)                 # deliveries already scheduled on the loop run
        assert not ae._live

    asyncio.run(main())
    assert finished == {"b0": "abort", "b1": "error"}


SERVER = textwrap.dedent("""
    import sys
    from vlora.config import ServerConfig
    from vlora.engine.engine import Engine
    from vlora.engine.faults import EngineFatal
    from vlora.llm import LLM
    from vlora.server.app import serve

    engine = LLM(sys.argv[1], num_blocks=16, block_size=4, max_model_len=64).engine
    def step():
        raise EngineFatal("injected device failure")
    engine.step = step
    serve(engine, ServerConfig(port=int(sys.argv[2]), drain_timeout=5), log_level="warning")
""")


def test_the_server_process_exits_non_zero_when_the_engine_cannot_go_on(tiny, tmp_path):
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "serve.py"
    script.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny[0]), str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:                             # a bounded wait for start-up
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed"
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert "injected device failure" in out
