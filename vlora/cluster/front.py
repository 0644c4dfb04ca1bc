"""The cluster front: N engine replicas on Ray behind the interface of one :class:`AsyncEngine`.

The OpenAI server and ``LLM(replicas=N)`` use it as they use one engine (``submit`` returns a RequestGroup,
``load_adapter``, ``unload_adapter``, ``stats``, ``info``, ``shutdown``). Behind it:

- each replica is a Ray actor (:class:`vlora.cluster.replica.Replica`); one watcher task per replica pulls its
  ReplicaStatus every ``report_interval_s`` (one call per replica per interval, never one per request);
- each request is a :class:`_Flight`: the placement policy (``policy.place``) picks a replica from the latest
  reports, the replica takes it (``submit``), and its outputs come back through the replica's one output
  stream (``outputs``, shared by all its requests, about one Ray object per engine step); the front forwards
  them to the request's group;
- migration by recompute: a replica short of KV (or told by ``policy.rebalance``) finishes a request with
  "migrate"; the front places it again with its prompt plus the tokens already sent and ``max_tokens`` reduced
  by as many, so the client's stream goes on with no token lost or repeated;
- failover: when a replica dies (actor killed, process crash) its flights are placed again the same way; Ray
  restarts the actor (``max_restarts``), and the watcher syncs the front's adapter set onto it (a new
  incarnation, or a stale adapter-set version) before it takes requests again.

A resumed request's text is detokenized here over all its tokens (the replica sees the earlier ones as prompt),
so text and stop strings are the same as without the move. Greedy requests give exactly the tokens of an
unmoved run, and so do seeded sampled ones: the sampler's noise is keyed by (seed, position of the token), and a
resumed request keeps its seed and its positions (penalties then count the tokens sent before the move as prompt).
Logprobs are carried across the move; prompt logprobs are those of the first replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from vlora.cluster.config import ClusterConfig
from vlora.cluster.policy import ReplicaReport, RequestInfo, make_policy
from vlora.cluster.replica import REFUSALS, Refusal, Replica, ReplicaStatus, raise_refusal
from vlora.config import ConfigError, EngineConfig
from vlora.engine.client import (AdapterNotFound, EngineFailed, EngineInfo, EngineStats, Job, QueueFull, RequestFailed,
                                 RequestGroup, ShuttingDown, Timing)
from vlora.engine.detokenizer import Detokenizer
from vlora.engine.engine import RequestError
from vlora.engine.sequence import RequestOutput, Sequence as Seq, Status
from vlora.lora.adapter import AdapterError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _ReplicaHandle:
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
class _Flight:
    """One request of a group, across the replicas it runs on."""

    job: Job
    group: RequestGroup
    prompt_ids: list[int] | None
    accepted: asyncio.Future
    tokens: list[int] = field(default_factory=list)     # sent to the client
    logprobs: list | None = None                         # their TokenLogprobs (params.logprobs set)
    prompt_logprobs: list | None = None                  # of the first replica (params.prompt_logprobs set)
    emitted: int = 0                                     # characters of text sent to the client
    attempt: int = 0
    replica: _ReplicaHandle | None = None
    engine_id: str | None = None                         # the request's id on its current replica
    served_by: list[int] = field(default_factory=list)   # replica ids that accepted it, in order
    aborted: bool = False
    done: bool = False
    moved: bool = False                                  # its replica handed it back: place it again
    moves: int = 0                                       # migrations and failovers
    detok: Seq | None = None                             # after a move: the text is detokenized here
    inbox: asyncio.Queue | None = None                   # its replica's outputs (or _LOST), while on one
    # wall-clock times of its first placement ("placed"), of the first acceptance by a replica reaching the front
    # ("submitted"), and of its first token leaving the replica ("first_replica") and reaching the front
    # ("first_front"): where its TTFT goes
    stamps: dict[str, float] = field(default_factory=dict)

    def info(self) -> RequestInfo:
        return RequestInfo(self.job.request_id, self.job.adapter, len(self.prompt_ids or ()),
                           self.job.params.max_tokens, len(self.tokens))


class ClusterFront:
    """An :class:`~vlora.engine.client.EngineClient` serving from replicas on Ray."""

    info: EngineInfo
    max_queued_requests: int
    failure: BaseException | None
    on_fatal: Callable[[BaseException], None] | None

    def __init__(self, config: EngineConfig, cluster: ClusterConfig | None = None,
                 adapters: dict[str, str] | None = None, max_queued_requests: int = 256,
                 on_fatal: Callable[[BaseException], None] | None = None):
        """Start (or join) Ray, start the replicas and register ``adapters`` on each; blocks until they serve."""
        import ray

        self.cluster = cluster = cluster or ClusterConfig()
        self.config = config
        self.max_queued_requests = max_queued_requests
        self.on_fatal = on_fatal
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
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
        self._started = False
        self.batch_cap = cluster.profiled_batch_cap()
        self.replicas = [_ReplicaHandle(i, actor.remote(i, config, max_queued_requests, self.batch_cap))
                         for i in range(cluster.replicas)]
        infos = ray.get([r.actor.info.remote() for r in self.replicas])
        if infos[0]["is_lmm"]:
            self._kill_all()
            raise ConfigError("a cluster of replicas serves text models only (the front does not prepare images)")
        self.info: EngineInfo = infos[0]["info"]
        self.adapter_shape = infos[0]["shape"]
        self.device = infos[0]["device"]
        self.device_names = [i["device_name"] for i in infos]
        for r, i in zip(self.replicas, infos):
            r.incarnation = i["incarnation"]
        self.policy = make_policy(cluster.cluster_policy)
        self._adapters: dict[str, str] = {}
        self._version = 0
        self._draining: set[str] = set()
        try:
            self.set_adapters(adapters or {})
        except AdapterError:
            self._kill_all()
            raise
        self._detok = Detokenizer(self.info.tokenizer)
        self._flights: dict[str, _Flight] = {}
        self._by_engine: dict[str, _Flight] = {}     # request id on its replica -> flight
        self._tasks: set[asyncio.Task] = set()
        self._accepting = True
        self._stopped = False
        self._changed = None                 # asyncio.Event, set whenever a report arrives (made by start)
        self.failure: BaseException | None = None
        self.migrations = 0                  # requests moved off a replica (KV shortage or rebalance)
        self.failovers = 0                   # requests rerun after their replica died
        self.output_lists = 0                # lists (Ray objects) read from the replicas' output streams

    def set_adapters(self, adapters: dict[str, str]) -> None:
        """Make ``adapters`` (name -> directory) the adapter set of every replica, blocking; before ``start``
        only (then use load_adapter / unload_adapter). Raises AdapterError if a replica refuses one."""
        import ray

        if self._started:
            raise RuntimeError("set_adapters is for start-up; the running front takes load_adapter / unload_adapter")
        self._adapters, self._version = dict(adapters), self._version + 1
        synced = ray.get([r.actor.sync_adapters.remote(self._version, self._adapters) for r in self.replicas])
        for failed in synced:
            for name, why in failed.items():
                raise AdapterError(f"adapter {name!r}: {why.message}")

    # -- the AsyncEngine interface --------------------------------------------------------------------
    @property
    def adapter_names(self) -> frozenset[str]:
        return frozenset(self._adapters) - self._draining

    @property
    def is_running(self) -> bool:
        return self._started and not self._stopped and self.failure is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    @property
    def stats(self) -> EngineStats:
        """The replicas' stats summed (mode: the most common one), front-queued requests counted waiting."""
        stats = [r.status.stats for r in self.replicas if r.status is not None]
        modes = [s.mode for s in stats] or ["unmerged"]
        queued = sum(1 for f in self._flights.values() if f.replica is None and not f.done)
        return EngineStats(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats) + queued,
                           sum(s.num_blocks_used for s in stats), sum(s.num_blocks for s in stats),
                           max(set(modes), key=modes.count), sum(s.mode_switches for s in stats))

    def reports(self) -> list[ReplicaReport]:
        return [r.report() for r in self.replicas]

    def start(self) -> None:
        """Start the watchers on the running event loop; the front serves from then on."""
        if self._started:
            return
        self._started = True
        self._changed = asyncio.Event()
        for r in self.replicas:
            self._spawn(self._watch(r))
            self._spawn(self._listen(r))
        self._spawn(self._rebalance())

    def begin_shutdown(self) -> None:
        self._accepting = False

    async def shutdown(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let running ones finish (up to ``timeout`` s, then abort them), stop the
        replicas. Returns whether everything finished without being aborted."""
        self.begin_shutdown()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._flights and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        drained = not self._flights
        for f in list(self._flights.values()):
            self._abort_flight(f)
        await asyncio.sleep(0)
        self._stopped = True
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        self.close()
        return drained

    def close(self) -> None:
        """Stop the replica actors (and the local Ray cluster this front started)."""
        import ray

        self._stopped = True
        self._kill_all()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def _kill_all(self) -> None:
        import ray

        for r in self.replicas:
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception:           # already gone
                pass

    async def submit(self, jobs: Sequence[Job],
                     on_finish: Callable[[RequestOutput, Timing], None] | None = None) -> RequestGroup:
        """Place ``jobs``, all or none; raises QueueFull, ShuttingDown, AdapterNotFound or RequestError as one
        engine does (a replica's refusal is raised here as the same exception)."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down" if self.failure is None
                               else f"the cluster failed: {self.failure!r}")
        for job in jobs:
            if job.adapter is not None and job.adapter not in self.adapter_names:
                why = "is being unloaded" if job.adapter in self._draining else "is not registered"
                known = ", ".join(sorted(self.adapter_names)) or "none"
                raise AdapterNotFound(f"adapter {job.adapter!r} {why} (registered: {known})")
        queued = sum(1 for f in self._flights.values() if f.replica is None)
        if queued + len(jobs) > self.max_queued_requests:
            raise QueueFull(f"{queued} requests are waiting (limit {self.max_queued_requests}); retry later")
        loop = asyncio.get_running_loop()
        group = RequestGroup(tuple(jobs), loop, self._abort, on_finish)
        flights = [_Flight(job, group, self._prompt_ids(job.prompt), loop.create_future()) for job in jobs]
        for f in flights:
            if f.job.request_id in self._flights:
                raise RequestError(f"request id {f.job.request_id!r} is already in use")
        for f in flights:
            self._flights[f.job.request_id] = f
            self._spawn(self._drive(f))
        try:
            await asyncio.gather(*(f.accepted for f in flights))
        except BaseException:
            for f in flights:
                self._abort_flight(f, deliver=False)
            raise
        return group

    async def load_adapter(self, name: str, path: str) -> None:
        """Register an adapter on every replica (and on each replica that starts later); all or none."""
        if name in self._adapters:
            raise AdapterError(f"an adapter named {name!r} is already registered (from {self._adapters[name]})")
        ready = [r for r in self.replicas if r.ready]
        results = await asyncio.gather(*(r.actor.load_adapter.remote(name, path) for r in ready),
                                       return_exceptions=True)
        refused = [x for x in results if isinstance(x, Refusal)]
        if refused:
            await asyncio.gather(*(r.actor.unload_adapter.remote(name, "abort")
                                   for r, x in zip(ready, results) if x is None), return_exceptions=True)
            raise_refusal(refused[0])
        self._adapters[name] = path
        self._version += 1

    async def unload_adapter(self, name: str, policy: str = "wait") -> int:
        """Unregister an adapter on every replica; returns how many of its requests were waited for or aborted
        (requests of it still queued at the front are aborted either way)."""
        if policy not in ("wait", "abort"):
            raise ValueError(f"policy must be wait or abort, got {policy!r}")
        if name not in self._adapters or name in self._draining:
            raise AdapterNotFound(f"adapter {name!r} is not registered" if name not in self._adapters
                                  else f"adapter {name!r} is already being unloaded")
        self._draining.add(name)
        try:
            queued = [f for f in self._flights.values() if f.job.adapter == name and f.replica is None]
            for f in queued:
                self._abort_flight(f)
            results = await asyncio.gather(*(r.actor.unload_adapter.remote(name, policy) for r in self.replicas
                                             if r.ready), return_exceptions=True)
            return len(queued) + sum(x for x in results if isinstance(x, int))
        finally:
            self._adapters.pop(name, None)
            self._draining.discard(name)
            self._version += 1

    # -- requests ---------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int] | None:
        if isinstance(prompt, str):
            tok = self.info.tokenizer
            return None if tok is None else tok.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def _abort(self, request_ids: list[str]) -> None:          # RequestGroup.abort
        for rid in request_ids:
            f = self._flights.get(rid)
            if f is not None:
                self._abort_flight(f)

    def _abort_flight(self, f: _Flight, deliver: bool = True) -> None:
        """Abort ``f``: its replica answers with the abort output (forwarded); a flight not on a replica gets
        it from here. ``deliver=False``: nobody listens (a refused submit)."""
        if f.done or f.aborted:
            return
        f.aborted = True
        if not deliver:
            f.done = True
        if f.replica is not None and f.engine_id is not None:
            _fire(f.replica.actor.abort.remote([f.engine_id]))
        self._wake()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _drive(self, f: _Flight) -> None:
        """Place and run ``f`` until it finishes, moving it whenever its replica hands it back or dies."""
        try:
            while not f.done:
                r = await self._place(f)
                if r is None:
                    break
                await self._attempt(f, r)
            if f.aborted and not f.done:
                f.done = True
                self._deliver(f, self._final(f, "abort"))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("request %s failed in the cluster front", f.job.request_id)
            self._fail_group(f, EngineFailed(f"the cluster front failed: {e!r}"))
        finally:
            self._flights.pop(f.job.request_id, None)
            if not f.accepted.done():
                f.accepted.set_result(None)

    async def _place(self, f: _Flight) -> _ReplicaHandle | None:
        """The replica the policy picks for ``f`` (waiting for reports while it picks none); None if aborted."""
        while not f.aborted:
            if self.failure is not None:
                raise self.failure
            info = f.info()
            choice = self.policy.place(info, self.reports())
            if choice is not None and 0 <= choice < len(self.replicas) and self.replicas[choice].ready:
                self.policy.placed(info, choice)
                f.stamps.setdefault("placed", time.time())
                return self.replicas[choice]
            await self._next_change()
        return None

    def _resume_job(self, f: _Flight) -> Job:
        """The job that continues ``f`` on another replica: prompt + tokens already sent, the limits reduced."""
        n = len(f.tokens)
        engine_id = f"{f.job.request_id}#{f.attempt}"
        if n == 0:
            return replace(f.job, request_id=engine_id, prompt=f.prompt_ids or f.job.prompt)
        p = f.job.params
        params = replace(p, max_tokens=p.max_tokens - n, min_tokens=max(0, p.min_tokens - n), prompt_logprobs=None)
        self._text_here(f)
        return replace(f.job, request_id=engine_id, prompt=f.prompt_ids + f.tokens, params=params)

    async def _attempt(self, f: _Flight, r: _ReplicaHandle) -> None:
        """Run ``f`` on replica ``r`` until it finishes, is handed back, or ``r`` dies. Its outputs come from
        ``r``'s output stream (:meth:`_listen`) through ``f.inbox``."""
        import ray

        if f.tokens and len(f.tokens) >= f.job.params.max_tokens:    # nothing left to generate
            f.done = True
            self._deliver(f, self._final(f, "length"))
            return
        job = self._resume_job(f)
        f.engine_id, f.replica, f.inbox = job.request_id, r, asyncio.Queue()
        f.attempt += 1
        self._by_engine[job.request_id] = f
        try:
            try:
                refused = await r.actor.submit.remote(job)
            except ray.exceptions.RayError as e:
                self._failover(f, r, type(e).__name__)
                return
            if refused is not None:
                if not r.ready:         # refused by a replica that has just restarted (adapters not synced yet)
                    self._failover(f, r, "restarted")
                else:
                    self._refused(f, r, refused)
                if not f.done:          # placed again after a pause (e.g. the replica's queue was full)
                    await asyncio.sleep(self.cluster.report_interval_s)
                return
            f.stamps.setdefault("submitted", time.time())
            if not f.served_by or f.served_by[-1] != r.replica_id:
                f.served_by.append(r.replica_id)
            if not f.accepted.done():
                f.accepted.set_result(None)
            if f.aborted:
                _fire(r.actor.abort.remote([job.request_id]))
            while not (f.done or f.moved):
                item = await f.inbox.get()
                if item is _LOST:
                    # the stream broke, not necessarily the replica: a live one would run the request on,
                    # holding its KV, while it reruns elsewhere
                    _fire(r.actor.abort.remote([job.request_id]))
                    self._failover(f, r, "its output stream broke")
                    return
                if isinstance(item, Refusal):
                    self._refused(f, r, item)
                    return
                self._forward(f, item)
        finally:
            self._by_engine.pop(job.request_id, None)
            f.replica, f.inbox, f.moved = None, None, False

    def _failover(self, f: _Flight, r: _ReplicaHandle, why: str) -> None:
        log.warning("replica %d lost request %s (%s); placing it again", r.replica_id, f.job.request_id, why)
        self._lost(r)
        self.failovers += 1
        f.moves += 1

    def _refused(self, f: _Flight, r: _ReplicaHandle, item: Refusal) -> None:
        if item.kind == "EngineFailed":             # the replica's engine cannot go on: it restarts; run f elsewhere
            self._lost(r)
            f.moves += 1
            return
        if item.kind == "QueueFull" and f.accepted.done():      # a moved request waits for room like a new one
            return
        exc = REFUSALS.get(item.kind, EngineFailed)(item.message)
        f.done = True
        if not f.accepted.done():
            f.accepted.set_exception(exc)               # submit raises it, as one engine's submit would
        else:
            self._fail_group(f, exc if isinstance(exc, EngineFailed) else RequestFailed(
                f"request {f.job.request_id} failed: {item.message}"))

    def _forward(self, f: _Flight, out: RequestOutput) -> None:
        """Pass a replica's output on, as the output of the request the client sent."""
        if out.finish_reason == "migrate":
            f.moved = True
            f.moves += 1
            self.migrations += 1
            return
        if f.done:
            return
        f.tokens.extend(out.delta_token_ids)
        if out.logprobs is not None and out.delta_token_ids:
            f.logprobs = (f.logprobs or []) + out.logprobs[len(out.logprobs) - len(out.delta_token_ids):]
        if f.prompt_logprobs is None and out.prompt_logprobs is not None:
            f.prompt_logprobs = out.prompt_logprobs
        if f.prompt_ids is None:
            f.prompt_ids = list(out.prompt_token_ids)
        finished, reason = out.finished, out.finish_reason
        if f.detok is None:
            delta, text = out.delta_text, out.text
        else:                                   # moved: the text of all its tokens, and stop strings over it
            seq = f.detok
            if self._detok.update(seq):         # a stop string that spans the move: finish here, "stop" as on
                if not finished:                # one engine (whose stop strings come before max_tokens)
                    _fire(f.replica.actor.abort.remote([f.engine_id]))
                finished, reason = True, "stop"
            if finished:
                seq.status = Status.FINISHED
            delta, text = self._detok.stream_delta(seq), seq.text
        f.emitted += len(delta)
        f.done = finished
        self._deliver(f, RequestOutput(f.job.request_id, f.job.adapter, f.prompt_ids, list(f.tokens), text,
                                       finished, reason, list(out.delta_token_ids), delta, out.error, out.task,
                                       *_logprobs(f)))

    def _text_here(self, f: _Flight) -> Seq | None:
        """From now on ``f``'s text is detokenized here, over all its tokens (None: no tokenizer)."""
        if f.detok is None and self.info.tokenizer is not None:
            f.detok = Seq(f.job.request_id, f.prompt_ids or [], f.job.params, None, 0, output_token_ids=f.tokens)
            self._detok.update(f.detok)
            f.detok.num_emitted_chars = f.emitted
        return f.detok

    def _final(self, f: _Flight, reason: str) -> RequestOutput:
        """The last output of ``f``, ended by the front (no replica holds it): as one engine ends a request, the
        text of its tokens, and what streaming held back as the last delta."""
        seq, text, delta = self._text_here(f), "", ""
        if seq is not None:
            seq.status = Status.FINISHED
            text, delta = seq.text, self._detok.stream_delta(seq)
            f.emitted += len(delta)
        return RequestOutput(f.job.request_id, f.job.adapter, f.prompt_ids or [], list(f.tokens), text, True,
                             reason, [], delta, None, None, *_logprobs(f))

    def _deliver(self, f: _Flight, out: RequestOutput) -> None:
        if f.group.expects(f.job.request_id):           # not after the group failed
            f.group.deliver(out)

    def _fail_group(self, f: _Flight, exc: BaseException) -> None:
        """The API call fails as a whole (as with one engine): its other requests stop."""
        for rid in f.group.request_ids:
            other = self._flights.get(rid)
            if other is not None and other is not f:
                self._abort_flight(other, deliver=False)
        f.done = True
        if not f.group.finished:
            f.group.deliver(exc)

    # -- replicas -------------------------------------------------------------------------------------------
    def _lost(self, r: _ReplicaHandle) -> None:
        """``r`` takes no new request until the watcher sees it answer (and synced, after a restart)."""
        r.ready = False
        self._wake()

    async def _watch(self, r: _ReplicaHandle) -> None:
        """Pull ``r``'s status every report interval; after a restart (a new incarnation) or an adapter change,
        sync the adapter set before ``r`` takes requests again."""
        import ray

        interval = self.cluster.report_interval_s
        timeout = max(2.0, 20 * interval)
        while not self._stopped:
            try:
                st: ReplicaStatus = await asyncio.wait_for(_awaitable(r.actor.status.remote()), timeout)
                if st.incarnation != r.incarnation:
                    log.warning("replica %d restarted; syncing its adapters", r.replica_id)
                    self._lost(r)
                    r.incarnation = st.incarnation
                if st.adapters_version != self._version:
                    version, adapters = self._version, dict(self._adapters)
                    failed = await _awaitable(r.actor.sync_adapters.remote(version, adapters))
                    for name, why in failed.items():
                        log.error("replica %d could not load adapter %r: %s", r.replica_id, name, why.message)
                    continue
                r.status, r.last_seen = st, time.monotonic()
                r.ready = st.report.alive
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                if r.ready:
                    log.warning("replica %d is unreachable (%s)", r.replica_id, type(e).__name__)
                self._lost(r)
                self._check_unreachable()
            self._wake()
            await asyncio.sleep(interval)

    async def _listen(self, r: _ReplicaHandle) -> None:
        """Read ``r``'s output stream (opened once ``r`` is ready, again after each restart) into the inboxes of
        its requests; when the stream breaks, each of them is told it is lost."""
        import ray

        while not self._stopped:
            if not r.ready:
                await self._next_change()
                continue
            try:
                async for ref in r.actor.outputs.remote():
                    self.output_lists += 1
                    sent, items = await ref
                    got = time.time()
                    for request_id, item in items:
                        f = self._by_engine.get(request_id)
                        if f is not None and f.inbox is not None:
                            if "first_replica" not in f.stamps and getattr(item, "delta_token_ids", None):
                                f.stamps["first_replica"], f.stamps["first_front"] = sent, got
                            f.inbox.put_nowait(item)
            except ray.exceptions.RayError as e:
                log.warning("replica %d: its output stream broke (%s)", r.replica_id, type(e).__name__)
            self._lost(r)
            for f in list(self._by_engine.values()):
                if f.replica is r and f.inbox is not None:
                    f.inbox.put_nowait(_LOST)

    async def step_logs(self) -> dict[int, list[tuple[float, float, int, int]]]:
        """Each ready replica's engine steps since the last call (:meth:`Replica.step_log`)."""
        ready = [r for r in self.replicas if r.ready]
        logs = await asyncio.gather(*(_awaitable(r.actor.step_log.remote()) for r in ready), return_exceptions=True)
        return {r.replica_id: log for r, log in zip(ready, logs) if isinstance(log, list)}

    async def _next_change(self) -> None:
        """Until the next report (or a few report intervals, whichever comes first)."""
        try:
            await asyncio.wait_for(self._changed.wait(), self.cluster.report_interval_s * 4)
        except asyncio.TimeoutError:
            pass

    def _check_unreachable(self) -> None:
        newest = max(r.last_seen for r in self.replicas)
        if self.failure is None and time.monotonic() - newest > self.cluster.unreachable_s:
            self.failure = EngineFailed(f"no replica has answered for {self.cluster.unreachable_s:.0f} s")
            log.error("%s", self.failure)
            for f in list(self._flights.values()):
                self._fail_group(f, self.failure)
            if self.on_fatal is not None:
                self.on_fatal(self.failure)

    async def _rebalance(self) -> None:
        """Apply the policy's migrations (e.g. consolidation emptying a replica) every report interval."""
        while not self._stopped:
            await asyncio.sleep(self.cluster.report_interval_s)
            running: dict[int, list[RequestInfo]] = {}
            on: dict[str, _Flight] = {}
            for f in self._flights.values():
                if f.replica is not None and not f.done:
                    running.setdefault(f.replica.replica_id, []).append(f.info())
                    on[f.job.request_id] = f
            try:
                moves = self.policy.rebalance(self.reports(), running)
            except Exception:
                log.exception("policy.rebalance failed")
                continue
            for m in moves:
                f = on.get(m.request_id)
                # a request of an adapter being unloaded stays: no other replica would take it
                if f is not None and f.replica is not None and f.replica.replica_id == m.source \
                        and f.job.adapter not in self._draining:
                    _fire(f.replica.actor.migrate.remote([f.engine_id]))


_LOST = object()           # a flight's inbox item: its replica's output stream broke


def _fire(ref) -> None:
    """A call whose answer nobody waits for (an abort, a migration): its errors are the watcher's business."""
    del ref


async def _awaitable(ref):
    return await ref


def _logprobs(f: _Flight) -> tuple:
    """(logprobs, prompt_logprobs, cumulative_logprob) of ``f``'s RequestOutput, over all its replicas."""
    if f.job.params.logprobs is None:
        return None, f.prompt_logprobs, None
    lp = f.logprobs or []
    return list(lp), f.prompt_logprobs, sum(t.logprob for t in lp)
