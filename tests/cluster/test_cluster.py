"""A cluster of two replicas on a local Ray cluster (2 CPUs), tiny random Llama in fp32: every request gets one
engine's greedy answer, also when it migrates mid-stream or its replica is killed; adapters loaded at run time
reach every replica, restarted ones included; the server streams through the front.

One Ray session and one cluster (``LLM(replicas=2)``) serve the whole module; the tests run in file order and
the kill test comes last but one (it leaves the cluster whole again)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tests.helpers import make_peft_adapter, make_tiny_model
from vlora import LLM, SamplingParams
from vlora.engine.async_engine import Job

ray = pytest.importorskip("ray")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 1, 2, 3, 5, 8, 13], [9, 9, 8, 2, 4, 4, 3, 5]]
ENGINE = dict(num_blocks=40, block_size=4, max_model_len=128, device="cpu", dtype="float32")


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    path, hf = make_tiny_model(root)
    adapters = {"a": str(make_peft_adapter(hf, root / "a", 8, seed=1)),
                "b": str(make_peft_adapter(hf, root / "b", 4, seed=2))}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        cluster = LLM(str(path), adapters={"a": adapters["a"]}, replicas=2, **ENGINE)
        one = LLM(str(path), adapters=adapters, **{**ENGINE, "num_blocks": 256})   # room for everyone: no preemption
        yield cluster, one, adapters
        cluster.close()
    finally:
        ray.shutdown()


def expected(one, prompt, adapter, n):
    return one.generate(prompt, adapter, greedy(n))[0].token_ids


def on_replica(cluster, replica_id, prompt, adapter, n):
    """Greedy tokens of a request run on one replica directly (bypassing placement)."""
    actor = cluster.cluster.front.replicas[replica_id].actor

    async def go():
        tokens = []
        async for ref in actor.generate.remote(Job(prompt, adapter, greedy(n), f"direct-{time.monotonic_ns()}")):
            item = await ref
            if isinstance(item, list):
                tokens += [t for out in item for t in out.delta_token_ids]
        return tokens
    return cluster.cluster.run(go())


def stream_tokens(cluster, jobs, during=None):
    """Submit ``jobs`` as one group; the delta tokens each request streamed. ``during(front, flights)`` runs once
    every request has streamed 3 tokens."""
    front = cluster.cluster.front

    async def go():
        group = await front.submit(jobs)
        flights = [front._flights[j.request_id] for j in jobs]
        got = {j.request_id: [] for j in jobs}
        done = during is None
        async for out in group:
            got[out.request_id] += out.delta_token_ids
            if not done and all(len(v) >= 3 for v in got.values()):
                done = True
                await during(front, flights)
        return [got[j.request_id] for j in jobs]
    return cluster.cluster.run(go())


def test_two_replicas_answer_like_one_engine(setup):
    cluster, one, _ = setup
    adapters = [None, "a"] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in (0, 1)]
    outs = cluster.generate(prompts, adapters, greedy(12))
    assert [o.token_ids for o in outs] == [expected(one, p, a, 12) for p, a in zip(prompts, adapters)]
    assert all(o.finish_reason == "length" and o.prompt_token_ids == p for o, p in zip(outs, prompts))
    streamed = [t for o in cluster.stream(PROMPTS[0], "a", greedy(5)) for t in o.delta_token_ids]
    assert streamed == expected(one, PROMPTS[0], "a", 5)
    # both replicas served (round robin)
    assert all(r.status.stats.num_blocks > 0 for r in cluster.cluster.front.replicas)


def test_migration_mid_stream_keeps_the_stream(setup):
    cluster, one, _ = setup
    front = cluster.cluster.front
    before = front.migrations
    jobs = [Job(PROMPTS[1], "a", greedy(30), "mig-0"), Job(PROMPTS[2], None, greedy(30), "mig-1")]

    async def migrate_first(front, flights):
        f = flights[0]
        await f.replica.actor.migrate.remote([f.engine_id])
    got = stream_tokens(cluster, jobs, migrate_first)
    assert got == [expected(one, PROMPTS[1], "a", 30), expected(one, PROMPTS[2], None, 30)]
    assert front.migrations == before + 1


def test_replica_short_of_kv_hands_requests_back(setup):
    # 40 pages of 4 tokens per replica; six requests of 8 + 48 tokens (14 pages each) cannot all run on one
    cluster, one, _ = setup
    front = cluster.cluster.front
    before = front.migrations
    jobs = [Job(PROMPTS[i % 4], "a" if i % 2 else None, greedy(48), f"kv-{i}") for i in range(6)]
    got = stream_tokens(cluster, jobs)
    assert got == [expected(one, j.prompt, j.adapter, 48) for j in jobs]
    assert front.migrations > before


def test_adapter_loaded_at_run_time_reaches_every_replica(setup):
    cluster, one, adapters = setup
    cluster.register_adapter("b", adapters["b"])
    assert cluster.list_adapters() == ["a", "b"]
    want = expected(one, PROMPTS[3], "b", 8)
    assert [on_replica(cluster, i, PROMPTS[3], "b", 8) for i in (0, 1)] == [want, want]


def test_killed_replica_loses_no_request_and_rejoins_with_adapters(setup):
    cluster, one, _ = setup
    front = cluster.cluster.front
    victim = front.replicas[0]
    incarnation, failovers = victim.incarnation, front.failovers
    jobs = [Job(PROMPTS[i], ("a", "b", None, "a")[i], greedy(40), f"kill-{i}") for i in range(4)]

    async def kill(front, flights):
        assert any(f.replica is victim for f in flights)
        ray.kill(victim.actor, no_restart=False)
    got = stream_tokens(cluster, jobs, kill)
    assert got == [expected(one, j.prompt, j.adapter, 40) for j in jobs]
    assert front.failovers > failovers
    deadline = time.monotonic() + 60
    while not (victim.ready and victim.incarnation != incarnation):
        assert time.monotonic() < deadline, "the killed replica did not rejoin"
        time.sleep(0.1)
    # the restarted replica serves the adapter given at start and the one loaded at run time
    assert on_replica(cluster, 0, PROMPTS[3], "b", 8) == expected(one, PROMPTS[3], "b", 8)
    assert on_replica(cluster, 0, PROMPTS[0], "a", 8) == expected(one, PROMPTS[0], "a", 8)


def test_server_streams_through_the_front(setup):
    import httpx
    import uvicorn

    from vlora.config import ServerConfig
    from vlora.server.app import build_app

    cluster, one, _ = setup
    app = build_app(cluster.cluster.front, ServerConfig())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), cluster.cluster.loop)
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and not task.done(), "server did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        models = httpx.get(f"{url}/v1/models").json()
        assert sorted(m["id"] for m in models["data"])[:2] == ["a", "b"]
        body = {"model": "a", "prompt": PROMPTS[0], "max_tokens": 10, "stream": True, "ignore_eos": True,
                "temperature": 0}
        tokens = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
        assert tokens == expected(one, PROMPTS[0], "a", 10)
        r = httpx.post(f"{url}/v1/completions", json={**body, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    finally:
        server.should_exit = True
        task.result(30)
