"""A discrete-event model of a cluster of engine replicas, driven by measured cost tables.

Each replica (:class:`~vlora.cluster.sim_replica.SimReplica`) runs the engine's own scheduler and memory
manager (`vlora.engine.scheduler`, `vlora.memory.manager`) over a pool of page counts, with time taken from a
:class:`~vlora.cluster.costs.CostTable` instead of a model. A request the scheduler preempts for KV goes back
to the front (as the cluster's replicas hand it back) or, with ``hand_back=False``, is recomputed there later.

The front is the real cluster's: the *same* policy objects (`vlora.cluster.policy`) place each request on
the periodic reports plus their own placements, keep it queued (first come, first served) when they
return None, and every report period may migrate requests, which leave their replica at the end of its
iteration and resume elsewhere by recompute (prompt plus the tokens already sent).

As Vidur does, the model is event-driven: arrivals, iteration ends and report ticks. Runs of decode-only
iterations in which nothing can change the batch (no admission possible, no page short, no one finishing)
are taken as one event; anything that touches the replica meanwhile (a placement, a migration) cuts the run
at the iteration in progress, and reports read the state of the iteration in progress, so the result is
the same as stepping each iteration (`fast_forward=False`, which the tests compare).
"""
from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from vlora.cluster.costs import CostTable, profiled_batch_cap
from vlora.cluster.policy import Policy, ReplicaReport, RequestInfo
from vlora.cluster.sim_replica import SimReplica, SimRequest

if TYPE_CHECKING:
    from vlora.bench.workloads import RequestSpec

__all__ = ["ClusterSim", "SimReplica", "SimRequest", "SimResult", "cycled_rank", "profiled_batch_cap"]

DEFAULT_RANKS = (8, 16, 32, 64)


def cycled_rank(name: str | None, ranks: tuple[int, ...] = DEFAULT_RANKS) -> int:
    """Adapter ``a<i>``'s rank as the benchmarks register them: ``ranks[i % len(ranks)]``; 0 for the base model."""
    if name is None:
        return 0
    digits = name.lstrip("abcdefghijklmnopqrstuvwxyz_")
    return ranks[int(digits) % len(ranks)] if digits.isdigit() else ranks[-1]


class _Infos(Mapping):
    """``rebalance``'s view of the requests on each replica, built only for the replicas a policy looks at."""

    def __init__(self, replicas: list[SimReplica], now: float):
        self.replicas, self.now, self.cache = replicas, now, {}

    def __getitem__(self, rid: int) -> list[RequestInfo]:
        if rid not in self.cache:
            if not 0 <= rid < len(self.replicas):
                raise KeyError(rid)
            self.cache[rid] = self.replicas[rid].infos(self.now)
        return self.cache[rid]

    def __iter__(self):
        return iter(range(len(self.replicas)))

    def __len__(self) -> int:
        return len(self.replicas)


