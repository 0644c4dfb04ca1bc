"""One engine replica: an :class:`AsyncEngine` inside a Ray async actor.

The cluster front (:mod:`vlora.cluster.front`) talks to a replica through these methods only:

    info()                      the model served (name, tokenizer, context, vocabulary), once at start
    status(adapters_version)    a ReplicaReport and the engine's stats, pulled every report interval
    submit(job)                 None (taken) or a Refusal
    outputs()                   a streaming method: (wall time sent, [(request id, RequestOutput delta or Refusal),
                                ...]) of every request, about one list per engine step
    log_steps()                 log each engine step from now on (benchmarks ask for it; off by default)
    step_log()                  the engine steps since the last call: (wall time begun, seconds, outputs, running)
    abort(ids) / migrate(ids)   stop requests; migrate finishes them "migrate" so the front resumes them elsewhere
    sync_adapters(version, {name: path})   make the registered adapters exactly these (idempotent)

Refusals and failures travel as values (:class:`Refusal`), not as exceptions, so the front maps each to the
exception a single engine raises, whatever Ray does to exceptions in transit. A replica starts with no
adapters: the front syncs its adapter set before placing requests on it, also after Ray restarts it.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass

import torch

from vlora.cluster.policy import ReplicaReport
from vlora.config import EngineConfig
from vlora.builder import build_engine, profile_policy, warm_grammars
from vlora.engine.async_engine import AsyncEngine
from vlora.engine.client import (AdapterNotFound, EngineFailed, EngineStats, Job, QueueFull, Refusal, ShuttingDown,
                                 refusal)
from vlora.engine.engine import Engine, RequestError
from vlora.engine.observer import StepObserver, StepRecord
from vlora.lora.adapter import AdapterError
from vlora.sampling_params import SamplingError


@dataclass(frozen=True)
class ReplicaStatus:
    """What a replica publishes each report interval."""

    report: ReplicaReport
    stats: EngineStats
    incarnation: str             # new each time the actor (re)starts
    adapters_version: int        # the front's adapter-set version this replica has synced (0: none yet)


class Replica:
    """The actor's body (Ray wraps it with ``ray.remote``; tests may also use it directly)."""

    def __init__(self, replica_id: int, config: EngineConfig, max_queued_requests: int = 256,
                 batch_cap: int | None = None):
        self.replica_id = replica_id
        self.batch_cap = batch_cap
        self._steps: deque = deque(maxlen=1 << 18)      # the step log, read (and emptied) by step_log()
        self._step_log: _StepLog | None = None           # attached by log_steps()
        engine = build_engine(config, hand_back_preempted=True)
        warm_grammars(engine)
        self.engine = AsyncEngine(engine, max_queued_requests, on_fatal=self._fatal)
        self.engine.start()
        self.incarnation = uuid.uuid4().hex
        self.adapters_version = 0
        self.adapter_paths: dict[str, str] = {}
        self._outbox: deque = deque()       # (request id, output or refusal) not yet sent by outputs()
        self._arrived = asyncio.Event()      # set when the outbox gets an item (or a newer stream starts)
        self._stream = 0                     # the newest outputs() call; older ones end
        self._pumps: set[asyncio.Task] = set()

    async def log_steps(self) -> None:
        """Log each engine step from now on (:meth:`step_log` reads them); a second call does nothing. The
        observer is attached on the engine thread, between two steps."""
        if self._step_log is None:
            self._step_log = _StepLog(self._steps)
            await self.engine.call(lambda e: e.observe(self._step_log))

    def step_log(self) -> list[tuple[float, float, int, int]]:
        """The steps logged since the last call, oldest first (none unless :meth:`log_steps` was called)."""
        out = []
        while self._steps:
            out.append(self._steps.popleft())
        return out

    def _fatal(self, exc: BaseException) -> None:
        """The engine cannot go on: the process exits, so the front reruns its requests elsewhere (as for any
        replica that dies) and Ray restarts the replica with a fresh engine."""
        os._exit(1)

    # -- what the front pulls ------------------------------------------------------------------
    def info(self) -> dict:
        e = self.engine.engine
        info = self.engine.info
        cuda = e.device.type == "cuda"
        return dict(info=info, shape=e.adapters.shape, device=str(e.device),
                    device_name=torch.cuda.get_device_name(e.device) if cuda else e.device.type,
                    incarnation=self.incarnation, pids=[os.getpid(), *e.executor.worker_pids])

    async def status(self) -> ReplicaStatus:
        """The load report: read on the engine thread between two steps (the pool and the adapter store are
        the engine thread's), so running, waiting, free pages and resident adapters are one consistent state.
        Free pages are those KV can have: the pool's free pages plus what it would reclaim (idle adapters,
        cached prefixes)."""
        e = self.engine.engine
        if self.engine.is_running:
            running, waiting, free, resident = await self.engine.call(_load)
        else:                               # no engine thread to ask (stopping or failed): nothing to offer
            running, waiting, free, resident = 0, 0, 0, frozenset()
        report = ReplicaReport(self.replica_id, running, waiting, free_kv_pages=free, total_kv_pages=e.pool.num_pages,
                               page_tokens=e.block_size, resident_adapters=resident,
                               batch_cap=self.batch_cap or e.config.scheduler.max_num_seqs,
                               alive=self.engine.accepting)
        return ReplicaStatus(report, self.engine.stats, self.incarnation, self.adapters_version)

    # -- requests --------------------------------------------------------------------------------
    async def submit(self, job: Job) -> Refusal | None:
        """Add ``job``; None when taken (its outputs then come through :meth:`outputs`), else why not."""
        try:
            group = await self.engine.submit([job])
        except (QueueFull, ShuttingDown, RequestError, SamplingError) as e:
            return refusal(e)
        self._pumps.add(asyncio.ensure_future(self._pump(job.request_id, group)))
        return None

    async def _pump(self, request_id: str, group) -> None:
        try:
            async for outs in group.batches():
                for out in outs:
                    self._send(request_id, out)
        except EngineFailed as e:
            self._send(request_id, refusal(e))
        finally:
            group.abort()
            self._pumps.discard(asyncio.current_task())

    def _send(self, request_id: str, item) -> None:
        self._outbox.append((request_id, item))
        self._arrived.set()

    async def outputs(self):
        """Streaming, for the front: every request's outputs as ``(wall time, [(request id, RequestOutput or
        Refusal), ...])``, each list what arrived since the last one, stamped when sent. One stream for all requests keeps the Ray objects to about one
        per engine step, not one per request and token. A new call (the front reconnecting) ends the older one,
        so no item goes to a stream nobody reads."""
        self._stream += 1
        me = self._stream
        self._arrived.set()                 # an older stream wakes up and ends
        while True:
            await self._arrived.wait()
            if me != self._stream:
                return
            self._arrived.clear()
            await asyncio.sleep(0)          # let the other requests of the same engine step join this list
            if self._outbox:
                items = list(self._outbox)
                self._outbox.clear()
                yield time.time(), items

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(list(request_ids))

    async def migrate(self, request_ids: list[str]) -> int:
        """Hand requests back to the front (finish "migrate"); returns how many were (a request of an adapter being
        unloaded stays)."""
        return sum(await self.engine.call(lambda e: [e.hand_back(rid) for rid in request_ids]))

    # -- adapters --------------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> Refusal | None:
        if self.adapter_paths.get(name) == path:
            return None
        try:
            await self.engine.load_adapter(name, path)
        except (AdapterError, RequestError) as e:
            return refusal(e)
        self.adapter_paths[name] = path
        return None

    async def unload_adapter(self, name: str, policy: str) -> int | Refusal:
        try:
            count = await self.engine.unload_adapter(name, policy)
        except AdapterNotFound as e:
            return refusal(e)
        self.adapter_paths.pop(name, None)
        return count

    async def sync_adapters(self, version: int, adapters: dict[str, str]) -> dict[str, Refusal]:
        """Register what ``adapters`` holds and this replica lacks, unload (waiting for their requests) what it
        holds that ``adapters`` does not; returns the adapters it could not load."""
        failed = {}
        for name in [n for n in self.adapter_paths if adapters.get(n) != self.adapter_paths[n]]:
            await self.unload_adapter(name, "wait")
        for name, path in adapters.items():
            r = await self.load_adapter(name, path)
            if r is not None:
                failed[name] = r
        if self.engine.is_running:           # as `vlora serve` does once its adapters are registered
            await self.engine.call(_profile_if_idle)
        self.adapters_version = version
        return failed

    async def shutdown(self, timeout: float | None = None) -> bool:
        return await self.engine.shutdown(timeout)


def _profile_if_idle(engine: Engine) -> None:
    """Time the inference modes for a merging policy (:func:`vlora.builder.profile_policy`) once, while no
    request is in flight (the timed replays and merges hold the device): the first adapter sync, at start or
    after a restart, before the front places any request here."""
    if engine.mode_costs is None and not engine.has_unfinished():
        profile_policy(engine)


def _load(engine: Engine) -> tuple[int, int, int, frozenset[str]]:
    """Running and waiting sequences, the pages KV can have and the adapters in device memory (the torch path
    keeps every registered one there); on the engine thread."""
    store = engine.adapters.store
    resident = frozenset(store.resident) if store is not None else frozenset(engine.adapters.names())
    return len(engine.scheduler.running), len(engine.scheduler.waiting), engine.pool.available(), resident


class _StepLog(StepObserver):
    """Logs each engine step: when it began (wall clock, comparable across the host's processes), how long it
    took, the outputs it gave and the sequences then running; what the served path's costs are measured from
    (benchmarks/bench_cluster.py asks for it through the front's replica set)."""

    def __init__(self, steps: deque):
        self.steps = steps

    def step_done(self, record: StepRecord) -> None:
        self.steps.append((record.began, record.seconds, record.outputs, record.running))
