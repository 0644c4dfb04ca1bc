"""The replicas behind the cluster front: Ray start-up, their handles, health, the adapter set, their streams.

:class:`ReplicaSet` owns

- the Ray actors (:class:`vlora.cluster.replica.Replica`) and, per replica, what it last reported and whether
  it takes requests (:class:`ReplicaHandle`): one watcher task per replica pulls its status every
  ``report_interval_s`` (one call per replica per interval, never one per request); a replica is ``ready``
  once it answers in its current incarnation with the adapter set synced;
- the adapter set (name -> directory) and its version: a replica whose synced version differs (it restarted,
  or an adapter was loaded or unloaded) is synced before it is ready again;
- the routes: one per request running on a replica, keyed by its id there, to the queue its outputs go to.
  One listener task per replica reads the replica's one output stream (shared by all its requests, about one
  Ray object per engine step) into the routes; when the stream breaks, each route of that replica gets
  :data:`LOST`;
- the failure: when no replica has answered for ``unreachable_s``, ``on_failure`` is called once.

It knows nothing of requests beyond their routes; :mod:`vlora.cluster.requests` decides where they run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from vlora.cluster.config import ClusterConfig
from vlora.cluster.observer import FrontObserver
from vlora.cluster.policy import ReplicaReport
from vlora.cluster.replica import Replica, ReplicaStatus
from vlora.engine.client import Refusal, raise_refusal
from vlora.config import EngineConfig
from vlora.engine.client import AdapterNotFound, EngineFailed, EngineInfo, EngineStats, sum_counts
from vlora.lora.adapter import AdapterError

log = logging.getLogger(__name__)

LOST = object()            # a route's item: its replica's output stream broke


@dataclass(eq=False)
class ReplicaHandle:
    replica_id: int
    actor: object
    incarnation: str | None = None
    status: ReplicaStatus | None = None
    ready: bool = False                 # reported, in its current incarnation, with the adapter set synced
    last_seen: float = field(default_factory=time.monotonic)

    def report(self) -> ReplicaReport:
        if self.status is None:
            return ReplicaReport(self.replica_id, 0, 0, 0, 0, 1, alive=False)
        r = self.status.report
        return r if self.ready and r.alive else replace(r, alive=False)


@dataclass(eq=False)
class Route:
    """Where a replica's outputs for one request go."""

    request_id: str                     # the client's id (observers are told of it)
    replica: ReplicaHandle
    inbox: asyncio.Queue


