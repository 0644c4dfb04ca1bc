"""The cluster front's own detokenizing of a moved request (no Ray: the front's resume and forward steps on a
stand-in flight): a stop string that spans the move ends the output as it would on one engine."""

from __future__ import annotations

import asyncio

import pytest

from vlora.cluster.front import ClusterFront, _Flight
from vlora.engine.client import EngineInfo, Job, RequestGroup
from vlora.engine.detokenizer import Detokenizer
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


def front_with(tokenizer) -> ClusterFront:
    front = object.__new__(ClusterFront)          # the steps under test need no replicas
    front.info = EngineInfo("tiny", tokenizer, 128, tokenizer.vocab_size)
    front._detok = Detokenizer(tokenizer)
    return front


def moved_flight(front, tokenizer, params: SamplingParams, before: list[int], loop) -> _Flight:
    """A flight that streamed ``before`` on one replica and is resumed on another."""
    job = Job("x", None, params, "r")
    group = RequestGroup((job,), loop, front._abort)
    f = _Flight(job, group, tokenizer.encode("x"), None)
    f.tokens = list(before)
    f.emitted = 0
    f.attempt = 1
    job2 = front._resume_job(f)
    f.engine_id, f.replica = job2.request_id, _Replica()
    return f


def replica_output(f, new: list[int], finished: bool, reason: str | None) -> RequestOutput:
    return RequestOutput(f.engine_id, None, [], list(new), "", finished, reason, list(new), "")


def test_stop_string_across_the_move_on_the_last_token_finishes_stop(tokenizer, loop):
    """The token that completes a stop string begun before the move is also the last ``max_tokens`` allows: the
    replica (which sees only its own tokens) says "length"; one engine says "stop", and so does the front."""
    before, after = tokenizer.encode("hello"), tokenizer.encode(" world")
    assert len(after) == 1
    params = SamplingParams(max_tokens=len(before) + 1, stop=["lo wor"])
    front = front_with(tokenizer)
    f = moved_flight(front, tokenizer, params, before, loop)
    front._forward(f, replica_output(f, after, True, "length"))
    out = f.group._queue.get_nowait()
    assert out.finished and out.finish_reason == "stop" and out.text == "hel"
    assert f.done


def test_stop_string_across_the_move_mid_stream_aborts_the_replica(tokenizer, loop):
    """A stop string that spans the move, found mid-stream: the front finishes the request and aborts it on its
    replica (which cannot see the stop string)."""
    before, after = tokenizer.encode("hello"), tokenizer.encode(" world")
    params = SamplingParams(max_tokens=20, stop=["lo wor"])
    front = front_with(tokenizer)
    f = moved_flight(front, tokenizer, params, before, loop)
    front._forward(f, replica_output(f, after, False, None))
    out = f.group._queue.get_nowait()
    assert out.finished and out.finish_reason == "stop" and out.text == "hel"
    assert f.engine_id in _Replica.actor.aborted


def test_a_resumed_request_keeps_its_seed(tokenizer, loop):
    """A seeded request resumes with its own seed (the sampler's noise is keyed by the token's position, which the
    resumed request keeps); prompt logprobs are the first replica's, not asked again over the moved tokens."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2**63 - 1, prompt_logprobs=2)
    front = front_with(tokenizer)
    f = moved_flight(front, tokenizer, params, tokenizer.encode("hello"), loop)
    job = front._resume_job(f)
    assert job.params.seed == params.seed and job.params.prompt_logprobs is None


def test_abort_between_placements_ends_with_the_text_streamed(tokenizer, loop):
    """A request aborted while the front holds it (its replica died or handed it back, not placed again yet)
    ends as on one engine: its final output holds the text of its tokens, and what streaming held back (a tail
    that could have begun a stop string) comes with it."""
    tokens = tokenizer.encode("hello world")
    params = SamplingParams(max_tokens=20, stop=["xyz"])
    front = front_with(tokenizer)
    front._flights = {}
    job = Job("x", None, params, "r")
    f = _Flight(job, RequestGroup((job,), loop, front._abort), tokenizer.encode("x"), loop.create_future())
    f.tokens, f.emitted, f.aborted = list(tokens), len("hello wor"), True
    loop.run_until_complete(front._drive(f))
    out = f.group._queue.get_nowait()
    assert out.finished and out.finish_reason == "abort"
    assert out.text == "hello world" and out.delta_text == "ld" and out.token_ids == tokens


def test_a_broken_output_stream_aborts_the_request_on_its_replica(tokenizer, loop):
    """The stream of a replica that still runs broke: the request is placed again, and the replica is told to
    drop its copy (else it would hold its KV until it finished)."""
    from vlora.cluster.front import _LOST

    class Submit:
        def remote(self, job):
            async def accepted():
                f.inbox.put_nowait(_LOST)             # the listener finds the stream broken
                return None
            return accepted()

    class Replica:
        replica_id, ready = 0, True
        actor = _Actor()
        actor.submit = Submit()

    front = front_with(tokenizer)
    front._by_engine, front._changed, front.failovers = {}, None, 0
    job = Job("x", None, SamplingParams(max_tokens=4), "r")
    f = _Flight(job, RequestGroup((job,), loop, front._abort), tokenizer.encode("x"), loop.create_future())
    r = Replica()
    loop.run_until_complete(front._attempt(f, r))
    assert r.actor.aborted == ["r#0"] and front.failovers == 1 and f.moves == 1 and not r.ready
    assert f.replica is None and not f.done and not front._by_engine


def test_a_refusal_keeps_the_field_at_fault():
    """A replica's RequestError about a field other than the prompt reaches the front naming that field."""
    from vlora.cluster.replica import raise_refusal, refusal
    from vlora.engine.engine import RequestError

    with pytest.raises(RequestError) as e:
        raise_refusal(refusal(RequestError("task_head=True needs an adapter with a vision task head", "task_head")))
    assert e.value.param == "task_head"
    with pytest.raises(RequestError) as e:
        raise_refusal(refusal(RequestError("prompt is empty")))
    assert e.value.param is None
