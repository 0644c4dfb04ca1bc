"""A discrete-event model of a cluster of engine replicas, driven by measured cost tables.

Each replica is the engine's continuous batching (`vlora.engine.scheduler`) with time taken from a
:class:`~vlora.cluster.costs.CostTable` instead of a model: every iteration, running sequences first (oldest
first, a decode token or their next prefill chunk within the token budget), then waiting ones in order
while the budget, the sequence cap and free pool pages allow; a running sequence short of a page preempts
the newest running one, which the replica hands back to the front (as the cluster's replicas do) or, with
``hand_back=False``, recomputes itself later. Adapters take pool pages; one not resident is loaded (its
measured load time added to the iteration), evicting idle adapters least recently used first.

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

import bisect
import heapq
import itertools
import math
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Iterable

from vlora.bench.workloads import RequestSpec
from vlora.cluster.costs import CostTable
from vlora.cluster.policy import Policy, ReplicaReport, RequestInfo

DEFAULT_RANKS = (8, 16, 32, 64)


def cycled_rank(name: str | None, ranks: tuple[int, ...] = DEFAULT_RANKS) -> int:
    """Adapter ``a<i>``'s rank as the benchmarks register them: ``ranks[i % len(ranks)]``; 0 for the base model."""
    if name is None:
        return 0
    digits = name.lstrip("abcdefghijklmnopqrstuvwxyz_")
    return ranks[int(digits) % len(ranks)] if digits.isdigit() else ranks[-1]


@dataclass
class SimRequest:
    """One request's life in the simulation; its result fields are filled as it runs."""
    request_id: str
    spec: RequestSpec
    rank: int
    arrival: float
    generated: int = 0
    replica: int | None = None
    first_token: float | None = None
    finish: float | None = None
    finish_reason: str | None = None
    migrations: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    def info(self) -> RequestInfo:
        return RequestInfo(self.request_id, self.spec.adapter, self.spec.input_len, self.spec.output_len,
                           self.generated)


class _Seq:
    """A request on one replica: its prompt there is the original prompt plus the tokens sent before it came."""
    __slots__ = ("req", "order", "adapter", "prompt", "out", "target", "computed", "pages", "cancel")

    def __init__(self, req: SimRequest, order: int):
        self.req, self.order, self.adapter = req, order, req.spec.adapter
        self.prompt = req.spec.input_len + req.generated
        self.out = 0
        self.target = req.spec.output_len - req.generated
        self.computed = 0
        self.pages = 0
        self.cancel = False

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.out


@dataclass
class _Iteration:
    """What a replica is running: one iteration, or a run of ``len(ends)`` decode-only ones."""
    chunks: list[tuple[_Seq, int]]
    ends: list[float]                   # end time of each iteration of the run
    start: float
    growth: list[int] = field(default_factory=list)   # a run: pages taken by its iterations 1..j (growth[0] = 0)
    version: int = 0


