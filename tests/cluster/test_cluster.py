"""A cluster of two replicas on a local Ray cluster (2 CPUs), tiny random Llama in fp32: every request gets one
engine's greedy answer, also when it migrates mid-stream or its replica is killed; adapters loaded at run time
reach every replica, restarted ones included; the server streams through the front.

One Ray session and one cluster (as `vlora serve --replicas 2` starts it) serve the whole module; the tests run
in file order (the kill test leaves the cluster whole again)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tests.helpers import make_peft_adapter, make_tiny_model
from vlora import LLM, SamplingParams
from vlora.cluster.policy import Migration
from vlora.engine.client import Job
from vlora.engine.engine import RequestError

ray = pytest.importorskip("ray")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 1, 2, 3, 5, 8, 13], [9, 9, 8, 2, 4, 4, 3, 5]]
ENGINE = dict(num_blocks=24, block_size=4, max_model_len=128, device="cpu", dtype="float32")


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the cluster's blocking client, one engine for expected answers, adapter paths). The cluster is what
    `vlora serve --replicas 2` starts."""
    from vlora.cli import build_parser, serving_cluster
    from vlora.cluster.client import ClusterClient

    root = tmp_path_factory.mktemp("cluster")
    path, hf = make_tiny_model(root)
    adapters = {"a": str(make_peft_adapter(hf, root / "a", 8, seed=1)),
                "b": str(make_peft_adapter(hf, root / "b", 4, seed=2))}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        args = build_parser().parse_args(
            ["serve", "--model", str(path), "--adapter", f"a={adapters['a']}", "--replicas", "2",
             "--num-blocks", str(ENGINE["num_blocks"]), "--block-size", str(ENGINE["block_size"]),
             "--max-model-len", str(ENGINE["max_model_len"]), "--device", "cpu", "--dtype", "float32"])
        front, _, served = serving_cluster(args)
        assert served == {"a": adapters["a"]} and len(front.replicas) == 2
        client = ClusterClient(front)
        one = LLM(str(path), adapters=adapters, **{**ENGINE, "num_blocks": 256})   # room for everyone: no preemption
        yield client, one, adapters
        client.close()
    finally:
        ray.shutdown()


def expected(one, prompt, adapter, n):
    return one.generate(prompt, adapter, greedy(n))[0].token_ids


class Pin:
    """A policy that places every request on one replica (waiting while it is not ready)."""

    name = "pin"

    def __init__(self, replica_id):
        self.replica_id = replica_id

    def place(self, request, replicas):
        return self.replica_id if any(r.replica_id == self.replica_id and r.alive for r in replicas) else None

    def placed(self, request, replica_id):
        pass

    def rebalance(self, replicas, running):
        return []


def on_replica(client, replica_id, prompt, adapter, n):
    """Greedy tokens of a request placed on one replica."""
    front, policy = client.front, client.front.policy
    front.policy = Pin(replica_id)
    try:
        return client.generate([Job(prompt, adapter, greedy(n), f"pinned-{time.monotonic_ns()}")])[0].token_ids
    finally:
        front.policy = policy


def every_request_streamed_3(tracked, got, out):
    return all(len(v) >= 3 for v in got.values())


def mid_stream_on(victim):
    """A ``when`` for :func:`stream_tokens`: an output of a request running on replica ``victim`` that has more
    to come and has streamed 3 tokens (however fast the other requests finish)."""
    def when(tracked, got, out):
        t = tracked.get(out.request_id)
        return t is not None and t.replica is victim and not out.finished and len(got[out.request_id]) >= 3
    return when


def stream_tokens(client, jobs, during=None, when=every_request_streamed_3):
    """Submit ``jobs`` as one group; the delta tokens each request streamed. ``during(front, tracked)`` runs once,
    on the first output after which ``when(tracked, got, out)`` holds; ``tracked``: the front's requests not
    finished yet, by id (one can finish before submit returns)."""
    front = client.front

    async def go():
        group = await front.submit(jobs)
        tracked = front.requests.tracked
        got = {j.request_id: [] for j in jobs}
        done = during is None
        async for out in group:
            got[out.request_id] += out.delta_token_ids
            if not done and when(tracked, got, out):
                done = True
                await during(front, tracked)
        return [got[j.request_id] for j in jobs]
    return client.run(go())


