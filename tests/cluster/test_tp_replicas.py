"""Replicas of tensor-parallel engines on a local Ray cluster (2 CPUs): two replicas of tensor_parallel_size 2
(gloo), as `vlora serve --replicas 2 --tensor-parallel-size 2` starts them, answer like one single-process
engine; a replica killed mid-stream loses no request and its worker process goes with it (a restart is
test_cluster.py's, on replicas of one process)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.cluster.test_cluster import ENGINE, PROMPTS, expected, greedy, mid_stream_on, on_replica, stream_tokens
from tests.helpers import make_peft_adapter, make_tiny_model
from vlora import LLM
from vlora.engine.client import Job

ray = pytest.importorskip("ray")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def pids_of(replica) -> list[int]:
    return ray.get(replica.actor.info.remote())["pids"]


def test_tp_replicas_answer_like_one_engine_and_a_killed_one_takes_its_worker_along(tmp_path):
    from vlora.cli import build_parser, serving_cluster
    from vlora.cluster.client import ClusterClient

    path, hf = make_tiny_model(tmp_path)
    adapter = str(make_peft_adapter(hf, tmp_path / "a", 8, seed=1))
    one = LLM(str(path), adapters={"a": adapter}, **{**ENGINE, "num_blocks": 256})
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        args = build_parser().parse_args(
            ["serve", "--model", str(path), "--adapter", f"a={adapter}", "--replicas", "2",
             "--tensor-parallel-size", "2", "--num-blocks", str(ENGINE["num_blocks"]),
             "--block-size", str(ENGINE["block_size"]), "--max-model-len", str(ENGINE["max_model_len"]),
             "--device", "cpu", "--dtype", "float32"])
        front, _, _ = serving_cluster(args)
        client = ClusterClient(front)
        try:
            jobs = [Job(p, (None, "a")[i % 2], greedy(10), f"tp-{i}") for i, p in enumerate(PROMPTS)]
            assert [o.token_ids for o in client.generate(jobs)] == [expected(one, j.prompt, j.adapter, 10)
                                                                   for j in jobs]
            victim = front.replicas[0]
            actor_pid, worker_pid = pids_of(victim)          # the replica's process, then its rank-1 worker
            assert actor_pid != os.getpid() and alive(worker_pid)
            failovers = front.failovers
            jobs = [Job(PROMPTS[i], ("a", None)[i % 2], greedy(30), f"tp-kill-{i}") for i in range(4)]

            async def kill(front, tracked):
                ray.kill(victim.actor, no_restart=True)
            got = stream_tokens(client, jobs, kill, when=mid_stream_on(victim))
            assert got == [expected(one, j.prompt, j.adapter, 30) for j in jobs]
            assert front.failovers > failovers
            deadline = time.monotonic() + 30
            while alive(worker_pid):                        # it polls for its parent once a second
                assert time.monotonic() < deadline, "the killed replica's worker outlived it"
                time.sleep(0.1)
            # the other replica serves on
            assert on_replica(client, 1, PROMPTS[2], "a", 8) == expected(one, PROMPTS[2], "a", 8)
        finally:
            client.close()
    finally:
        ray.shutdown()
