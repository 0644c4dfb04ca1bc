"""The cluster front's requests: where each one runs, and moving it when its replica cannot go on with it.

Each request of a group is a :class:`TrackedRequest` from ``submit`` until its final output.
:class:`RequestTracker` drives each one through

    place (the policy picks a ready replica) -> attempt (the replica takes it; its outputs are forwarded to
    the request's group) -> finished, or placed again when its replica hands it back or is lost

- migration by recompute: a replica short of KV (or told by ``policy.rebalance``) finishes a request with
  "migrate"; the tracker places it again with its prompt plus the tokens already sent and ``max_tokens``
  reduced by as many, so the client's stream goes on with no token lost or repeated;
- failover: when a replica dies (actor killed, process crash) or its output stream breaks, its requests are
  placed again the same way;
- refusals: a replica's refusal is raised by ``submit`` as the exception one engine raises, or fails the group
  once it was accepted.

A resumed request's text is decoded here over all its tokens (:mod:`vlora.cluster.resumed_text`), so text and
stop strings are the same as without the move. Greedy requests give exactly the tokens of an unmoved run, and
so do seeded sampled ones: the sampler's noise is keyed by (seed, position of the token), and a resumed
request keeps its seed and its positions (penalties then count the tokens sent before the move as prompt).
Logprobs are carried across the move; prompt logprobs are those of the first replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vlora.cluster.observer import FrontObserver
from vlora.cluster.policy import RequestInfo
from vlora.engine.client import REFUSALS, Refusal
from vlora.cluster.replicas import LOST, ReplicaHandle, ReplicaSet, fire
from vlora.cluster.resumed_text import ResumedText
from vlora.engine.client import EngineFailed, Job, RequestFailed, RequestGroup, VisionInfo
from vlora.engine.detokenizer import Detokenizer
from vlora.engine.engine import RequestError
from vlora.engine.sequence import RequestOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TrackedRequest:
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
    replica: ReplicaHandle | None = None
    engine_id: str | None = None                         # the request's id on its current replica
    aborted: bool = False
    done: bool = False
    moved: bool = False                                  # its replica handed it back: place it again
    text: ResumedText | None = None                      # after a move: the text is decoded here
    inbox: asyncio.Queue | None = None                   # its replica's outputs (or LOST), while on one
    image_tokens: int = 0                                # prompt tokens its images add once expanded (LMMs)

    def info(self) -> RequestInfo:
        return RequestInfo(self.job.request_id, self.job.adapter, len(self.prompt_ids or ()) + self.image_tokens,
                           self.job.params.max_tokens, len(self.tokens))


class RequestTracker:
    def __init__(self, replicas: ReplicaSet, policy, tokenizer, spawn: Callable,
                 observers: list[FrontObserver] | None = None, vision: VisionInfo | None = None):
        """``spawn(coroutine)``: runs a task on the front's loop (the front cancels them on shutdown); ``vision``
        (LMMs): what an image adds to a prompt, so placement counts the KV of the expanded prompt. A request
        keeps its images wherever it runs: a replica it moves to encodes them again (resume by recompute)."""
        self.vision = vision
        self.replicas = replicas
        self.policy = policy
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.observers = observers if observers is not None else []
        self.spawn = spawn
        self.tracked: dict[str, TrackedRequest] = {}    # by the client's request id, until the final output
        self.migrations = 0                  # requests moved off a replica (KV shortage or rebalance)
        self.failovers = 0                   # requests rerun after their replica died

    def queued(self) -> int:
        """Requests held at the front (not on a replica)."""
        return sum(1 for t in self.tracked.values() if t.replica is None)

    def on_replica(self, replica_id: int) -> list[str]:
        """The requests running on a replica now."""
        return [rid for rid, t in self.tracked.items()
                if t.replica is not None and t.replica.replica_id == replica_id]

    async def submit(self, group: RequestGroup) -> None:
        """Track and place ``group``'s requests; returns once each was accepted by a replica, all or none (a
        refusal is raised as one engine raises it)."""
        loop = asyncio.get_running_loop()
        new = [TrackedRequest(job, group, self._prompt_ids(job.prompt), loop.create_future(),
                              image_tokens=self.vision.prompt_tokens_added(job.images) if self.vision else 0)
               for job in group.jobs]
        for t in new:
            if t.job.request_id in self.tracked:
                raise RequestError(f"request id {t.job.request_id!r} is already in use")
        for t in new:
            self.tracked[t.job.request_id] = t
            self.spawn(self._drive(t))
        try:
            await asyncio.gather(*(t.accepted for t in new))
        except BaseException:
            for t in new:
                self.abort_request(t, deliver=False)
            raise

    def _prompt_ids(self, prompt) -> list[int] | None:
        if isinstance(prompt, str):
            tok = self.tokenizer
            return None if tok is None else tok.encode(prompt, add_special_tokens=False)
        return list(prompt)

    # -- aborts and failures --------------------------------------------------------------------------------
    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (the groups' abort callback); ids no longer tracked are skipped."""
        for rid in request_ids:
            t = self.tracked.get(rid)
            if t is not None:
                self.abort_request(t)

    def abort_request(self, t: TrackedRequest, deliver: bool = True) -> None:
        """Abort ``t``: its replica answers with the abort output (forwarded); a request not on a replica gets
        it from here. ``deliver=False``: nobody listens (a refused submit)."""
        if t.done or t.aborted:
            return
        t.aborted = True
        if not deliver:
            t.done = True
        if t.replica is not None and t.engine_id is not None:
            fire(t.replica.actor.abort.remote([t.engine_id]))
        self.replicas.wake()

    def abort_queued(self, adapter: str) -> int:
        """Abort the requests of ``adapter`` held at the front; how many."""
        queued = [t for t in self.tracked.values() if t.job.adapter == adapter and t.replica is None]
        for t in queued:
            self.abort_request(t)
        return len(queued)

    def fail_all(self, exc: BaseException) -> None:
        for t in list(self.tracked.values()):
            self._fail_group(t, exc)

    # -- one request ----------------------------------------------------------------------------------------
    async def _drive(self, t: TrackedRequest) -> None:
        """Place and run ``t`` until it finishes, moving it whenever its replica hands it back or dies."""
        try:
            while not t.done:
                r = await self._place(t)
                if r is None:
                    break
                await self._attempt(t, r)
            if t.aborted and not t.done:
                t.done = True
                self._deliver(t, self._final(t, "abort"))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("request %s failed in the cluster front", t.job.request_id)
            self._fail_group(t, EngineFailed(f"the cluster front failed: {e!r}"))
        finally:
            self.tracked.pop(t.job.request_id, None)
            if not t.accepted.done():
                t.accepted.set_result(None)

    async def _place(self, t: TrackedRequest) -> ReplicaHandle | None:
        """The replica the policy picks for ``t`` (waiting for reports while it picks none); None if aborted."""
        while not t.aborted:
            if self.replicas.failure is not None:
                raise self.replicas.failure
            info = t.info()
            choice = self.policy.place(info, self.replicas.reports())
            if choice is not None and 0 <= choice < len(self.replicas) and self.replicas[choice].ready:
                self.policy.placed(info, choice)
                for o in self.observers:
                    o.placed(t.job.request_id, choice)
                return self.replicas[choice]
            await self.replicas.next_change()
        return None

    def _resume_job(self, t: TrackedRequest) -> Job:
        """The job that continues ``t`` on another replica: prompt + tokens already sent, the limits reduced."""
        n = len(t.tokens)
        engine_id = f"{t.job.request_id}#{t.attempt}"
        if n == 0:
            return replace(t.job, request_id=engine_id, prompt=t.prompt_ids or t.job.prompt)
        p = t.job.params
        params = replace(p, max_tokens=p.max_tokens - n, min_tokens=max(0, p.min_tokens - n), prompt_logprobs=None)
        self._text_here(t)
        return replace(t.job, request_id=engine_id, prompt=t.prompt_ids + t.tokens, params=params, resumed=n)

    async def _attempt(self, t: TrackedRequest, r: ReplicaHandle) -> None:
        """Run ``t`` on replica ``r`` until it finishes, is handed back, or ``r`` dies. Its outputs come from
        ``r``'s output stream through its route (``t.inbox``)."""
        import ray

        if t.tokens and len(t.tokens) >= t.job.params.max_tokens:    # nothing left to generate
            t.done = True
            self._deliver(t, self._final(t, "length"))
            return
        job = self._resume_job(t)
        t.engine_id, t.replica = job.request_id, r
        t.inbox = self.replicas.open_route(job.request_id, t.job.request_id, r)
        t.attempt += 1
        try:
            try:
                refused = await r.actor.submit.remote(job)
            except ray.exceptions.RayError as e:
                self._failover(t, r, type(e).__name__)
                return
            if refused is not None:
                if not r.ready:         # refused by a replica that has just restarted (adapters not synced yet)
                    self._failover(t, r, "restarted")
                else:
                    self._refused(t, r, refused)
                if not t.done:          # placed again after a pause (e.g. the replica's queue was full)
                    await asyncio.sleep(self.replicas.cluster.report_interval_s)
                return
            for o in self.observers:
                o.accepted(t.job.request_id, r.replica_id)
            if not t.accepted.done():
                t.accepted.set_result(None)
            if t.aborted:
                fire(r.actor.abort.remote([job.request_id]))
            while not (t.done or t.moved):
                item = await t.inbox.get()
                if item is LOST:
                    # the stream broke, not necessarily the replica: a live one would run the request on,
                    # holding its KV, while it reruns elsewhere
                    fire(r.actor.abort.remote([job.request_id]))
                    self._failover(t, r, "its output stream broke")
                    return
                if isinstance(item, Refusal):
                    self._refused(t, r, item)
                    return
                self._forward(t, item)
        finally:
            self.replicas.close_route(job.request_id)
            t.replica, t.inbox, t.moved = None, None, False

    def _moved(self, t: TrackedRequest, why: str) -> None:
        for o in self.observers:
            o.moved(t.job.request_id, why)

    def _failover(self, t: TrackedRequest, r: ReplicaHandle, why: str) -> None:
        log.warning("replica %d lost request %s (%s); placing it again", r.replica_id, t.job.request_id, why)
        self.replicas.lost(r)
        self.failovers += 1
        self._moved(t, "lost")

    def _refused(self, t: TrackedRequest, r: ReplicaHandle, item: Refusal) -> None:
        if item.kind == "EngineFailed":             # the replica's engine cannot go on: it restarts; run t elsewhere
            self.replicas.lost(r)
            self._moved(t, "lost")
            return
        if item.kind == "QueueFull" and t.accepted.done():      # a moved request waits for room like a new one
            return
        exc = REFUSALS.get(item.kind, EngineFailed)(item.message)
        t.done = True
        if not t.accepted.done():
            t.accepted.set_exception(exc)               # submit raises it, as one engine's submit would
        else:
            self._fail_group(t, exc if isinstance(exc, EngineFailed) else RequestFailed(
                f"request {t.job.request_id} failed: {item.message}"))

    # -- outputs --------------------------------------------------------------------------------------------
    def _forward(self, t: TrackedRequest, out: RequestOutput) -> None:
        """Pass a replica's output on, as the output of the request the client sent."""
        if out.finish_reason == "migrate":
            t.moved = True
            self.migrations += 1
            self._moved(t, "migrate")
            return
        if t.done:
            return
        t.tokens.extend(out.delta_token_ids)
        if out.logprobs is not None and out.delta_token_ids:
            t.logprobs = (t.logprobs or []) + out.logprobs[len(out.logprobs) - len(out.delta_token_ids):]
        if t.prompt_logprobs is None and out.prompt_logprobs is not None:
            t.prompt_logprobs = out.prompt_logprobs
        if t.prompt_ids is None:
            t.prompt_ids = list(out.prompt_token_ids)
        finished, reason = out.finished, out.finish_reason
        if t.text is None:
            delta, text = out.delta_text, out.text
        else:                                   # moved: the text of all its tokens, and stop strings over it
            if t.text.update():                 # a stop string that spans the move: finish here, "stop" as on
                if not finished:                # one engine (whose stop strings come before max_tokens)
                    fire(t.replica.actor.abort.remote([t.engine_id]))
                finished, reason = True, "stop"
            if finished:
                t.text.finish()
            delta, text = t.text.delta(), t.text.text
        t.emitted += len(delta)
        t.done = finished
        self._deliver(t, RequestOutput(t.job.request_id, t.job.adapter, t.prompt_ids, list(t.tokens), text,
                                       finished, reason, list(out.delta_token_ids), delta, out.error, out.task,
                                       *_logprobs(t)))

    def _text_here(self, t: TrackedRequest) -> ResumedText | None:
        """From now on ``t``'s text is decoded here, over all its tokens (None: no tokenizer)."""
        if t.text is None and self.tokenizer is not None:
            t.text = ResumedText(self.detokenizer, t.job.params, t.tokens, t.emitted)
        return t.text

    def _final(self, t: TrackedRequest, reason: str) -> RequestOutput:
        """The last output of ``t``, ended by the front (no replica holds it): as one engine ends a request, the
        text of its tokens, and what streaming held back as the last delta."""
        resumed, text, delta = self._text_here(t), "", ""
        if resumed is not None:
            resumed.finish()
            text, delta = resumed.text, resumed.delta()
            t.emitted += len(delta)
        return RequestOutput(t.job.request_id, t.job.adapter, t.prompt_ids or [], list(t.tokens), text, True,
                             reason, [], delta, None, None, *_logprobs(t))

    def _deliver(self, t: TrackedRequest, out: RequestOutput) -> None:
        if t.group.expects(t.job.request_id):           # not after the group failed
            t.group.deliver(out)

    def _fail_group(self, t: TrackedRequest, exc: BaseException) -> None:
        """The API call fails as a whole (as with one engine): its other requests stop."""
        for rid in t.group.request_ids:
            other = self.tracked.get(rid)
            if other is not None and other is not t:
                self.abort_request(other, deliver=False)
        t.done = True
        if not t.group.finished:
            t.group.deliver(exc)

    # -- rebalancing ----------------------------------------------------------------------------------------
    async def rebalance(self) -> None:
        """Apply the policy's migrations (e.g. consolidation emptying a replica) every report interval."""
        while not self.replicas.stopped:
            await asyncio.sleep(self.replicas.cluster.report_interval_s)
            running: dict[int, list[RequestInfo]] = {}
            on: dict[str, TrackedRequest] = {}
            for t in self.tracked.values():
                if t.replica is not None and not t.done:
                    running.setdefault(t.replica.replica_id, []).append(t.info())
                    on[t.job.request_id] = t
            try:
                moves = self.policy.rebalance(self.replicas.reports(), running)
            except Exception:
                log.exception("policy.rebalance failed")
                continue
            for m in moves:
                t = on.get(m.request_id)
                # a request of an adapter being unloaded stays: no other replica would take it
                if t is not None and t.replica is not None and t.replica.replica_id == m.source \
                        and t.job.adapter not in self.replicas.draining:
                    fire(t.replica.actor.migrate.remote([t.engine_id]))


def _logprobs(t: TrackedRequest) -> tuple:
    """(logprobs, prompt_logprobs, cumulative_logprob) of ``t``'s RequestOutput, over all its replicas."""
    if t.job.params.logprobs is None:
        return None, t.prompt_logprobs, None
    lp = t.logprobs or []
    return list(lp), t.prompt_logprobs, sum(x.logprob for x in lp)