def test_two_replicas_answer_like_one_engine(setup):
    client, one, _ = setup
    jobs = [Job(p, a, greedy(12), f"same-{i}-{a}") for i, p in enumerate(PROMPTS) for a in (None, "a")]
    outs = client.generate(jobs)
    assert [o.token_ids for o in outs] == [expected(one, j.prompt, j.adapter, 12) for j in jobs]
    assert all(o.finish_reason == "length" and o.prompt_token_ids == j.prompt for o, j in zip(outs, jobs))
    streamed = [t for o in client.stream(Job(PROMPTS[0], "a", greedy(5), "s")) for t in o.delta_token_ids]
    assert streamed == expected(one, PROMPTS[0], "a", 5)
    assert all(r.status.stats.num_blocks > 0 for r in client.front.replicas)
    with pytest.raises(RequestError, match="adapter 'nope' is not registered"):
        client.generate([Job(PROMPTS[0], "nope", greedy(2), "x")])
    # a replica's refusal is raised by the front as the same exception, and the group's other job is not run
    with pytest.raises(RequestError, match="outside the vocabulary"):
        client.generate([Job(PROMPTS[0], None, greedy(2), "ok-1"), Job([100000], None, greedy(2), "bad-1")])
    deadline = time.monotonic() + 10
    while client.front.requests.tracked:   # the other job's abort comes back from its replica
        assert time.monotonic() < deadline, "the group's other job was not aborted"
        time.sleep(0.02)


def test_migration_mid_stream_keeps_the_stream(setup):
    """The policy's rebalance moves a streaming request to the other replica: the stream goes on unchanged."""
    client, one, _ = setup
    front = client.front
    before, policy = front.migrations, front.policy
    jobs = [Job(PROMPTS[1], "a", greedy(30), "mig-0"), Job(PROMPTS[2], None, greedy(30), "mig-1")]

    class MoveOnce:
        name = "move-once"
        place, placed = policy.place, policy.placed

        def __init__(self):
            self.moved = None

        def rebalance(self, reports, running):
            if self.moved is None and front.requests.tracked.get("mig-0") is not None:
                f = front.requests.tracked["mig-0"]
                if f.replica is not None and len(f.tokens) >= 3:
                    self.moved = (f.replica.replica_id, len(f.tokens))
                    return [Migration("mig-0", f.replica.replica_id)]
            return []
    front.policy = mover = MoveOnce()
    try:
        got = stream_tokens(client, jobs)
    finally:
        front.policy = policy
    assert got == [expected(one, PROMPTS[1], "a", 30), expected(one, PROMPTS[2], None, 30)]
    assert mover.moved is not None and front.migrations == before + 1


def test_replica_short_of_kv_hands_requests_back(setup):
    # 24 pages of 4 tokens per replica; six requests of up to 8 + 32 tokens (10 pages each), three per replica
    client, one, _ = setup
    front = client.front
    before = front.migrations
    jobs = [Job(PROMPTS[i % 4], "a" if i % 2 else None, greedy(32), f"kv-{i}") for i in range(6)]
    got = stream_tokens(client, jobs)
    assert got == [expected(one, j.prompt, j.adapter, 32) for j in jobs]
    assert front.migrations > before


def test_adapter_loaded_at_run_time_reaches_every_replica(setup):
    client, one, adapters = setup
    client.run(client.front.load_adapter("b", adapters["b"]))
    assert client.front.adapter_names == {"a", "b"}
    want = expected(one, PROMPTS[3], "b", 8)
    assert [on_replica(client, i, PROMPTS[3], "b", 8) for i in (0, 1)] == [want, want]


def kill_until_a_request_moves(client, victim, jobs_of, want, attempts=4):
    """Kill replica ``victim`` while a request of it streams; every request of ``jobs_of(attempt)`` must give
    ``want``, and the victim must rejoin. A victim that streamed its requests to the end before the kill landed
    (a loaded host) is killed again once it rejoins, and an attempt in which no output of the victim's was
    caught mid-stream (no kill) is made again, until a request of it was rerun elsewhere."""
    front = client.front
    failovers = front.failovers
    kills = []

    async def kill(front, tracked):
        assert any(t.replica is victim for t in tracked.values())
        ray.kill(victim.actor, no_restart=False)
        kills.append(victim.incarnation)
    for attempt in range(attempts):
        incarnation = victim.incarnation
        assert stream_tokens(client, jobs_of(attempt), kill, when=mid_stream_on(victim)) == want
        if not kills or kills[-1] != incarnation:
            continue                # no output of the victim's was caught mid-stream (a loaded host): no kill
        # a bound on the wait, not a timing: a restarted replica imports torch and builds its engine again, which
        # on a loaded 2-core host has taken more than a minute
        deadline = time.monotonic() + 180
        while not (victim.ready and victim.incarnation != incarnation):
            assert time.monotonic() < deadline, "the killed replica did not rejoin"
            time.sleep(0.1)
        if front.failovers > failovers:
            break
    assert front.failovers > failovers


