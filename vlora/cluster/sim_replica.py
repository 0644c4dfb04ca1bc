"""One simulated replica: the engine's own scheduler and memory manager, with time from a cost table.

Each :class:`SimReplica` holds a real :class:`~vlora.engine.scheduler.Scheduler` and a real
:class:`~vlora.memory.manager.MemoryManager` and steps them as ``Engine.step`` does (unmerged mode, no prefix
cache, no SLO rejections):

    room = max_num_seqs - len(running)
    ready = memory.runnable(running, waiting, room, None)   # adapters of the running, then the first waiting ones
    out = scheduler.schedule(ready)                         # budget, sequence cap, pages, preemption
    preempted -> handed back to the front (hand_back) or recomputed later
    ... the iteration's seconds from the cost table, tokens appended, finished sequences freed ...
    memory.after(out, waiting, idle)                        # adapter prefetch for queued requests

Below them sit stand-ins of what holds tensors in the engine: :class:`SimPool`, the engine's
:class:`~vlora.memory.pool.UnifiedPool` whose pages are numbers over a buffer of one byte per page (same page
accounting, free-page counts, reclaim order and adapter pinning), and :class:`SimAdapterStore`, the engine's
:class:`~vlora.lora.device_store.AdapterStore` whose loads take pool pages and the table's load time instead
of copying weights. Sequences are the engine's :class:`~vlora.engine.sequence.Sequence` with placeholder
token ids. An adapter load's seconds are added to the next iteration the replica runs.

Runs of decode-only iterations in which nothing can change the batch are taken as one event (see
:meth:`SimReplica.start`); the result equals stepping each iteration.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from vlora.cluster.costs import CostTable
from vlora.cluster.policy import ReplicaReport, RequestInfo
from vlora.config import CacheConfig, SchedulerConfig
from vlora.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from vlora.engine.sequence import Sequence
from vlora.lora.device_store import AdapterStore
from vlora.memory.kv_cache import OutOfBlocks
from vlora.memory.manager import MemoryManager
from vlora.memory.pool import UnifiedPool
from vlora.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlora.bench.workloads import RequestSpec


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


class SimAdapter:
    """What the scheduler and the memory manager read of an adapter: its name (and its rank, for the table)."""
    __slots__ = ("name", "rank")
    placement = SimpleNamespace(ready=None)      # the store waits on no copy

    def __init__(self, name: str, rank: int):
        self.name, self.rank = name, rank


class SimPool(UnifiedPool):
    """The engine's unified pool as it is (page ids, runs of consecutive pages for adapters, reclaimers, pins)
    over a buffer of one byte per page."""

    def __init__(self, num_pages: int):
        super().__init__(num_pages, 1, 1, 1, 1, torch.uint8, torch.device("cpu"))


class SimAdapterStore(AdapterStore):
    """The engine's adapter store (``ensure``, eviction, prefetch) whose loads take the table's pages per rank
    and add the table's load time to :attr:`load_s` instead of copying weights."""

    def __init__(self, pool: SimPool, costs: CostTable):
        super().__init__(pool, torch.device("cpu"))
        self.costs = costs
        self.load_s = 0.0                   # seconds of loads not yet charged to an iteration

    def pages_needed(self, adapter: SimAdapter) -> int:
        return max(1, self.costs.adapter_pages(adapter.rank))

    def load(self, adapter: SimAdapter) -> bool:
        try:
            self.pool.place_adapter(adapter.name, [self.pool.page_elems * self.pages_needed(adapter)], 1)
        except OutOfBlocks:
            return False
        self.resident[adapter.name] = adapter
        self.num_loads += 1
        self.load_s += self.costs.load_s(adapter.rank)
        return True

    def evict(self, name: str) -> None:
        self.resident.pop(name)
        self.pool.release_adapter(name)
        self.num_evictions += 1
        for hook in self.on_evict:
            hook(name)

    def would_prefetch(self, wanted: list[SimAdapter], keep_free_pages: int) -> bool:
        """Whether :meth:`prefetch` would load anything now (it loads nothing when the first adapter it lacks
        does not fit)."""
        for a in wanted:
            if a.name not in self.resident:
                return self.pool.num_free - self.pages_needed(a) >= keep_free_pages
        return False