@dataclass
class SimResult:
    requests: list[SimRequest]
    replicas: int
    migrations: int
    preemptions: int
    busy_s: list[float]                 # per replica, seconds it ran iterations
    iterations: int
    settings: dict = field(default_factory=dict)
    tokens_at: Counter = field(default_factory=Counter)   # tokens sampled in each second of the run

    def window_tok_s(self) -> float | None:
        """Output tokens per second over the second half of the arrival window (whole seconds): the rate the
        cluster sustains while requests still come, without the drain after the last arrival."""
        last = max((r.arrival for r in self.requests), default=0.0)
        lo, hi = int(last / 2), int(last)
        if hi - lo < 1:
            return None
        return sum(self.tokens_at[t] for t in range(lo, hi)) / (hi - lo)

    def metrics(self) -> dict:
        done = [r for r in self.requests if r.finish is not None and math.isfinite(r.finish)]
        if not done:
            return dict(self.settings, requests=len(self.requests), finished=0)
        t0 = min(r.arrival for r in self.requests)
        span = max(r.finish for r in done) - t0
        ttft = [r.ttft for r in done]
        lat = [r.latency for r in done]
        tokens = sum(r.spec.output_len for r in done)
        return dict(
            self.settings, requests=len(self.requests), finished=len(done),
            unserved=len(self.requests) - len(done), duration_s=span,
            throughput_rps=len(done) / span if span > 0 else 0.0,
            output_tok_s=tokens / span if span > 0 else 0.0,
            mean_ttft_s=statistics.fmean(ttft), p50_ttft_s=_pct(ttft, 50), p90_ttft_s=_pct(ttft, 90),
            p99_ttft_s=_pct(ttft, 99), mean_latency_s=statistics.fmean(lat), p99_latency_s=_pct(lat, 99),
            avg_token_latency_s=sum(lat) / tokens if tokens else 0.0,
            gpus=self.replicas, gpus_used=sum(1 for b in self.busy_s if b > 0),
            mean_busy_gpus=sum(self.busy_s) / span if span > 0 else 0.0,
            window_tok_s=self.window_tok_s(),
            migrations=self.migrations, preemptions=self.preemptions, iterations=self.iterations)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


# event kinds, in the order events at the same time are handled: an idle replica starts after every request
# arriving (or reaching it) at that instant has been placed (an engine steps once for requests queued together)
_DONE, _ARRIVE, _ADMIT, _TICK, _START = 0, 1, 2, 3, 4


