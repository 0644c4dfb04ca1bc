"""RequestGroup.batches: a stream that falls behind gets what is queued in one batch, one output per request."""

import asyncio

import pytest

from vlora.engine.client import EngineFailed, Job, RequestGroup
from vlora.engine.sequence import RequestOutput
from vlora.sampling_params import SamplingParams


def _out(rid: str, tokens: list[int], text: str, new: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], tokens, text, finished, "length" if finished else None,
                         tokens[-new:], text[-new:])


def _group(loop) -> RequestGroup:
    jobs = tuple(Job([1, 2], None, SamplingParams(), rid) for rid in ("r0", "r1"))
    return RequestGroup(jobs, loop, lambda ids: None)


def test_queued_outputs_fold_per_request_in_order():
    async def main():
        g = _group(asyncio.get_running_loop())
        g.deliver(_out("r0", [5], "a", 1))
        g.deliver(_out("r1", [6], "b", 1))
        g.deliver(_out("r0", [5, 7], "ac", 1, finished=True))
        batches = g.batches()
        first = await batches.__anext__()
        assert [o.request_id for o in first] == ["r0", "r1"]
        r0, r1 = first
        assert (r0.delta_token_ids, r0.delta_text, r0.finished, r0.token_ids) == ([5, 7], "ac", True, [5, 7])
        assert (r1.delta_token_ids, r1.delta_text, r1.finished) == ([6], "b", False)
        g.deliver(_out("r1", [6, 8], "bd", 1, finished=True))
        second = await batches.__anext__()
        assert [(o.request_id, o.delta_token_ids, o.finished) for o in second] == [("r1", [8], True)]
        with pytest.raises(StopAsyncIteration):       # every request finished: the stream ends
            await batches.__anext__()

    asyncio.run(main())


def test_a_failure_after_outputs_yields_them_then_raises():
    async def main():
        g = _group(asyncio.get_running_loop())
        g.deliver(_out("r0", [5], "a", 1))
        g.deliver(EngineFailed("boom"))
        batches = g.batches()
        assert [o.request_id for o in await batches.__anext__()] == ["r0"]
        with pytest.raises(EngineFailed):
            await batches.__anext__()

    asyncio.run(main())