@dataclass
class _Iteration:
    """What a replica is running: one iteration, or a run of ``len(ends)`` decode-only ones."""
    scheduled: tuple[ScheduledSeq, ...]
    ends: list[float]                   # end time of each iteration of the run
    start: float
    growth: list[int] = field(default_factory=list)   # a run: pages taken by its iterations 1..j (growth[0] = 0)
    version: int = 0


class SimReplica:
    def __init__(self, replica_id: int, costs: CostTable, batch_cap: int, hand_back: bool = True):
        self.id, self.costs, self.batch_cap, self.hand_back = replica_id, costs, batch_cap, hand_back
        lim = costs.limits
        self.page_tokens, self.num_pages = lim.page_tokens, lim.num_pages
        self.max_seqs = lim.max_num_seqs
        self.pool = SimPool(lim.num_pages)
        self.store = SimAdapterStore(self.pool, costs)
        self.memory = MemoryManager(self.pool, SimpleNamespace(store=self.store),
                                    CacheConfig(block_size=lim.page_tokens, memory_policy="unified"))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=lim.max_num_seqs, max_num_batched_tokens=lim.max_num_batched_tokens,
            max_prefill_tokens_with_decodes=lim.max_prefill_tokens_with_decodes),
            self.pool, lim.page_tokens, max_chunks_with_decodes=lim.max_chunks_with_decodes)
        self.params = SamplingParams(max_tokens=1, ignore_eos=True)   # unread: the replica counts tokens
        self.adapters: dict[str, SimAdapter] = {}
        self.iteration: _Iteration | None = None
        self.kicked = False                 # a start is due (the replica was idle when a request came)
        self.version = 0
        self.busy_s = 0.0
        self.iterations = 0
        self.preemptions = 0
        self.finished: list[SimRequest] = []
        self.left: list[SimRequest] = []    # migrated away at the end of the last iteration
        self.by_id: dict[str, Sequence] = {}        # requests on the replica
        self.reqs: dict[str, SimRequest] = {}
        self.cancelled: set[str] = set()    # marked to migrate at the end of the iteration in progress
        self.stream_s = costs.served.stream_s   # an iteration's tokens reach the client this much later
        self.tokens_at: Counter[int] = Counter()   # tokens sampled in each second of the run
        self._orders = itertools.count()

    # -- state the front sees ----------------------------------------------------------------------
    def _steps_done(self, now: float) -> int:
        it = self.iteration
        return 0 if it is None else bisect.bisect_right(it.ends, now)

    def report(self, now: float, seq_no: int) -> ReplicaReport:
        """The replica as of ``now`` (the cluster replica's report: the pool's available pages, counting idle
        adapters' that KV may take): a run of decode iterations in progress counts its iterations begun."""
        free = self.pool.available()
        it = self.iteration
        if it is not None and it.growth:
            begun = min(self._steps_done(now) + 1, len(it.ends))
            free -= it.growth[begun - 1]
        sched = self.scheduler
        return ReplicaReport(self.id, len(sched.running), len(sched.waiting), free, self.num_pages,
                             self.page_tokens, frozenset(self.store.resident), self.batch_cap, True, seq_no)

    def infos(self, now: float) -> list[RequestInfo]:
        """The requests on the replica (running and waiting), oldest first, with the tokens they have sent by
        ``now``: what the front knows of its flights on the replica."""
        # a run of decode iterations holds every running sequence, each a token further per iteration done
        done = self._steps_done(now) if self.iteration is not None and self.iteration.growth else 0
        out = []
        for seq in self.scheduler.running:
            r = self.reqs[seq.request_id]
            out.append((seq.arrival, RequestInfo(r.request_id, r.spec.adapter, r.spec.input_len,
                                                 r.spec.output_len, r.generated + done)))
        out += [(s.arrival, self.reqs[s.request_id].info()) for s in self.scheduler.waiting]
        return [i for _, i in sorted(out, key=lambda x: x[0])]

    @property
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- requests in and out ------------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        """Queue ``req`` on the engine: its prompt here is the original prompt plus the tokens sent before."""
        req.replica = self.id
        name = req.spec.adapter
        adapter = None
        if name is not None:
            adapter = self.adapters.get(name)
            if adapter is None:
                adapter = self.adapters[name] = SimAdapter(name, req.rank)
        seq = Sequence(req.request_id, [0] * (req.spec.input_len + req.generated), self.params, adapter,
                       next(self._orders))
        self.by_id[req.request_id] = seq
        self.reqs[req.request_id] = req
        self.scheduler.add(seq)

    def _leave(self, seq: Sequence) -> None:
        """Hand ``seq`` back to the front (``Engine.hand_back``): it resumes elsewhere by recompute."""
        self.scheduler.finish(seq, "migrate")
        del self.by_id[seq.request_id]
        req = self.reqs.pop(seq.request_id)
        self.cancelled.discard(seq.request_id)
        req.migrations += 1
        self.left.append(req)

    def _finish(self, seq: Sequence, now: float | None) -> None:
        """``seq`` finished "length" at ``now`` (None: truncated, it cannot fit even an empty pool)."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "length")
        del self.by_id[seq.request_id]
        req = self.reqs.pop(seq.request_id)
        self.cancelled.discard(seq.request_id)
        req.finish_reason = "length"
        req.finish = math.inf if now is None else now + self.stream_s
        self.finished.append(req)

    def cancel(self, request_id: str) -> bool:
        """Migrate ``request_id`` away: it leaves at the end of the iteration in progress (now, if idle)."""
        if request_id not in self.by_id or request_id in self.cancelled:
            return False
        self.cancelled.add(request_id)
        if self.iteration is None:
            self._apply_cancels()
        return True

    def _apply_cancels(self) -> None:
        if self.cancelled:
            for seq in [s for s in self.scheduler.unfinished() if s.request_id in self.cancelled]:
                self._leave(seq)

    # -- the iteration ------------------------------------------------------------------------------
    def _schedule(self) -> tuple[SchedulerOutput, bool]:
        """``Engine._schedule`` in unmerged mode: (its output, whether the pool's adapters stayed as they were)."""
        sched, store = self.scheduler, self.store
        moves = store.num_loads, store.num_evictions
        room = max(0, self.max_seqs - len(sched.running))
        ready = self.memory.runnable(sched.running, list(sched.waiting), room, None)
        out = sched.schedule(ready)
        for seq in out.truncated:
            self._finish(seq, None)
        for seq in out.preempted:
            self.reqs[seq.request_id].preemptions += 1
            self.preemptions += 1
            if self.hand_back:              # a cluster replica gives it back to the front to resume elsewhere
                self._leave(seq)
        return out, (store.num_loads, store.num_evictions) == moves

    def _cost(self, scheduled: tuple[ScheduledSeq, ...], load_s: float) -> float:
        prefill = decodes = context = 0
        adapters = set()
        for s in scheduled:
            if s.num_tokens == 1 and s.start >= len(s.seq.prompt_token_ids):
                decodes += 1
                context += s.start
            else:
                prefill += s.num_tokens
            if s.seq.adapter is not None:
                adapters.add(s.seq.adapter.name)
        return self.costs.step(prefill, decodes, len(adapters), context, len(scheduled)) + load_s

    def start(self, now: float, fast_forward: bool) -> float | None:
        """Plan the next iteration (or run of decode iterations) from ``now``; its end time, or None if idle.

        A run: the iteration only decodes, every running sequence is in it, nothing was preempted, loaded or
        evicted, no load waits to be charged and the prefetch after it would load nothing. The scheduler then
        decides the same in the next iterations (waiting requests stay out: the budget, the sequence cap and the
        resident adapters stay as they are and free pages only shrink) until the first sequence finishes or a
        decode needs a page that only an eviction could give; the run stops there."""
        self._apply_cancels()
        if not self.has_work:
            self.iteration = None
            return None
        out, still = self._schedule()
        if out.is_empty:
            self.iteration = None
            return None
        load_s, self.store.load_s = self.store.load_s, 0.0
        end = now + self._cost(out.scheduled, load_s)
        it = _Iteration(out.scheduled, [end], now)
        sched = self.scheduler
        if (fast_forward and still and not load_s and not out.preempted and not out.truncated
                and len(out.scheduled) == len(sched.running)
                and all(s.num_tokens == 1 and s.start >= len(s.seq.prompt_token_ids) for s in out.scheduled)
                and not self.store.would_prefetch([s.adapter for s in sched.waiting if s.adapter is not None],
                                                  self._keep_free_pages())):
            self._extend(it)
        self.version += 1
        it.version = self.version
        self.iteration = it
        return it.ends[-1]

    def _keep_free_pages(self) -> int:
        return self.pool.num_pages // 4       # MemoryManager.after's prefetch threshold

    def _extend(self, it: _Iteration) -> None:
        """Lengthen a decode-only iteration into a run: until the first sequence finishes, while the pages the
        run takes are free (no eviction)."""
        seqs = [s.seq for s in it.scheduled]
        steps = min(self.reqs[s.request_id].spec.output_len - self.reqs[s.request_id].generated for s in seqs)
        if steps <= 1:
            return
        pt = self.page_tokens
        # iteration j computes position start + j of each sequence: a new page where that starts one, i.e. for
        # the sequences whose start % pt is -j mod pt
        residues = [0] * pt
        for s in it.scheduled:
            residues[s.start % pt] += 1
        adapters = len({s.adapter.name for s in seqs if s.adapter is not None})
        context = sum(s.start for s in it.scheduled)
        d = len(seqs)
        costs = self.costs
        base = costs.step(0, d, adapters, 0)             # the grid's value; the context term is added per step
        kv, floor = costs.kv_s_per_token * costs.step_scale[0], d * costs.grid_context
        free, taken = self.pool.num_free, 0
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
        """Apply the finished iteration(s) as ``Engine._finish`` does (tokens computed, tokens sampled,
        finishes), then ``MemoryManager.after``."""
        it = self.iteration
        steps = len(it.ends)
        self.iterations += steps
        self.busy_s += now - it.start
        if it.growth:                       # a run: each sequence a token further per iteration
            d = len(it.scheduled)
            for t in it.ends:
                self.tokens_at[int(t)] += d
            # the pages of iterations 2.. in the order the scheduler takes them (iteration, then batch order),
            # so the pool hands out the same pages as stepping would
            pt = self.page_tokens
            by_residue: list[list[Sequence]] = [[] for _ in range(pt)]
            for s in it.scheduled:
                by_residue[s.start % pt].append(s.seq)
            for j in range(1, steps):
                for seq in by_residue[-j % pt]:
                    seq.blocks.extend(self.pool.allocate(1))
            for s in it.scheduled:
                s.seq.num_computed = s.start + steps
                self._sample(s.seq, steps, now)
        else:
            for s in it.scheduled:
                seq = s.seq
                samples = s.samples
                seq.num_computed += s.num_tokens
                if samples:
                    self.tokens_at[int(now)] += 1
                    self._sample(seq, 1, now)
        self.iteration = None
        sched = self.scheduler
        self.memory.after(SchedulerOutput(it.scheduled, ()), list(sched.waiting), idle=not sched.num_unfinished)

    def _sample(self, seq: Sequence, tokens: int, now: float) -> None:
        req = self.reqs[seq.request_id]
        seq.output_token_ids.extend([0] * tokens)
        req.generated += tokens
        if req.first_token is None:
            req.first_token = now + self.stream_s
        if req.generated >= req.spec.output_len:
            self._finish(seq, now)
