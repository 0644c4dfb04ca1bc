"""The engine's hook for the cluster: with ``hand_back_preempted`` a request it would preempt for KV finishes
"migrate" with the tokens it has, and prompt + those tokens resumed elsewhere give the rest of its greedy answer."""

from __future__ import annotations

import pytest

from tests.helpers import make_tiny_model
from vlora import LLM, SamplingParams

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_tiny_model(tmp_path_factory.mktemp("handback"))
    return str(path)


def run(llm, prompts, n):
    ids = [llm.engine.add_request(p, None, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    final = {}
    while len(final) < len(ids):
        for out in llm.engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def test_preempted_request_is_handed_back_and_resumes_exactly(model):
    small = LLM(model, num_blocks=8, block_size=4, max_model_len=64, device="cpu", dtype="float32")
    small.engine.hand_back_preempted = True
    outs = run(small, PROMPTS, 12)                 # 2 x (8 + 12) tokens need 10 pages of 4; there are 8
    reasons = sorted(o.finish_reason for o in outs)
    assert reasons == ["length", "migrate"]
    assert small.engine.scheduler.num_unfinished == 0 and small.engine.pool.kv_pages == 0
    big = LLM(model, num_blocks=64, block_size=4, max_model_len=64, device="cpu", dtype="float32")
    want = [o.token_ids for o in run(big, PROMPTS, 12)]
    moved = next(o for o in outs if o.finish_reason == "migrate")
    i = next(k for k, o in enumerate(outs) if o is moved)
    assert 0 < len(moved.token_ids) < 12 and moved.token_ids == want[i][:len(moved.token_ids)]
    rest = run(big, [PROMPTS[i] + moved.token_ids], 12 - len(moved.token_ids))[0]
    assert moved.token_ids + rest.token_ids == want[i]


def test_hand_back_by_id(model):
    llm = LLM(model, num_blocks=16, block_size=4, max_model_len=64, device="cpu", dtype="float32")
    rid = llm.engine.add_request(PROMPTS[0], None, SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.hand_back(rid) and not llm.engine.hand_back(rid)
    out = [o for o in llm.engine.step() if o.request_id == rid]
    assert len(out) == 1 and out[0].finished and out[0].finish_reason == "migrate" and len(out[0].token_ids) == 1
    assert llm.engine.pool.kv_pages == 0


@pytest.fixture(scope="module")
def with_adapter(tmp_path_factory):
    from tests.helpers import make_peft_adapter

    root = tmp_path_factory.mktemp("handback-adapter")
    path, hf = make_tiny_model(root / "model")
    return str(path), {"a": str(make_peft_adapter(hf, root / "a", 4, seed=1))}


def test_requests_of_an_adapter_being_unloaded_stay_and_finish_here(with_adapter):
    """No other replica takes a request of an adapter being unloaded: preempted for KV, it waits here and is
    recomputed, and a migration asked of it is declined; its answer is the one of a roomy engine."""
    path, adapters = with_adapter
    kw = dict(adapters=adapters, block_size=4, max_model_len=64, device="cpu", dtype="float32")
    small = LLM(path, num_blocks=8, **kw)
    small.engine.hand_back_preempted = True
    small.engine.unloading.add("a")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [small.engine.add_request(p, "a", params) for p in PROMPTS]
    small.engine.step()
    assert not small.engine.hand_back(ids[0])
    final = {}
    while len(final) < len(ids):
        final.update((o.request_id, o) for o in small.engine.step() if o.finished)
    big = LLM(path, num_blocks=64, **kw)
    want = [o.token_ids for o in big.generate(PROMPTS, ["a", "a"], params)]
    assert [final[i].finish_reason for i in ids] == ["length", "length"]
    assert [final[i].token_ids for i in ids] == want
    assert small.engine.scheduler.num_unfinished == 0 and small.engine.pool.kv_pages == 0


def test_an_unload_that_waits_marks_the_adapter_for_the_engine(with_adapter):
    """AsyncEngine's wait policy: while the adapter's request runs, the engine declines to hand it back, and the
    unload returns once the request has finished."""
    import asyncio

    from vlora.engine.async_engine import AsyncEngine, Job

    path, adapters = with_adapter
    llm = LLM(path, adapters=adapters, num_blocks=128, block_size=4, max_model_len=256, device="cpu",
              dtype="float32")

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            group = await ae.submit([Job(PROMPTS[0], "a", SamplingParams(max_tokens=200, ignore_eos=True), "r")])
            outputs = group.__aiter__()
            await outputs.__anext__()
            unload = asyncio.ensure_future(ae.unload_adapter("a", "wait"))
            while "a" in ae.adapter_names:              # the unload has begun: new requests of "a" are refused
                await asyncio.sleep(0.005)
            assert not unload.done()                      # it waits for "r", which the engine keeps
            assert not await ae.call(lambda e: e.hand_back("r"))
            last = None
            async for last in outputs:
                pass
            assert last.finished and last.finish_reason == "length" and len(last.token_ids) == 200
            assert await unload == 1 and "a" not in llm.engine.unloading
        finally:
            await ae.shutdown(10)

    asyncio.run(main())
