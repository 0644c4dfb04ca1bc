"""The cluster front: N engine replicas on Ray behind the interface of one engine.

:class:`ClusterFront` is an :class:`~vlora.engine.client.EngineClient`: the OpenAI server and
``LLM(replicas=N)`` use it as they use one :class:`~vlora.engine.async_engine.AsyncEngine`. It checks what one
engine checks at the door (accepting, adapter names, the queue bound) and hands the rest to its two parts:

- :class:`~vlora.cluster.replicas.ReplicaSet` (``front.replicas``): Ray start-up, the replica handles, health
  watching, the adapter set and its syncing, the replicas' output streams;
- :class:`~vlora.cluster.requests.RequestTracker` (``front.requests``): where each request runs, placing,
  migrating and failing it over, and its text after a move.

Benchmarks watch the requests through :class:`~vlora.cluster.observer.FrontObserver` and read the replicas'
step logs through the replica set; serving does neither.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from vlora.cluster.config import ClusterConfig
from vlora.cluster.observer import FrontObserver
from vlora.cluster.policy import ReplicaReport, make_policy
from vlora.cluster.replicas import ReplicaSet
from vlora.cluster.requests import RequestTracker
from vlora.config import EngineConfig
from vlora.engine.client import (AdapterNotFound, EngineInfo, EngineStats, Job, QueueFull, RequestGroup,
                                 ShuttingDown, Timing)
from vlora.engine.sequence import RequestOutput
from vlora.lora.adapter import AdapterError


class ClusterFront:
    """An :class:`~vlora.engine.client.EngineClient` serving from replicas on Ray."""

    info: EngineInfo
    max_queued_requests: int
    on_fatal: Callable[[BaseException], None] | None

    def __init__(self, config: EngineConfig, cluster: ClusterConfig | None = None,
                 adapters: dict[str, str] | None = None, max_queued_requests: int = 256,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 observers: Sequence[FrontObserver] = ()):
        """Start (or join) Ray, start the replicas and register ``adapters`` on each; blocks until they serve.
        ``observers``: told of each request's placements and moves (:mod:`vlora.cluster.observer`)."""
        self.cluster = cluster = cluster or ClusterConfig()
        self.config = config
        self.max_queued_requests = max_queued_requests
        self.on_fatal = on_fatal
        self.observers: list[FrontObserver] = list(observers)
        self.replicas = ReplicaSet.launch(config, cluster, max_queued_requests, self.observers)
        self.info = self.replicas.info
        self._started = False
        try:
            self.set_adapters(adapters or {})
        except AdapterError:
            self.replicas.kill()
            raise
        self._tasks: set[asyncio.Task] = set()
        self.requests = RequestTracker(self.replicas, make_policy(cluster.cluster_policy), self.info.tokenizer,
                                       self._spawn, self.observers, self.info.vision)
        self.replicas.on_failure = self._failed
        self._accepting = True

    # what the CLI, the benchmarks and the tests read of the replicas and the requests
    @property
    def adapter_shape(self):
        return self.replicas.adapter_shape

    @property
    def device(self) -> str:
        return self.replicas.device

    @property
    def device_names(self) -> list[str]:
        return self.replicas.device_names

    @property
    def batch_cap(self) -> int | None:
        return self.replicas.batch_cap

    @property
    def policy(self):
        """The placement policy (:mod:`vlora.cluster.policy`); benchmarks and tests swap it."""
        return self.requests.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.requests.policy = policy

    @property
    def migrations(self) -> int:
        """Requests moved off a replica (KV shortage or rebalance)."""
        return self.requests.migrations

    @property
    def failovers(self) -> int:
        """Requests rerun after their replica died."""
        return self.requests.failovers

    def reports(self) -> list[ReplicaReport]:
        return self.replicas.reports()

    def observe(self, observer: FrontObserver) -> None:
        """Tell ``observer`` of each request's placements and moves from now on."""
        self.observers.append(observer)

    def set_adapters(self, adapters: dict[str, str]) -> None:
        """Make ``adapters`` (name -> directory) the adapter set of every replica, blocking; before ``start``
        only (then use load_adapter / unload_adapter). Raises AdapterError if a replica refuses one."""
        if self._started:
            raise RuntimeError("set_adapters is for start-up; the running front takes load_adapter / unload_adapter")
        self.replicas.set_adapters(adapters)

    # -- the EngineClient interface -------------------------------------------------------------------------
    @property
    def adapter_names(self) -> frozenset[str]:
        return self.replicas.adapter_names

    @property
    def failure(self) -> BaseException | None:
        return self.replicas.failure

    @property
    def is_running(self) -> bool:
        return self._started and not self.replicas.stopped and self.failure is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    @property
    def stats(self) -> EngineStats:
        """The replicas' stats summed (mode: the most common one), front-queued requests counted waiting."""
        return self.replicas.stats(sum(1 for t in self.requests.tracked.values() if t.replica is None and not t.done))

    def start(self) -> None:
        """Start the watchers on the running event loop; the front serves from then on."""
        if self._started:
            return
        self._started = True
        self.replicas.start(self._spawn)
        self._spawn(self.requests.rebalance())

    def begin_shutdown(self) -> None:
        self._accepting = False

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let running ones finish (up to ``timeout`` s, then abort them), stop the
        replicas. Returns whether everything finished without being aborted."""
        self.begin_shutdown()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.requests.tracked and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        drained = not self.requests.tracked
        for t in list(self.requests.tracked.values()):
            self.requests.abort_request(t)
        await asyncio.sleep(0)
        self.replicas.stopped = True
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        self.close()
        return drained

    def close(self) -> None:
        """Stop the replica actors (and the local Ray cluster this front started)."""
        self.replicas.close()

    async def submit(self, jobs: Sequence[Job],
                     on_finish: Callable[[RequestOutput, Timing], None] | None = None) -> RequestGroup:
        """Place ``jobs``, all or none; raises QueueFull, ShuttingDown, AdapterNotFound or RequestError as one
        engine does (a replica's refusal is raised here as the same exception)."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down" if self.failure is None
                               else f"the cluster failed: {self.failure!r}")
        for job in jobs:
            if job.adapter is not None and job.adapter not in self.adapter_names:
                why = "is being unloaded" if job.adapter in self.replicas.draining else "is not registered"
                known = ", ".join(sorted(self.adapter_names)) or "none"
                raise AdapterNotFound(f"adapter {job.adapter!r} {why} (registered: {known})")
        queued = self.requests.queued()
        if queued + len(jobs) > self.max_queued_requests:
            raise QueueFull(f"{queued} requests are waiting (limit {self.max_queued_requests}); retry later")
        group = RequestGroup(tuple(jobs), asyncio.get_running_loop(), self.requests.abort, on_finish)
        await self.requests.submit(group)
        return group

    async def load_adapter(self, name: str, path: str) -> None:
        """Register an adapter on every replica (and on each replica that starts later); all or none."""
        await self.replicas.load_adapter(name, path)

    async def unload_adapter(self, name: str, policy: str = "wait") -> int:
        """Unregister an adapter on every replica; returns how many of its requests were waited for or aborted
        (requests of it still queued at the front are aborted either way)."""
        if policy not in ("wait", "abort"):
            raise ValueError(f"policy must be wait or abort, got {policy!r}")
        self.replicas.begin_unload(name)
        try:
            queued = self.requests.abort_queued(name)
            return queued + await self.replicas.unload_adapter(name, policy)
        finally:
            self.replicas.end_unload(name)

    # -- inside -----------------------------------------------------------------------------------------------
    def _failed(self, failure: BaseException) -> None:
        """No replica answers: every request in flight fails, and so does serving."""
        self.requests.fail_all(failure)
        if self.on_fatal is not None:
            self.on_fatal(failure)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