def test_killed_replica_loses_no_request_and_rejoins_with_adapters(setup):
    client, one, _ = setup
    names = ("a", "b", None, "a")
    kill_until_a_request_moves(
        client, client.front.replicas[0],
        lambda attempt: [Job(PROMPTS[i], names[i], greedy(40), f"kill-{attempt}-{i}") for i in range(4)],
        [expected(one, PROMPTS[i], names[i], 40) for i in range(4)])
    # the restarted replica serves the adapter given at start and the one loaded at run time
    assert on_replica(client, 0, PROMPTS[3], "b", 8) == expected(one, PROMPTS[3], "b", 8)
    assert on_replica(client, 0, PROMPTS[0], "a", 8) == expected(one, PROMPTS[0], "a", 8)


def test_server_streams_through_the_front(setup):
    import httpx
    import uvicorn

    from vlora.config import ServerConfig
    from vlora.server.app import build_app

    client, one, _ = setup
    app = build_app(client.front, ServerConfig())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), client.loop)
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and not task.done(), "server did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        models = httpx.get(f"{url}/v1/models").json()
        assert {"a", "tiny-llama"} <= {m["id"] for m in models["data"]}
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
        # a client that leaves mid-stream has its request aborted on its replica
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 80}, timeout=60) as r:
            next(r.iter_lines())
        front, deadline = client.front, time.monotonic() + 20
        while front.requests.tracked or any(rep.status.stats.num_running for rep in front.replicas):
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.05)
    finally:
        server.should_exit = True
        task.result(30)


def test_bench_dry_run_writes_its_report(setup, tmp_path):
    """benchmarks/bench_cluster.py's sweep and kill run on this cluster, in its CPU dry-run settings, shortened:
    it writes results.json with per-request records in its trace format, and loses no request."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_cluster import TRACE_FORMAT, bench, parse_args

    client, _, _ = setup
    args = parse_args(["--dry-run", "--out", str(tmp_path), "--popularities", "zipf", "--max-points", "1",
                       "--duration", "1", "--kill-duration", "2", "--rejoin-wait", "0"])
    results = client.run(bench(client.front, args, tmp_path))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["trace_format"] == TRACE_FORMAT and (tmp_path / "summary.md").is_file()
    assert [(p["replicas"], p["policy"]) for p in saved["peaks"]][:2] == [(1, "round_robin"), (2, "round_robin")]
    run = saved["runs"][0]
    assert run["records"] and set(run["records"][0]) == set(TRACE_FORMAT)
    assert all(r["replicas"] == [0] for r in run["records"])         # the 1-replica run stays on replica 0
    for r in run["records"]:                  # where the TTFT goes: each stamp after the one before
        stamps = [r["arrival_s"], r["placed_s"], r["first_token_replica_s"], r["first_token_front_s"]]
        assert all(a <= b + 0.01 for a, b in zip(stamps, stamps[1:])), stamps   # wall vs monotonic clocks
        assert r["placed_s"] <= r["submitted_s"] + 0.01
        assert r["first_token_front_s"] == pytest.approx(r["arrival_s"] + r["ttft_s"])
    steps = run["steps"]["0"]                 # replica 0's engine steps; replica 1 had none
    assert steps and all(d > 0 and n >= 0 for _, d, n, _ in steps) and not run["steps"].get("1")
    assert sum(n for _, _, n, _ in steps) >= sum(r["tokens"] for r in run["records"])
    assert saved["warmup"]["complete"] == saved["warmup"]["requests"] > 0
    kill = results["kill"]
    assert kill["requests"] > 0 and kill["lost"] == 0


def test_llm_with_replicas_runs_on_the_cluster_front(tmp_path, monkeypatch):
    """LLM(replicas=N) hands its config and adapters to a front and its requests to the front's client."""
    from vlora.cluster import client as client_mod, front as front_mod

    made = {}

    class Front:
        def __init__(self, config, cluster, adapters):
            made.update(config=config, cluster=cluster, adapters=adapters)
            self.adapter_names = frozenset(adapters)

    class Client:
        def __init__(self, front):
            self.front = front

        def generate(self, jobs):
            made["jobs"] = jobs
            return ["out"] * len(jobs)
    monkeypatch.setattr(front_mod, "ClusterFront", Front)
    monkeypatch.setattr(client_mod, "ClusterClient", Client)
    (tmp_path / "a").mkdir()
    llm = LLM("m", adapters={"a": tmp_path / "a"}, replicas=3, cluster_policy="round_robin", max_model_len=64)
    assert llm.engine is None and llm.list_adapters() == ["a"]
    assert made["cluster"].replicas == 3 and made["config"].model.max_model_len == 64
    assert made["adapters"] == {"a": str(tmp_path / "a")}
    assert llm.generate([[1, 2], [3]], [None, "a"], greedy(4)) == ["out", "out"]
    assert [(j.prompt, j.adapter, j.params.max_tokens) for j in made["jobs"]] == [([1, 2], None, 4), ([3], "a", 4)]
    assert len({j.request_id for j in made["jobs"]}) == 2
