"""Adapters loaded on first request, without a server: :class:`OnDemandAdapters` on a fake engine client (which
adapters count as busy, never evicted, while requests come, go, are refused or are cancelled) and
:class:`RecentMisses`.

The fake keeps the engine's guarantees: ``submit`` takes the jobs all or none; once it has taken them, each ends
with a final output (``on_finish``), an abort included; a caller cancelled after the engine took them gets its
requests aborted (as :class:`vlora.engine.async_engine.AsyncEngine` does)."""

from __future__ import annotations

import asyncio

import pytest

from vlora.engine.client import AdapterNotFound, Job, QueueFull, RequestGroup
from vlora.sampling_params import SamplingParams
from vlora.engine.sequence import RequestOutput
from vlora.server.metrics import ServerMetrics
from vlora.server.on_demand import AdaptersBusy, OnDemandAdapters, RecentMisses


class FakeEngine:
    """Adapters by name; ``submit`` takes jobs at once and answers when ``answer`` is set (or at once when it is
    None); ``finish(rid)`` ends a request as the engine would."""

    def __init__(self):
        self.adapter_names: frozenset[str] = frozenset()
        self.live: dict[str, RequestGroup] = {}
        self.answer: asyncio.Event | None = None
        self.taken = asyncio.Event()          # set once submit has taken its jobs
        self.refuse: BaseException | None = None
        self.unloaded: list[str] = []

    async def submit(self, jobs, on_finish=None) -> RequestGroup:
        if self.refuse is not None:
            raise self.refuse
        for j in jobs:
            if j.adapter is not None and j.adapter not in self.adapter_names:
                raise AdapterNotFound(j.adapter)
        group = RequestGroup(tuple(jobs), asyncio.get_running_loop(), self.abort, on_finish)
        self.live.update((j.request_id, group) for j in jobs)
        self.taken.set()
        if self.answer is not None:
            try:
                await self.answer.wait()
            except asyncio.CancelledError:
                group.abort()               # AsyncEngine: the caller went away after the jobs were taken
                raise
        return group

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            asyncio.get_running_loop().call_soon(self.finish, rid, "abort")

    def finish(self, rid: str, reason: str = "stop") -> None:
        group = self.live.pop(rid, None)
        if group is not None:
            adapter = next(j.adapter for j in group.jobs if j.request_id == rid)
            group.deliver(RequestOutput(rid, adapter, [1], [2], "x", True, reason, [2], "x"))

    async def load_adapter(self, name, path) -> None:
        self.adapter_names |= {name}

    async def unload_adapter(self, name, policy="wait") -> int:
        self.adapter_names -= {name}
        self.unloaded.append(name)
        return 0


def jobs(adapter: str | None, rid: str, n: int = 1) -> list[Job]:
    return [Job([1, 2], adapter, SamplingParams(max_tokens=1), f"{rid}-{i}") for i in range(n)]


def on_demand(engine: FakeEngine, limit: int | None = 1) -> OnDemandAdapters:
    async def locate(name):
        return f"/adapters/{name}"

    async def register(name, path):
        await engine.load_adapter(name, path)
        return True

    return OnDemandAdapters(engine, locate, register, limit, ServerMetrics(engine, "base"))


def ignore(out: RequestOutput, timing) -> None:
    pass


async def with_idle_a() -> tuple[FakeEngine, OnDemandAdapters]:
    """Adapter a loaded on request (at most one), its request finished."""
    engine = FakeEngine()
    od = on_demand(engine)
    engine.finish((await od.submit(jobs("a", "zero"), ignore)).request_ids[0])
    return engine, od


async def idle_a_is_evicted_for_b(engine: FakeEngine, od: OnDemandAdapters) -> None:
    assert not od.running
    await od.submit(jobs("b", "last"), ignore)
    assert engine.unloaded == ["a"]


async def settle() -> None:
    """Let the callbacks already scheduled (abort outputs) run."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_cancelled_submit_releases_its_requests_once():
    """A request cancelled after the engine took its jobs ends with an abort output; the adapter stays busy
    for the other request still running on it, so another adapter's load finds no room (429)."""
    async def main():
        engine = FakeEngine()
        od = on_demand(engine)
        running = await od.submit(jobs("a", "first"), ignore)        # loads a, stays running
        engine.answer, engine.taken = asyncio.Event(), asyncio.Event()
        cancelled = asyncio.ensure_future(od.submit(jobs("a", "second", 2), ignore))
        await engine.taken.wait()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        engine.answer.set()                     # the engine's answer comes after the caller left
        await settle()                          # the cancelled request's abort outputs have arrived
        assert not any(rid.startswith("second") for rid in engine.live)
        engine.answer = None
        with pytest.raises(AdaptersBusy):       # a is still busy with "first": not evicted
            await od.submit(jobs("b", "third"), ignore)
        assert engine.unloaded == [] and "a" in engine.adapter_names
        engine.finish(running.request_ids[0])
        await od.submit(jobs("b", "fourth"), ignore)              # a idle now: evicted for b
        assert engine.unloaded == ["a"]
        assert dict(od.running) == {"b": {"fourth-0"}}

    asyncio.run(main())


def test_a_refused_submit_releases_its_requests():
    async def main():
        engine, od = await with_idle_a()
        engine.refuse = QueueFull("full")
        with pytest.raises(QueueFull):
            await od.submit(jobs("a", "first", 3), ignore)
        engine.refuse = None
        await idle_a_is_evicted_for_b(engine, od)

    asyncio.run(main())


def test_a_submit_cancelled_before_the_engine_answers_with_a_refusal_releases_its_requests():
    """The caller goes away while the engine still decides; the engine then refuses: nothing runs on a."""
    async def main():
        engine, od = await with_idle_a()
        gate = asyncio.Event()
        submit = engine.submit

        async def slow_refusal(js, on_finish=None):
            await asyncio.shield(gate.wait())
            raise QueueFull("full")

        engine.submit = slow_refusal
        task = asyncio.ensure_future(od.submit(jobs("a", "first"), ignore))
        await settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await settle()
        engine.submit = submit
        await idle_a_is_evicted_for_b(engine, od)

    asyncio.run(main())


def test_requests_finish_one_by_one():
    async def main():
        engine = FakeEngine()
        od = on_demand(engine)
        group = await od.submit(jobs("a", "first", 2), ignore)
        engine.finish(group.request_ids[0])
        with pytest.raises(AdaptersBusy):
            await od.submit(jobs("b", "second"), ignore)
        engine.finish(group.request_ids[1])
        engine.finish(group.request_ids[1])       # a second final output for one request changes nothing
        await idle_a_is_evicted_for_b(engine, od)

    asyncio.run(main())


def test_recent_misses_expire_and_hold_only_recent_names():
    now = [0.0]
    misses = RecentMisses(60.0, clock=lambda: now[0])
    misses.add("org/a")
    now[0] = 30.0
    misses.add("org/b")
    assert "org/a" in misses and "org/b" in misses and "org/c" not in misses
    now[0] = 60.0
    assert "org/a" not in misses and "org/b" in misses
    misses.add("org/b")                     # missed again: in for another 60 s
    now[0] = 100.0
    assert "org/b" in misses
    now[0] = 120.0
    assert "org/b" not in misses and not misses._until