class Replica:
    def __init__(self, replica_id: int, costs: CostTable, batch_cap: int, hand_back: bool = True):
        self.id, self.costs, self.batch_cap, self.hand_back = replica_id, costs, batch_cap, hand_back
        lim = costs.limits
        self.page_tokens, self.num_pages = lim.page_tokens, lim.num_pages
        self.max_seqs, self.budget = lim.max_num_seqs, lim.max_num_batched_tokens
        self.free = lim.num_pages
        self.running: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.resident: OrderedDict[str, int] = OrderedDict()   # adapter -> pages, least recently used first
        self.iteration: _Iteration | None = None
        self.kicked = False                 # a start is due (the replica was idle when a request came)
        self.version = 0
        self.busy_s = 0.0
        self.iterations = 0
        self.preemptions = 0
        self.finished: list[SimRequest] = []
        self.left: list[SimRequest] = []    # migrated away at the end of the last iteration
        self.by_id: dict[str, _Seq] = {}    # requests on the replica
        self.stream_s = costs.served.stream_s   # an iteration's tokens reach the client this much later
        self.tokens_at: Counter[int] = Counter()   # tokens sampled in each second of the run
        self.cancels = 0                    # of them, marked to migrate
        self._orders = itertools.count()

    # -- state the front sees ----------------------------------------------------------------------
    def _steps_done(self, now: float) -> int:
        it = self.iteration
        return 0 if it is None else bisect.bisect_right(it.ends, now)

    def report(self, now: float, seq_no: int) -> ReplicaReport:
        """The replica as of ``now``: a run of decode iterations in progress counts its iterations begun."""
        free = self.free
        it = self.iteration
        if it is not None and it.growth:
            begun = min(self._steps_done(now) + 1, len(it.ends))
            free -= it.growth[begun - 1]
        # KV can have the free pages and those of idle adapters (evicted on demand), as the pool's available()
        return ReplicaReport(self.id, len(self.running), len(self.waiting), free + self._idle_adapter_pages(),
                             self.num_pages, self.page_tokens, frozenset(self.resident), self.batch_cap, True,
                             seq_no)

    def infos(self, now: float) -> list[RequestInfo]:
        """The requests on the replica (running and waiting), oldest first, with the tokens they have sent by
        ``now``: what the front knows of its flights on the replica."""
        # a run of decode iterations holds every running sequence, each a token further per iteration done
        done = self._steps_done(now) if self.iteration is not None and self.iteration.growth else 0
        out = [(s.order, RequestInfo(s.req.request_id, s.req.spec.adapter, s.req.spec.input_len,
                                     s.req.spec.output_len, s.req.generated + done)) for s in self.running]
        out += [(s.order, s.req.info()) for s in self.waiting]
        return [i for _, i in sorted(out, key=lambda x: x[0])]

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- pages and adapters -------------------------------------------------------------------------
    def _pinned(self) -> set[str]:
        return {s.adapter for s in self.running if s.adapter is not None}

    def _idle_adapter_pages(self) -> int:
        if not self.resident:
            return 0
        pinned = self._pinned()
        return sum(p for a, p in self.resident.items() if a not in pinned)

    def _make_room(self, pages: int, keep: set[str]) -> bool:
        """Free pages by evicting idle adapters (least recently used first) until ``pages`` are free."""
        if self.free >= pages:
            return True
        pinned = self._pinned() | keep
        for name in list(self.resident):
            if self.free >= pages:
                break
            if name not in pinned:
                self.free += self.resident.pop(name)
        return self.free >= pages

    def _pages_for(self, seq: _Seq, n: int) -> int:
        return max(0, -(-(seq.computed + n) // self.page_tokens) - seq.pages)

    def _grow(self, seq: _Seq, n: int, keep: set[str]) -> bool:
        need = self._pages_for(seq, n)
        if not self._make_room(need, keep):
            return False
        self.free -= need
        seq.pages += need
        return True

    def _release(self, seq: _Seq) -> None:
        self.free += seq.pages
        seq.pages = 0

    def _ensure_adapter(self, seq: _Seq, keep: set[str]) -> float | None:
        """Seconds to make ``seq``'s adapter resident (0 if it is), or None if its pages cannot be had."""
        name = seq.adapter
        if name is None:
            return 0.0
        if name in self.resident:
            self.resident.move_to_end(name)
            return 0.0
        pages = self.costs.adapter_pages(seq.req.rank)
        if not self._make_room(pages, keep):
            return None
        self.free -= pages
        self.resident[name] = pages
        return self.costs.load_s(seq.req.rank)

    # -- the iteration ------------------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        req.replica = self.id
        seq = _Seq(req, next(self._orders))
        self.by_id[req.request_id] = seq
        self.waiting.append(seq)

    def _preempt(self, seq: _Seq) -> None:
        self._release(seq)
        seq.computed = 0
        seq.req.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        if self.hand_back:                  # a cluster replica gives it back to the front to resume elsewhere
            del self.by_id[seq.req.request_id]
            seq.req.migrations += 1
            self.left.append(seq.req)
        else:
            self.waiting.appendleft(seq)

    def _schedule(self) -> tuple[list[tuple[_Seq, int]], float, bool, bool]:
        """One iteration of the engine's scheduler: (chunks, adapter load seconds, preempted, admission
        blocked for good while the batch only decodes)."""
        budget = self.budget
        chunks: list[tuple[_Seq, int]] = []
        preempted = False
        load_s = 0.0
        queue = deque(self.running)
        batch_adapters = {s.adapter for s in queue}
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_tokens - seq.computed, budget)
            if -(-(seq.computed + n) // self.page_tokens) > self.num_pages:
                self._finish(seq, "length", None)
                continue
            while not self._grow(seq, n, set()):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chunks.append((seq, n))
                budget -= n
        blocked = True
        if not preempted:
            while self.waiting:
                seq = self.waiting[0]
                if budget <= 0 or len(chunks) >= self.max_seqs:
                    break
                n = min(seq.num_tokens - seq.computed, budget)
                keep = batch_adapters | {seq.adapter}
                before = (self.free, OrderedDict(self.resident))
                extra = self._ensure_adapter(seq, keep)
                if extra is None or not self._grow(seq, n, keep):
                    self.free, self.resident = before   # the engine checks before it evicts or loads
                    break
                blocked = False
                load_s += extra
                self.waiting.popleft()
                self.running.append(seq)
                batch_adapters.add(seq.adapter)
                chunks.append((seq, n))
                budget -= n
        self.running.sort(key=lambda s: s.order)
        return chunks, load_s, preempted, blocked

    def _cost(self, chunks: list[tuple[_Seq, int]], load_s: float) -> float:
        prefill = decodes = context = 0
        adapters = set()
        for seq, n in chunks:
            if n == 1 and seq.out > 0 and seq.computed == seq.num_tokens - 1:
                decodes += 1
                context += seq.computed
            else:
                prefill += n
            if seq.adapter is not None:
                adapters.add(seq.adapter)
        return self.costs.step(prefill, decodes, len(adapters), context, len(chunks)) + load_s

    def start(self, now: float, fast_forward: bool) -> float | None:
        """Plan the next iteration (or run of decode iterations) from ``now``; its end time, or None if idle."""
        self._apply_cancels()
        if not self.has_work:
            self.iteration = None
            return None
        chunks, load_s, preempted, blocked = self._schedule()
        if not chunks:
            self.iteration = None
            return None
        end = now + self._cost(chunks, load_s)
        it = _Iteration(chunks, [end], now)
        if (fast_forward and not preempted and not load_s and blocked and len(chunks) == len(self.running)
                and all(n == 1 and s.out > 0 and s.computed == s.num_tokens - 1 for s, n in chunks)):
            self._extend(it)
        self.version += 1
        it.version = self.version
        self.iteration = it
        return it.ends[-1]

    def _extend(self, it: _Iteration) -> None:
        """Lengthen a decode-only iteration into a run: until the first sequence finishes, while the pages the
        run takes need no eviction."""
        seqs = [s for s, _ in it.chunks]
        steps = min(s.target - s.out for s in seqs)
        if steps <= 1:
            return
        pt = self.page_tokens
        # iteration j computes position computed + j of each sequence: a new page where that starts one, i.e.
        # for the sequences whose computed % pt is -j mod pt
        residues = [0] * pt
        for s in seqs:
            residues[s.computed % pt] += 1
        adapters = len({s.adapter for s in seqs if s.adapter is not None})
        context = sum(s.computed for s in seqs)
        d = len(seqs)
        costs = self.costs
        base = costs.step(0, d, adapters, 0)             # the grid's value; the context term is added per step
        kv, floor = costs.kv_s_per_token, d * costs.grid_context
        free, taken = self.free, 0
        cum = it.growth = [0]
        ends = it.ends
        t = ends[0]
        for j in range(1, steps):
            need = residues[-j % pt]
            if taken + need > free:
                break
            taken += need
            cum.append(taken)
            t = t + (base + kv * max(0, context + j * d - floor))
            ends.append(t)

    def cut(self, now: float) -> float | None:
        """Something touched the replica at ``now``: a run of iterations ends with the one in progress. The
        new end time, or None if nothing changed."""
        it = self.iteration
        if it is None or len(it.ends) == 1:
            return None
        k = min(bisect.bisect_left(it.ends, now) + 1, len(it.ends))
        if k == len(it.ends):
            return None
        del it.ends[k:]
        del it.growth[k:]
        self.version += 1
        it.version = self.version
        return it.ends[-1]

    def complete(self, now: float) -> None:
        """Apply the finished iteration(s): tokens computed, tokens sampled, finishes."""
        it = self.iteration
        steps = len(it.ends)
        self.iterations += steps
        self.busy_s += now - it.start
        if it.growth:
            self.free -= it.growth[-1]
            d = len(it.chunks)
            for t in it.ends:
                self.tokens_at[int(t)] += d
        for seq, n in it.chunks:
            if it.growth:
                seq.pages = -(-(seq.computed + steps) // self.page_tokens)
                seq.computed += steps
                self._sample(seq, steps, now)
                continue
            seq.computed += n
            if seq.computed == seq.num_tokens:
                self.tokens_at[int(now)] += 1
                self._sample(seq, 1, now)
        self.iteration = None

    def _sample(self, seq: _Seq, tokens: int, now: float) -> None:
        req = seq.req
        seq.out += tokens
        req.generated += tokens
        if req.first_token is None:
            req.first_token = now + self.stream_s
        if seq.out >= seq.target:
            self._finish(seq, "length", now)

    def _finish(self, seq: _Seq, reason: str, now: float | None) -> None:
        self.by_id.pop(seq.req.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.req.finish_reason = reason
        # truncated (now None): it cannot fit even an empty pool
        seq.req.finish = math.inf if now is None else now + self.stream_s
        self.finished.append(seq.req)

    def cancel(self, request_id: str) -> bool:
        """Migrate ``request_id`` away: it leaves at the end of the iteration in progress (now, if idle)."""
        seq = self.by_id.get(request_id)
        if seq is None or seq.cancel:
            return False
        seq.cancel = True
        self.cancels += 1
        if self.iteration is None:
            self._apply_cancels()
        return True

    def _apply_cancels(self) -> None:
        if not self.cancels:
            return
        self.cancels = 0
        for seq in [s for s in itertools.chain(self.running, self.waiting) if s.cancel]:
            del self.by_id[seq.req.request_id]
            if seq in self.running:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._release(seq)
            seq.req.migrations += 1
            self.left.append(seq.req)


class _Infos(Mapping):
    """``rebalance``'s view of the requests on each replica, built only for the replicas a policy looks at."""

    def __init__(self, replicas: list[Replica], now: float):
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
        self.replicas = [Replica(i, costs, self.batch_cap, hand_back) for i in range(replicas)]

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

        def scheduled(rep: Replica, end: float | None) -> None:
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

        def send_off(rep: Replica) -> None:
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


def profiled_batch_cap(costs: CostTable, latency_s: float | None = None) -> int:
    """Punica's profiled batch cap: the decode batch beyond which a larger batch slows each token more than it
    raises throughput. With the decode step a line ``s(d) = a + b d`` (least squares over the table's decode
    points, served costs included, one adapter per request up to the table's largest count), doubling the batch
    multiplies throughput by ``2 s(d) / s(2d)`` and each token's latency by ``s(2d) / s(d)``; the second is the
    larger from ``d = a / (sqrt(2) b)`` on, which is the cap. ``latency_s``: also keep the decode step at most
    this long. Between 1 and the engine's max_num_seqs (that, when the step does not grow with the batch)."""
    top = costs.limits.max_num_seqs
    pts = [(d, costs.step(0, d, min(d, costs.adapters[-1]), d * costs.grid_context))
           for d in costs.decode if 0 < d <= top]
    cap = top
    if len(pts) >= 2:
        mx = statistics.fmean(d for d, _ in pts)
        my = statistics.fmean(t for _, t in pts)
        var = sum((d - mx) ** 2 for d, _ in pts)
        b = sum((d - mx) * (t - my) for d, t in pts) / var
        a = my - b * mx
        if b > 0 and a > 0:
            cap = math.ceil(a / (math.sqrt(2) * b))
    if latency_s is not None:
        step = lambda d: costs.step(0, d, min(d, costs.adapters[-1]), d * costs.grid_context)  # noqa: E731
        cap = min(cap, max((d for d in range(1, top + 1) if step(d) <= latency_s), default=1))
    return max(1, min(top, cap))