class ClusterSim:
    """``replicas`` replicas of the engine the cost table measured, placed by ``policy``.

    ``report_s``: the period of replica reports (and of the policy's rebalancing); ``batch_cap``: the
    batch cap the reports carry (default: the engine's max_num_seqs, as the cluster's replicas report; Punica's
    profiled cap is :func:`profiled_batch_cap`); ``adapter_rank``: each adapter's rank (default:
    :func:`cycled_rank`, as the benchmarks register them); ``hand_back``: a replica gives a request it preempts
    for KV back to the front, which places it again (the cluster's replicas do), rather than recompute it
    itself later."""

    def __init__(self, costs: CostTable, replicas: int, policy: Policy, report_s: float = 0.05,
                 batch_cap: int | None = None, adapter_rank: Callable[[str | None], int] = cycled_rank,
                 fast_forward: bool = True, hand_back: bool = True):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if report_s <= 0:
            raise ValueError(f"report_s must be > 0, got {report_s}")
        self.costs, self.policy, self.report_s = costs, policy, report_s
        self.batch_cap = batch_cap or costs.limits.max_num_seqs
        self.adapter_rank, self.fast_forward = adapter_rank, fast_forward
        self.replicas = [SimReplica(i, costs, self.batch_cap, hand_back) for i in range(replicas)]

    def run(self, specs: Iterable[RequestSpec]) -> SimResult:
        heap: list = []
        order = itertools.count()
        later: dict[int, list[RequestSpec]] = {}      # multi-turn: turns sent after the previous one finishes
        for s in specs:
            if s.session is not None and s.turn > 0:
                later.setdefault(s.session, []).append(s)
            else:
                heapq.heappush(heap, (s.arrival_s, _ARRIVE, next(order), s))
        for turns in later.values():
            turns.sort(key=lambda s: s.turn)
        reqs: list[SimRequest] = []
        ids = itertools.count()
        queue: deque[SimRequest] = deque()           # at the front, first come first served
        reports: list[ReplicaReport] = []
        ticks = itertools.count(1)
        pending = len(heap)                           # arrivals (and migrated or admitted requests) still to come
        submit_s = self.costs.served.submit_s
        now = 0.0

        def push(t: float, kind: int, payload) -> None:
            heapq.heappush(heap, (t, kind, next(order), payload))

        def scheduled(rep: SimReplica, end: float | None) -> None:
            if end is not None:
                push(end, _DONE, (rep.id, rep.iteration.version))

        def place(req: SimRequest) -> bool:
            nonlocal pending
            info = req.info()
            rid = self.policy.place(info, reports)
            if rid is None:
                return False
            self.policy.placed(info, rid)
            if submit_s:                              # on its way to the replica's engine
                req.replica = rid
                push(now + submit_s, _ADMIT, req)
                pending += 1
            else:
                admit(req, rid)
            return True

        def admit(req: SimRequest, rid: int) -> None:
            rep = self.replicas[rid]
            rep.add(req)
            if rep.iteration is not None:
                scheduled(rep, rep.cut(now))
            elif not rep.kicked:
                rep.kicked = True
                push(now, _START, rep.id)

        def submit(req: SimRequest) -> None:
            pages = -(-(req.spec.input_len + req.generated + 1) // self.costs.limits.page_tokens)
            if pages > self.costs.limits.num_pages:
                req.finish, req.finish_reason = math.inf, "too_long"
            elif queue or not place(req):
                queue.append(req)

        def send_off(rep: SimReplica) -> None:
            nonlocal pending
            for req in rep.left:                      # migrated: back at the front after the migration's cost
                push(now + self.costs.migration_s, _ARRIVE, req)
                pending += 1
            rep.left.clear()

        reports[:] = [r.report(now, 0) for r in self.replicas]
        tick_at, idle_ticks = None, 0
        while heap:
            now, kind, _, payload = heapq.heappop(heap)
            if kind == _ARRIVE:
                pending -= 1
                if isinstance(payload, SimRequest):
                    submit(payload)
                else:
                    req = SimRequest(f"r{next(ids)}", payload, self.adapter_rank(payload.adapter), now)
                    reqs.append(req)
                    submit(req)
            elif kind == _DONE:
                rep = self.replicas[payload[0]]
                if rep.iteration is None or rep.iteration.version != payload[1]:
                    continue                          # a run that was cut short
                rep.complete(now)
                for req in rep.finished:
                    turns = later.get(req.spec.session) if req.spec.session is not None else None
                    if turns and req.finish_reason == "length":      # the client's think time after the answer
                        push(req.finish + turns[0].after_s, _ARRIVE, turns.pop(0))
                        pending += 1
                rep.finished.clear()
                scheduled(rep, rep.start(now, self.fast_forward))
                send_off(rep)
            elif kind == _ADMIT:
                pending -= 1
                admit(payload, payload.replica)
            elif kind == _START:
                rep = self.replicas[payload]
                rep.kicked = False
                if rep.iteration is None:
                    scheduled(rep, rep.start(now, self.fast_forward))
                    send_off(rep)
            else:
                tick_at = None
                n = next(ticks)
                reports[:] = [r.report(now, n) for r in self.replicas]
                while queue and place(queue[0]):
                    queue.popleft()
                for m in self.policy.rebalance(reports, _Infos(self.replicas, now)):
                    rep = self.replicas[m.source]
                    if rep.cancel(m.request_id):
                        scheduled(rep, rep.cut(now))
                        send_off(rep)
            busy = any(r.iteration is not None or r.kicked for r in self.replicas)
            idle_ticks = 0 if busy or pending else idle_ticks + (kind == _TICK)
            if tick_at is None and (busy or pending or (queue and idle_ticks < 2)):
                k = math.floor(now / self.report_s) + 1
                while k * self.report_s <= now:       # floor of a rounded quotient can land on now itself
                    k += 1
                tick_at = k * self.report_s
                push(tick_at, _TICK, None)
        for req in queue:
            req.finish_reason = "unplaced"
        tokens_at = Counter()
        for r in self.replicas:
            tokens_at.update(r.tokens_at)
        return SimResult(reqs, len(self.replicas), sum(r.migrations for r in reqs),
                         sum(r.preemptions for r in self.replicas), [r.busy_s for r in self.replicas],
                         sum(r.iterations for r in self.replicas),
                         {"policy": self.policy.name, "replicas": len(self.replicas), "report_s": self.report_s,
                          "batch_cap": self.batch_cap}, tokens_at)
