"""The engine on its own thread, for asyncio servers.

One thread owns the :class:`Engine` and is the only one that touches it. The
asyncio side pushes commands (add a group of requests, abort, unload an
adapter, run a function) onto a queue guarded by a condition; the thread runs
them between steps, steps while there is work and sleeps on the condition when
there is none. Each output goes to the asyncio queue of its
:class:`RequestGroup` through ``loop.call_soon_threadsafe``.

    submit(jobs) --queue--> [engine thread: commands, step(), dispatch] --call_soon_threadsafe--> group
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from vlora.engine.client import (AdapterExists, AdapterNotFound, EngineFailed, EngineInfo, EngineStats, Job,
                                 QueueFull, RequestFailed, RequestGroup, ShuttingDown, Timing, VisionInfo)
from vlora.engine.engine import Engine
from vlora.engine.observer import StepObserver
from vlora.engine.sequence import RequestOutput
from vlora.lora.loader import LOADER

log = logging.getLogger(__name__)


def _settle(fut: asyncio.Future, result, exc: BaseException | None, on_cancelled: Callable[[], None] | None) -> None:
    if fut.cancelled():             # the caller went away while the engine thread worked
        if exc is None and on_cancelled is not None:
            on_cancelled()
    elif exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _raise(exc: BaseException):
    raise exc


def _deliver_all(items: list[tuple[RequestGroup, RequestOutput | BaseException]]) -> None:
    for group, item in items:
        group.deliver(item)


def _one_intra_op_thread() -> None:
    """Start of the adapter-loading thread: its torch ops run on one core (an OpenMP team of one, set per
    thread), so a load never takes the cores of the engine's forward nor spins its own team of threads beside
    it. ``torch.set_num_threads`` also sets the count threads started later take: a thread of its own puts that
    back."""
    default = torch.get_num_threads()
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,))
    restore.start()
    restore.join()


def _info_of(engine: Engine) -> EngineInfo:
    context = min(engine.max_model_len, engine.pool.num_pages * engine.block_size)
    cfg = engine.model.cfg
    return EngineInfo(engine.model_name, engine.tokenizer, context, cfg.vocab_size, VisionInfo.of(engine.vision),
                      getattr(cfg, "model_type", None))


class AsyncEngine:
    """An :class:`~vlora.engine.client.EngineClient` serving one :class:`Engine` from a thread of its own."""

    info: EngineInfo
    adapter_names: frozenset[str]           # servable adapters, published by the engine thread
    stats: EngineStats                      # published by the engine thread
    max_queued_requests: int
    failure: BaseException | None
    on_fatal: Callable[[BaseException], None] | None

    def __init__(self, engine: Engine, max_queued_requests: int = 256,
                 on_fatal: Callable[[BaseException], None] | None = None):
        """``on_fatal(exc)``: called once on the engine thread when a step raises (the engine cannot go on),
        after every request in flight has been answered with :class:`EngineFailed`; the server exits then."""
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.on_fatal = on_fatal
        self._cv = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()   # guarded by _cv
        self._pending_adds = 0                                  # guarded by _cv
        self._idle = threading.Event()
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        # engine thread only
        # request id -> its group, until its final output is routed (the engine knows the request itself)
        self._live: dict[str, RequestGroup] = {}
        self._draining: set[str] = engine.unloading       # adapters being unloaded (the engine keeps their requests)
        self._unloads: list[tuple[str, asyncio.AbstractEventLoop, asyncio.Future, int]] = []
        self._busy = False
        # adapters read in the loader process are finished here (their pool copy pinned), one at a time, beside
        # the engine thread
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="vlora-adapter-load", initializer=_one_intra_op_thread)
        # deliveries routed but not yet handed to the event loops: sent while the next forward runs on the
        # GPU (the runner's ``before_sync``), so that the event loop's stream work, which needs the
        # interpreter lock, runs while this thread waits on the GPU instead of stalling its host work
        self._held: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        engine.observe(_HandOver(self._deliver_held))
        self.stats = self._snapshot()
        self.adapter_names = frozenset(engine.adapters.names())   # servable adapters, published
        self.info = _info_of(engine)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vlora-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (safe to call from a signal handler)."""
        self._accepting = False

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let running ones finish (up to ``timeout`` s, then abort them), stop.

        Returns whether everything finished without being aborted.
        """
        self.begin_shutdown()
        if self._thread is None:
            return True
        loop = asyncio.get_running_loop()
        drained = await loop.run_in_executor(None, self._idle.wait, timeout)
        if not drained:
            log.warning("drain timeout: aborting %d request(s)", self.stats.num_running + self.stats.num_waiting)
            self._push(self._abort_all)
        with self._cv:
            self._stopping = True
            self._cv.notify()
        await loop.run_in_executor(None, self._thread.join)
        self._loader.shutdown(wait=False)
        return drained

    # -- the asyncio side -----------------------------------------------------------------
    async def submit(self, jobs: Sequence[Job],
                     on_finish: Callable[[RequestOutput, Timing], None] | None = None) -> RequestGroup:
        """Add ``jobs`` to the engine, all or none; raises QueueFull, ShuttingDown or RequestError."""
        group = RequestGroup(tuple(jobs), asyncio.get_running_loop(), self.abort, on_finish)
        await self.add(group)
        return group

    async def add(self, group: RequestGroup) -> None:
        """Add ``group``'s jobs to the engine, all or none; their outputs go to ``group.deliver`` on
        ``group.loop``. Raises QueueFull or RequestError."""
        await self.add_nowait(group)

    def add_nowait(self, group: RequestGroup) -> asyncio.Future:
        """:meth:`add`, queued now, ahead of any command issued after this call; the future returned (of the
        running loop) settles once the engine thread took or refused the jobs. Raises QueueFull and ShuttingDown at once.
        Anything with a RequestGroup's ``jobs``, ``request_ids``, ``loop``, ``deliver`` and ``abort`` may stand
        for one (:mod:`vlora.engine.core_process` relays the outputs to the server's process)."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down" if self.failure is None
                               else f"the engine failed: {self.failure!r}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        jobs = group.jobs
        with self._cv:
            queued = self.stats.num_waiting + self._pending_adds
            if queued + len(jobs) > self.max_queued_requests:
                raise QueueFull(f"{queued} requests are waiting (limit {self.max_queued_requests}); retry later")
            self._pending_adds += len(jobs)
            self._push_locked(lambda: self._reply(loop, fut, lambda: self._add(group), group.abort))
        return fut

    async def call(self, fn: Callable[[Engine], object]):
        """Run ``fn(engine)`` on the engine thread between two steps; return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._push(lambda: self._reply(loop, fut, lambda: fn(self.engine)))
        return await fut

    async def load_adapter(self, name: str, path: str) -> None:
        """Register the PEFT adapter in directory ``path`` as ``name``; raises AdapterError if it is refused
        (AdapterExists if the name is taken, an adapter being unloaded included).

        The adapter is read, validated and packed in a process of its own (:data:`vlora.lora.loader.LOADER`) and
        finished (its pool copy pinned) on a thread of its own, while the engine serves on; the engine thread only
        adds the result to its registry between two steps."""
        def taken() -> AdapterExists:
            return AdapterExists(f"an adapter named {name!r} is already loaded"
                                 + (" (it is being unloaded)" if name in self._draining else ""))

        registry = self.engine.adapters
        registry.check_name(name, taken=False)
        if name in registry:
            raise taken()
        read = await LOADER.read(registry.spec, name, path)
        prepared = await asyncio.get_running_loop().run_in_executor(self._loader, registry.finish, read)

        def register(e: Engine) -> None:
            if name in e.adapters:
                raise taken()
            e.adapters.add(prepared)
        await self.call(register)

    async def unload_adapter(self, name: str, policy: str = "wait") -> int:
        """Unregister adapter ``name``; returns how many of its requests were waited for or aborted.

        ``wait``: new requests for it are refused at once, running ones finish first.
        ``abort``: its requests are aborted (they end with finish_reason "abort").
        """
        if policy not in ("wait", "abort"):
            raise ValueError(f"policy must be wait or abort, got {policy!r}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._push(lambda: self._start_unload(name, policy, loop, fut))
        return await fut

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (each ends with finish_reason "abort"); ids no longer served are skipped."""
        self._push(lambda: [self.engine.abort(rid) for rid in request_ids])

    def _push(self, command: Callable[[], None]) -> None:
        with self._cv:
            self._push_locked(command)

    def _push_locked(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._idle.clear()
        self._cv.notify()

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._commands and not self._busy and not self._stopping:
                    self._idle.set()
                    self._cv.wait()
                if self._stopping and not self._commands and not self._busy:
                    self._idle.set()
                    return
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                try:
                    command()
                except Exception:
                    log.exception("engine command failed")
            self.stats = self._snapshot()
            if self.failure is None and self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as e:
                    log.exception("engine step failed; aborting every request in flight")
                    self._fail(e)
                    outputs = []
                    if self.on_fatal is not None:
                        try:
                            self.on_fatal(e)
                        except Exception:
                            log.exception("on_fatal callback failed")
                self._dispatch(outputs)
                # a decode queued behind this step runs on the GPU now (async scheduling), or a failed group's
                # other requests were aborted: hand the outputs over at once
                if self.engine.in_flight or any(o.finish_reason == "error" for o in outputs):
                    self._deliver_held()
                if self._unloads:
                    self._finish_unloads()
                self.stats = self._snapshot()
            self._busy = self.failure is None and self.engine.has_unfinished()
            if not self._busy:                   # no forward comes to carry them
                self._deliver_held()

    def _snapshot(self) -> EngineStats:
        e = self.engine
        return EngineStats(len(e.scheduler.running), len(e.scheduler.waiting),
                           e.pool.kv_pages, e.pool.num_pages,
                           e.orchestrator.mode.value, e.runner.modes.num_switches,
                           tuple(e.runner.iterations.items()))

    def _publish_adapter_names(self) -> None:
        self.adapter_names = frozenset(self.engine.adapters.names()) - self._draining

    def _reply(self, loop, fut, fn: Callable[[], object], on_cancelled: Callable[[], None] | None = None) -> None:
        """Run ``fn`` and settle ``fut`` with its outcome, after publishing what it may have changed."""
        try:
            result, exc = fn(), None
        except Exception as e:
            result, exc = None, e
        self._publish_adapter_names()
        self.stats = self._snapshot()
        self._deliver_held()                     # outputs produced before this reply reach the loop first
        try:
            loop.call_soon_threadsafe(_settle, fut, result, exc, on_cancelled)
        except RuntimeError:            # the event loop is closed: nobody is waiting
            pass

    def _add(self, group: RequestGroup) -> None:
        try:
            self._add_all(group)
        finally:           # publish the new waiting count before the jobs stop counting as pending
            self.stats = self._snapshot()
            with self._cv:
                self._pending_adds -= len(group.jobs)

    def _add_all(self, group: RequestGroup) -> None:
        for job in group.jobs:
            if job.adapter is not None and (job.adapter not in self.engine.adapters or job.adapter in self._draining):
                known = ", ".join(n for n in self.engine.adapters.names() if n not in self._draining) or "none"
                why = "is being unloaded" if job.adapter in self._draining else "is not registered"
                raise AdapterNotFound(f"adapter {job.adapter!r} {why} (registered: {known})")
        added = []
        try:
            for job in group.jobs:
                added.append(self.engine.add_request(job.prompt, job.adapter, job.params, job.request_id,
                                                     images=job.images, resumed=job.resumed))
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        for job in group.jobs:
            self._live[job.request_id] = group

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Route ``outputs`` to their groups now (bookkeeping, aborts of a failed group's requests); hold the
        deliveries for :meth:`_deliver_held`."""
        by_loop = self._held
        for out in outputs:
            group = self._live.get(out.request_id)
            if group is None:
                continue
            if out.finished:
                del self._live[out.request_id]
            if out.finish_reason == "error":       # the API call fails as a whole: its other requests stop
                for rid in group.request_ids:
                    if rid in self._live:          # stays live until its abort output is dispatched (counted)
                        self.engine.abort(rid)
                by_loop[group.loop].append((group, RequestFailed(f"request {out.request_id} failed: {out.error}",
                                                                 out)))
                continue
            by_loop[group.loop].append((group, out))

    def _deliver_held(self) -> None:
        if not self._held:                      # every forward calls this: nothing to do on most of them
            return
        held, self._held = self._held, defaultdict(list)
        for loop, items in held.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:
                pass

    def _fail(self, exc: BaseException) -> None:
        self._deliver_held()
        self.failure = exc
        self._accepting = False
        failed = EngineFailed(f"the engine failed: {exc!r}")
        groups = {}
        for rid, group in self._live.items():
            groups[id(group)] = group
            try:
                self.engine.abort(rid)
            except Exception:
                pass
        self._live.clear()
        for group in groups.values():
            try:
                group.loop.call_soon_threadsafe(group.deliver, failed)
            except RuntimeError:
                pass

    def _abort_all(self) -> None:
        for rid in list(self._live):
            self.engine.abort(rid)

    def _in_use(self, adapter: str) -> list[str]:
        return self.engine.requests_of(adapter)

    def _start_unload(self, name: str, policy: str, loop, fut) -> None:
        if name not in self.engine.adapters or name in self._draining:
            exc = AdapterNotFound(f"adapter {name!r} is not registered" if name not in self.engine.adapters
                                  else f"adapter {name!r} is already being unloaded")
            self._reply(loop, fut, lambda: _raise(exc))
            return
        users = self._in_use(name)
        if policy == "abort" or not users:
            for rid in users:
                self.engine.abort(rid)
            self.engine.unregister_adapter(name)
            self._reply(loop, fut, lambda: len(users))
        else:
            self._draining.add(name)
            self._publish_adapter_names()
            self._unloads.append((name, loop, fut, len(users)))

    def _finish_unloads(self) -> None:
        for entry in list(self._unloads):
            name, loop, fut, count = entry
            if not self._in_use(name):
                self._unloads.remove(entry)
                self._draining.discard(name)
                self.engine.unregister_adapter(name)
                self._reply(loop, fut, lambda count=count: count)


class _HandOver(StepObserver):
    """Hands the routed deliveries to the event loops while a forward runs on the device."""

    def __init__(self, deliver: Callable[[], None]):
        self.deliver = deliver

    def before_sync(self) -> None:
        self.deliver()
