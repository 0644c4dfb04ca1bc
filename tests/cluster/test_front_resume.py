"""The cluster front's own detokenizing of a moved request (no Ray: the request tracker's resume and forward
steps on a stand-in tracked request): a stop string that spans the move ends the output as it would on one
engine."""

from __future__ import annotations

import asyncio

import pytest

from vlora.cluster.config import ClusterConfig
from vlora.cluster.observer import FrontObserver
from vlora.cluster.replicas import LOST, ReplicaSet
from vlora.cluster.requests import RequestTracker, TrackedRequest
from vlora.engine.client import Job, RequestGroup
from vlora.engine.sequence import RequestOutput
from vlora.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vlora.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class _Actor:
    def __init__(self):
        self.aborted = []
        self.abort = self

    def remote(self, ids):
        self.aborted.extend(ids)


class _Replica:
    actor = _Actor()


class Moves(FrontObserver):
    def __init__(self):
        self.moves = []

    def moved(self, request_id, why):
        self.moves.append((request_id, why))


def tracker_with(tokenizer) -> RequestTracker:
    """The front's request tracker over a set of no replicas (the steps under test need none)."""
    return RequestTracker(ReplicaSet([], ClusterConfig()), None, tokenizer, spawn=None, observers=[Moves()])


def moved_request(tracker, tokenizer, params: SamplingParams, before: list[int], loop) -> TrackedRequest:
    """A request that streamed ``before`` on one replica and is resumed on another."""
    job = Job("x", None, params, "r")
    group = RequestGroup((job,), loop, tracker.abort)
    f = TrackedRequest(job, group, tokenizer.encode("x"), None)
    f.tokens = list(before)
    f.emitted = 0
    f.attempt = 1
    job2 = tracker._resume_job(f)
    f.engine_id, f.replica = job2.request_id, _Replica()
    return f


def next_output(f, loop) -> RequestOutput:
    return loop.run_until_complete(f.group.__anext__())


def replica_output(f, new: list[int], finished: bool, reason: str | None) -> RequestOutput:
    return RequestOutput(f.engine_id, None, [], list(new), "", finished, reason, list(new), "")


def test_stop_string_across_the_move_on_the_last_token_finishes_stop(tokenizer, loop):
    """The token that completes a stop string begun before the move is also the last ``max_tokens`` allows: the
    replica (which sees only its own tokens) says "length"; one engine says "stop", and so does the tracker."""
    before, after = tokenizer.encode("hello"), tokenizer.encode(" world")
    assert len(after) == 1
    params = SamplingParams(max_tokens=len(before) + 1, stop=["lo wor"])
    tracker = tracker_with(tokenizer)
    f = moved_request(tracker, tokenizer, params, before, loop)
    tracker._forward(f, replica_output(f, after, True, "length"))
    out = next_output(f, loop)
    assert out.finished and out.finish_reason == "stop" and out.text == "hel"
    assert f.done


def test_stop_string_across_the_move_mid_stream_aborts_the_replica(tokenizer, loop):
    """A stop string that spans the move, found mid-stream: the tracker finishes the request and aborts it on its
    replica (which cannot see the stop string)."""
    before, after = tokenizer.encode("hello"), tokenizer.encode(" world")
    params = SamplingParams(max_tokens=20, stop=["lo wor"])
    tracker = tracker_with(tokenizer)
    f = moved_request(tracker, tokenizer, params, before, loop)
    tracker._forward(f, replica_output(f, after, False, None))
    out = next_output(f, loop)
    assert out.finished and out.finish_reason == "stop" and out.text == "hel"
    assert f.engine_id in _Replica.actor.aborted


def test_a_resumed_request_keeps_its_seed(tokenizer, loop):
    """A seeded request resumes with its own seed (the sampler's noise is keyed by the token's position, which the
    resumed request keeps); prompt logprobs are the first replica's, not asked again over the moved tokens."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2**63 - 1, prompt_logprobs=2)
    tracker = tracker_with(tokenizer)
    f = moved_request(tracker, tokenizer, params, tokenizer.encode("hello"), loop)
    job = tracker._resume_job(f)
    assert job.params.seed == params.seed and job.params.prompt_logprobs is None


def test_abort_between_placements_ends_with_the_text_streamed(tokenizer, loop):
    """A request aborted while the tracker holds it (its replica died or handed it back, not placed again yet)
    ends as on one engine: its final output holds the text of its tokens, and what streaming held back (a tail
    that could have begun a stop string) comes with it."""
    tokens = tokenizer.encode("hello world")
    params = SamplingParams(max_tokens=20, stop=["xyz"])
    tracker = tracker_with(tokenizer)
    job = Job("x", None, params, "r")
    f = TrackedRequest(job, RequestGroup((job,), loop, tracker.abort), tokenizer.encode("x"), loop.create_future())
    f.tokens, f.emitted, f.aborted = list(tokens), len("hello wor"), True
    loop.run_until_complete(tracker._drive(f))
    out = next_output(f, loop)
    assert out.finished and out.finish_reason == "abort"
    assert out.text == "hello world" and out.delta_text == "ld" and out.token_ids == tokens


def test_a_broken_output_stream_aborts_the_request_on_its_replica(tokenizer, loop):
    """The stream of a replica that still runs broke: the request is placed again, and the replica is told to
    drop its copy (else it would hold its KV until it finished)."""
    class Submit:
        def remote(self, job):
            async def accepted():
                f.inbox.put_nowait(LOST)              # the listener finds the stream broken
                return None
            return accepted()

    class Replica:
        replica_id, ready = 0, True
        actor = _Actor()
        actor.submit = Submit()

    tracker = tracker_with(tokenizer)
    job = Job("x", None, SamplingParams(max_tokens=4), "r")
    f = TrackedRequest(job, RequestGroup((job,), loop, tracker.abort), tokenizer.encode("x"), loop.create_future())
    r = Replica()
    loop.run_until_complete(tracker._attempt(f, r))
    assert r.actor.aborted == ["r#0"] and tracker.failovers == 1 and not r.ready
    assert tracker.observers[0].moves == [("r", "lost")]
    assert f.replica is None and not f.done and not tracker.replicas.routes


def test_a_refusal_keeps_the_field_at_fault():
    """A replica's RequestError about a field other than the prompt reaches the tracker naming that field."""
    from vlora.engine.client import raise_refusal, refusal
    from vlora.engine.engine import RequestError

    with pytest.raises(RequestError) as e:
        raise_refusal(refusal(RequestError("task_head=True needs an adapter with a vision task head", "task_head")))
    assert e.value.param == "task_head"
    with pytest.raises(RequestError) as e:
        raise_refusal(refusal(RequestError("prompt is empty")))
    assert e.value.param is None
