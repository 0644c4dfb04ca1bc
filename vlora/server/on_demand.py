"""Adapters loaded on first request (``vlora serve --adapter-dir DIR``, ``--allow-hub-adapters``).

A request whose ``model`` names an adapter that is not registered but can be found (DIR/<model>, or a Hub id)
has it loaded, then is served; the load comes once the request is validated (one refused with 400 loads
nothing), when its jobs are submitted. :class:`OnDemandAdapters` decides when: one load per name at a time
(concurrent requests for it await the same task), at most ``max_loaded_adapters`` of them registered (the least
recently used with no request running is unloaded to make room: the LRU policy of the adapter store,
:func:`vlora.lora.device_store.least_recent`), and the loads and evictions counted in the metrics. The server
says where an adapter comes from (``locate``) and registers it (``register``: what a refusal is); the engine
client reads, validates and packs it in a process of its own (vlora/lora/loader.py), off the engine thread and
the event loop (:meth:`vlora.engine.async_engine.AsyncEngine.load_adapter`).

Adapters registered otherwise (at start, through /v1/load_lora_adapter) are never unloaded here.

A Hub id the Hub did not give (no such repository, no adapter in it, or the Hub unreachable) is a 404 without
asking the Hub again for :data:`HUB_MISS_SECONDS` (:class:`RecentMisses`): a client repeating a missing id does
not repeat the lookups.

    request (validated, its jobs built) -> submit(jobs): the adapter counted busy until its requests finish
        -> ensure(name) --first--> task: locate(name) -> make room (evict LRU idle) -> register -> done
                        --others-> await the same task
        -> engine.submit(jobs)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence

from vlora.engine.client import AdapterNotFound, EngineClient, Job, RequestGroup, Timing
from vlora.engine.sequence import RequestOutput
from vlora.lora.device_store import least_recent
from vlora.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

HUB_MISS_SECONDS = 60.0     # a Hub id not found is not looked up again for this long


class AdaptersBusy(RuntimeError):
    """Every adapter loaded on request has requests running: none can make room for another (429)."""


class OnDemandAdapters:
    """The adapters this server loaded on first request: which are registered, which are loading, which are busy.

    ``locate(name)`` is the directory of adapter ``name`` (it raises the error the request gets when there is
    none); ``register(name, path)`` registers it with the engine and returns True, or False when the name was
    registered meanwhile by other means (then it is not counted here), and raises the error the request gets
    when the adapter is refused. Everything here runs on the server's event loop.
    """

    def __init__(self, engine: EngineClient, locate: Callable[[str], Awaitable[str]],
                 register: Callable[[str, str], Awaitable[bool]], limit: int | None, metrics: ServerMetrics):
        self.engine = engine
        self.locate = locate
        self.register = register
        self.limit = limit
        self.metrics = metrics
        self.loaded: OrderedDict[str, None] = OrderedDict()     # registered here, least recently used first
        self.loading: dict[str, asyncio.Task] = {}              # one load per name
        self.evicting: dict[str, asyncio.Task] = {}             # being unloaded to make room
        self.running: dict[str | None, set[str]] = {}           # ids of requests submitted, not finished
        self._reserved = 0                                      # loads under way that room was made for

    async def ensure(self, name: str) -> None:
        """Return once adapter ``name`` is registered: at once if it is, else after loading it (or awaiting the
        load under way). Raises what ``locate`` and ``register`` raise, or :class:`AdaptersBusy`."""
        while name in self.evicting:            # loaded again once it is gone
            await asyncio.shield(self.evicting[name])
        if name in self.engine.adapter_names and name not in self.loading:
            if name in self.loaded:
                self.loaded.move_to_end(name)
            return
        task = self.loading.get(name)
        if task is None:
            task = self.loading[name] = asyncio.ensure_future(self._load(name))
            task.add_done_callback(_forget(self.loading, name))
        # shielded: a client that leaves does not cancel the load the others await
        await asyncio.shield(task)

    async def submit(self, jobs: Sequence[Job], on_finish: Callable[[RequestOutput, Timing], None]) -> RequestGroup:
        """``engine.submit(jobs, on_finish)`` once the jobs' adapter is registered (:meth:`ensure`: loaded now if it
        is not). The adapter counts as busy (never evicted) from before it is ensured until the jobs finish, so it
        stays registered between its load and the submission. Raises what :meth:`ensure` and ``engine.submit``
        raise.

        Each job counts until it is released, once: by its final output when the engine took the jobs, at once
        when the engine refused them (it takes all or none) or they never reached it. A caller cancelled while
        the engine decides does not cancel the engine's submission: its outcome is awaited, and the requests it
        took are aborted (their abort outputs release them)."""
        adapter = jobs[0].adapter if jobs else None
        ids = {j.request_id for j in jobs}

        def finished(out: RequestOutput, timing: Timing) -> None:
            self._release(adapter, (out.request_id,))
            on_finish(out, timing)

        self.running.setdefault(adapter, set()).update(ids)
        try:
            if adapter is not None:
                await self.ensure(adapter)
            task = asyncio.ensure_future(self.engine.submit(jobs, finished))
        except BaseException:
            self._release(adapter, ids)
            raise
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._abandoned(adapter, ids))
            raise
        except BaseException:
            self._release(adapter, ids)
            raise

    def _abandoned(self, adapter: str | None, ids: set[str]) -> Callable[[asyncio.Task], None]:
        """A done callback for the engine's submission of ``ids``, whose caller went away: refused, they are
        released; taken, they are aborted."""
        def done(task: asyncio.Task) -> None:
            if task.cancelled() or task.exception() is not None:
                self._release(adapter, ids)
            else:
                task.result().abort()
        return done

    def _release(self, adapter: str | None, ids: Iterable[str]) -> None:
        busy = self.running.get(adapter)
        if busy is not None:
            busy.difference_update(ids)
            if not busy:
                del self.running[adapter]

    async def _load(self, name: str) -> None:
        start = time.perf_counter()
        path = await self.locate(name)
        await self._make_room()
        try:
            if not await self.register(name, path):
                return
            seconds = time.perf_counter() - start
        finally:
            self._reserved -= 1
        self.loaded[name] = None
        self.metrics.adapter_loads.inc()
        self.metrics.adapter_load_seconds.observe(seconds)
        log.info("loaded adapter %r on first request (%.3f s)", name, seconds)

    async def _make_room(self) -> None:
        """Reserve room for one more adapter, evicting the least recently used idle ones while there is none."""
        for gone in [n for n in self.loaded if n not in self.engine.adapter_names]:
            del self.loaded[gone]              # unloaded through /v1/unload_lora_adapter
        while self.limit is not None and len(self.loaded) + self._reserved >= self.limit:
            victim = least_recent(self.loaded, self.running)
            if victim is None:
                raise AdaptersBusy(f"all {self.limit} adapters loaded on request have requests running "
                                   f"(--max-loaded-adapters {self.limit}); retry later")
            del self.loaded[victim]
            task = self.evicting[victim] = asyncio.ensure_future(self._evict(victim))
            task.add_done_callback(_forget(self.evicting, victim))
            await asyncio.shield(task)
        self._reserved += 1

    async def _evict(self, name: str) -> None:
        # "wait": a request that reached the engine after it was chosen finishes before it goes
        try:
            await self.engine.unload_adapter(name, "wait")
        except AdapterNotFound:             # unloaded meanwhile through /v1/unload_lora_adapter
            return
        self.metrics.adapter_evictions.inc()
        self.metrics.forget(name)
        log.info("unloaded adapter %r (least recently used of those loaded on request)", name)


class RecentMisses:
    """Names not found lately: each is in for ``seconds`` after its :meth:`add` (``clock``: monotonic seconds).
    Holds only names added in the last ``seconds``."""

    def __init__(self, seconds: float = HUB_MISS_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()      # name -> when it expires, soonest first

    def add(self, name: str) -> None:
        self._until.pop(name, None)
        self._until[name] = self.clock() + self.seconds
        self._expire()

    def __contains__(self, name: str) -> bool:
        self._expire()
        return name in self._until

    def _expire(self) -> None:
        now = self.clock()
        while self._until and next(iter(self._until.values())) <= now:
            self._until.popitem(last=False)


def _forget(tasks: dict[str, asyncio.Task], name: str) -> Callable[[asyncio.Task], None]:
    """A done callback: ``name``'s task leaves ``tasks``, its exception retrieved (its awaiters, if any are
    left, have it)."""
    def done(task: asyncio.Task) -> None:
        tasks.pop(name, None)
        if not task.cancelled():
            task.exception()
    return done