class ReplicaSet(Sequence[ReplicaHandle]):
    """The replicas, indexed by replica id."""

    def __init__(self, handles: list[ReplicaHandle], cluster: ClusterConfig,
                 observers: list[FrontObserver] | None = None):
        """A set of started replicas (:meth:`launch` starts them on Ray)."""
        self.handles = handles
        self.cluster = cluster
        self.observers = observers if observers is not None else []
        self.info: EngineInfo | None = None          # the model served, as the first replica reported it
        self.adapter_shape = None
        self.device: str | None = None
        self.device_names: list[str] = []
        self.batch_cap: int | None = None
        self.owns_ray = False                        # this set started the local Ray cluster
        self.adapters: dict[str, str] = {}
        self.version = 0                             # of the adapter set; replicas sync to it
        self.draining: set[str] = set()              # adapters being unloaded
        self.routes: dict[str, Route] = {}           # request id on its replica -> route
        self.failure: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self.stopped = False
        self.logging_steps = False                   # replicas log their engine steps (benchmarks ask)
        self._changed: asyncio.Event | None = None   # set whenever a report arrives (made by start)

    @classmethod
    def launch(cls, config: EngineConfig, cluster: ClusterConfig, max_queued_requests: int,
               observers: list[FrontObserver] | None = None) -> ReplicaSet:
        """Start (or join) Ray and start the replicas; blocks until they serve."""
        import ray

        owns_ray = not ray.is_initialized()
        if owns_ray:
            local = cluster.ray_address is None
            ray.init(address=cluster.ray_address, num_cpus=cluster.ray_num_cpus if local else None,
                     include_dashboard=False, logging_level="WARNING")
        gpus = cluster.gpus_per_replica
        if gpus is None:
            import torch

            cuda = config.model.device != "cpu" and torch.cuda.is_available()
            gpus = config.model.tensor_parallel_size if cuda else 0
        actor = ray.remote(Replica).options(num_gpus=gpus, num_cpus=cluster.cpus_per_replica,
                                            max_restarts=cluster.max_restarts, max_task_retries=0,
                                            max_concurrency=4096)
        batch_cap = cluster.profiled_batch_cap()
        handles = [ReplicaHandle(i, actor.remote(i, config, max_queued_requests, batch_cap))
                   for i in range(cluster.replicas)]
        replicas = cls(handles, cluster, observers)
        replicas.owns_ray, replicas.batch_cap = owns_ray, batch_cap
        infos = ray.get([r.actor.info.remote() for r in handles])
        replicas.info = infos[0]["info"]
        replicas.adapter_shape = infos[0]["shape"]
        replicas.device = infos[0]["device"]
        replicas.device_names = [i["device_name"] for i in infos]
        for r, i in zip(handles, infos):
            r.incarnation = i["incarnation"]
        return replicas

    # -- the handles --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, i):
        return self.handles[i]

    def __iter__(self) -> Iterator[ReplicaHandle]:
        return iter(self.handles)

    def reports(self) -> list[ReplicaReport]:
        return [r.report() for r in self.handles]

    def stats(self, queued: int) -> EngineStats:
        """The replicas' stats summed (mode: the most common one), ``queued`` requests at the front counted
        waiting."""
        stats = [r.status.stats for r in self.handles if r.status is not None]
        modes = [s.mode for s in stats] or ["unmerged"]
        return EngineStats(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats) + queued,
                           sum(s.num_blocks_used for s in stats), sum(s.num_blocks for s in stats),
                           max(set(modes), key=modes.count), sum(s.mode_switches for s in stats),
                           tuple(sum_counts(s.iterations for s in stats).items()))

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self, spawn: Callable) -> None:
        """Watch and listen to every replica from tasks ``spawn(coroutine)`` starts on the running loop."""
        self._changed = asyncio.Event()
        for r in self.handles:
            spawn(self._watch(r))
            spawn(self._listen(r))

    def close(self) -> None:
        """Stop the replica actors (and the local Ray cluster this set started)."""
        import ray

        self.stopped = True
        self.kill()
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()

    def kill(self) -> None:
        import ray

        for r in self.handles:
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception:           # already gone
                pass

    # -- the adapter set ----------------------------------------------------------------------------------
    @property
    def adapter_names(self) -> frozenset[str]:
        return frozenset(self.adapters) - self.draining

    def set_adapters(self, adapters: dict[str, str]) -> None:
        """Make ``adapters`` (name -> directory) the adapter set of every replica, blocking. Raises
        AdapterError if a replica refuses one."""
        import ray

        self.adapters, self.version = dict(adapters), self.version + 1
        synced = ray.get([r.actor.sync_adapters.remote(self.version, self.adapters) for r in self.handles])
        for failed in synced:
            for name, why in failed.items():
                raise AdapterError(f"adapter {name!r}: {why.message}")

    async def load_adapter(self, name: str, path: str) -> None:
        """Register an adapter on every ready replica (and, through the version, on each one that is synced
        later); all or none."""
        if name in self.adapters:
            raise AdapterError(f"an adapter named {name!r} is already registered (from {self.adapters[name]})")
        ready = [r for r in self.handles if r.ready]
        results = await asyncio.gather(*(r.actor.load_adapter.remote(name, path) for r in ready),
                                       return_exceptions=True)
        refused = [x for x in results if isinstance(x, Refusal)]
        if refused:
            await asyncio.gather(*(r.actor.unload_adapter.remote(name, "abort")
                                   for r, x in zip(ready, results) if x is None), return_exceptions=True)
            raise_refusal(refused[0])
        self.adapters[name] = path
        self.version += 1

    def begin_unload(self, name: str) -> None:
        """Refuse new requests for ``name`` from now on; :meth:`unload_adapter` then :meth:`end_unload`."""
        if name not in self.adapters or name in self.draining:
            raise AdapterNotFound(f"adapter {name!r} is not registered" if name not in self.adapters
                                  else f"adapter {name!r} is already being unloaded")
        self.draining.add(name)

    async def unload_adapter(self, name: str, policy: str) -> int:
        """Unregister ``name`` on every ready replica; how many of their requests were waited for or aborted."""
        results = await asyncio.gather(*(r.actor.unload_adapter.remote(name, policy) for r in self.handles
                                         if r.ready), return_exceptions=True)
        return sum(x for x in results if isinstance(x, int))

    def end_unload(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.draining.discard(name)
        self.version += 1

    # -- health -------------------------------------------------------------------------------------------
    def lost(self, r: ReplicaHandle) -> None:
        """``r`` takes no new request until the watcher sees it answer (and synced, after a restart)."""
        r.ready = False
        self.wake()

    def wake(self) -> None:
        """Wake whoever waits in :meth:`next_change`."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def next_change(self) -> None:
        """Until the next report (or a few report intervals, whichever comes first)."""
        try:
            await asyncio.wait_for(self._changed.wait(), self.cluster.report_interval_s * 4)
        except asyncio.TimeoutError:
            pass

    async def _watch(self, r: ReplicaHandle) -> None:
        """Pull ``r``'s status every report interval; after a restart (a new incarnation) or an adapter change,
        sync the adapter set before ``r`` takes requests again."""
        import ray

        interval = self.cluster.report_interval_s
        timeout = max(2.0, 20 * interval)
        while not self.stopped:
            try:
                st: ReplicaStatus = await asyncio.wait_for(_awaitable(r.actor.status.remote()), timeout)
                if st.incarnation != r.incarnation:
                    log.warning("replica %d restarted; syncing its adapters", r.replica_id)
                    self.lost(r)
                    r.incarnation = st.incarnation
                    if self.logging_steps:      # a restarted replica starts with no step log
                        await _awaitable(r.actor.log_steps.remote())
                if st.adapters_version != self.version:
                    version, adapters = self.version, dict(self.adapters)
                    failed = await _awaitable(r.actor.sync_adapters.remote(version, adapters))
                    for name, why in failed.items():
                        log.error("replica %d could not load adapter %r: %s", r.replica_id, name, why.message)
                    continue
                r.status, r.last_seen = st, time.monotonic()
                r.ready = st.report.alive
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                if r.ready:
                    log.warning("replica %d is unreachable (%s)", r.replica_id, type(e).__name__)
                self.lost(r)
                self._check_unreachable()
            self.wake()
            await asyncio.sleep(interval)

    def _check_unreachable(self) -> None:
        newest = max(r.last_seen for r in self.handles)
        if self.failure is None and time.monotonic() - newest > self.cluster.unreachable_s:
            self.failure = EngineFailed(f"no replica has answered for {self.cluster.unreachable_s:.0f} s")
            log.error("%s", self.failure)
            if self.on_failure is not None:
                self.on_failure(self.failure)

    # -- output streams -----------------------------------------------------------------------------------
    def open_route(self, engine_id: str, request_id: str, r: ReplicaHandle) -> asyncio.Queue:
        """The queue that ``r``'s outputs for ``engine_id`` (the request's id there) go to from now on."""
        route = self.routes[engine_id] = Route(request_id, r, asyncio.Queue())
        return route.inbox

    def close_route(self, engine_id: str) -> None:
        self.routes.pop(engine_id, None)

    async def _listen(self, r: ReplicaHandle) -> None:
        """Read ``r``'s output stream (opened once ``r`` is ready, again after each restart) into the routes of
        its requests; when the stream breaks, each of them gets LOST."""
        import ray

        while not self.stopped:
            if not r.ready:
                await self.next_change()
                continue
            try:
                async for ref in r.actor.outputs.remote():
                    sent, items = await ref
                    received = time.time()
                    for engine_id, item in items:
                        route = self.routes.get(engine_id)
                        if route is not None:
                            route.inbox.put_nowait(item)
                    if self.observers:
                        self._arrived(r, sent, received, items)
            except ray.exceptions.RayError as e:
                log.warning("replica %d: its output stream broke (%s)", r.replica_id, type(e).__name__)
            self.lost(r)
            for route in list(self.routes.values()):
                if route.replica is r:
                    route.inbox.put_nowait(LOST)

    def _arrived(self, r: ReplicaHandle, sent: float, received: float, items: list) -> None:
        with_tokens = []
        for engine_id, item in items:
            route = self.routes.get(engine_id)
            if route is not None and getattr(item, "delta_token_ids", None):
                with_tokens.append(route.request_id)
        for o in self.observers:
            o.outputs_arrived(r.replica_id, sent, received, with_tokens)

    # -- step logs (benchmarks) ---------------------------------------------------------------------------
    async def log_steps(self) -> None:
        """Have every replica log its engine steps from now on (:meth:`step_logs` reads them), restarted ones
        included."""
        self.logging_steps = True
        await asyncio.gather(*(_awaitable(r.actor.log_steps.remote()) for r in self.handles if r.ready),
                             return_exceptions=True)

    async def step_logs(self) -> dict[int, list[tuple[float, float, int, int]]]:
        """Each ready replica's engine steps since the last call (:meth:`Replica.step_log`)."""
        ready = [r for r in self.handles if r.ready]
        logs = await asyncio.gather(*(_awaitable(r.actor.step_log.remote()) for r in ready), return_exceptions=True)
        return {r.replica_id: log for r, log in zip(ready, logs) if isinstance(log, list)}


def fire(ref) -> None:
    """A call whose answer nobody waits for (an abort, a migration): its errors are the watcher's business."""
    del ref


async def _awaitable(ref):
    return await ref
