"""The async engine hands an iteration's outputs to the event loop while the next forward runs on the device:
a stream's work then overlaps the forward instead of stalling the engine thread's host work."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import make_tiny_model
from vlora import LLM, SamplingParams
from vlora.engine.async_engine import AsyncEngine, Job

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("handover"))
    return str(path)


def test_outputs_reach_the_loop_before_the_next_forward_is_waited_on(model_path, monkeypatch):
    llm = LLM(model_path, num_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=4)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    reference = [o.token_ids for o in llm.generate(PROMPTS, None, params)]
    held_at_sample, real_sample = [], llm.engine.runner.sampler.sample

    def sample(*args, **kw):           # the first wait on an iteration's forward
        held_at_sample.append(sum(len(v) for v in ae._held.values()))
        return real_sample(*args, **kw)

    monkeypatch.setattr(llm.engine.runner.sampler, "sample", sample)

    async def main():
        ae.start()
        group = await ae.submit([Job(p, None, params, f"r{i}") for i, p in enumerate(PROMPTS)])
        streamed = {rid: [] for rid in group.request_ids}
        async for outs in group.batches():
            for o in outs:
                streamed[o.request_id] += o.delta_token_ids
        await ae.shutdown(timeout=10)
        return [streamed[rid] for rid in group.request_ids]

    ae = AsyncEngine(llm.engine)
    assert asyncio.run(main()) == reference             # every token streamed once, in order
    assert len(held_at_sample) >= 5 and not any(held_at_sample)
    assert not ae._held                                 # nothing left behind once the engine went idle
