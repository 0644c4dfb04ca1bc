"""Continuous batching: which sequences run this iteration, and how many tokens each.

Every iteration: running sequences first (oldest first, one decode token each, or
their next prefill chunk), then waiting sequences in arrival order while the
token budget, the sequence cap and free KV blocks allow. When a running sequence
needs a block and none is free, the newest running sequence is preempted: its
blocks are freed and it waits to be recomputed (prompt + tokens so far), so no
answer is lost or changed.

The orchestrator of V-LoRA (Alg. 1: inference modes, credits, admission control)
extends this class; this part is the memory-safe batching underneath it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vlora.config import SchedulerConfig
from vlora.engine.sequence import Sequence, Status
from vlora.memory.pool import UnifiedPool


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int                  # first token index computed this iteration (= num_computed)
    num_tokens: int             # tokens computed this iteration

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so a next token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]
    truncated: tuple[Sequence, ...] = ()    # finished ("length"): would not fit even an empty KV cache

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: UnifiedPool, block_size: int, cache=None):
        """``cache``: a :class:`~vlora.memory.tree.PrefixTree` (prefix caching), or None."""
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # sorted by arrival
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = -(-(seq.num_computed + num_tokens) // self.block_size)
        return max(0, total - len(seq.blocks))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self._blocks_needed(seq, num_tokens)
        if not self.allocator.make_room(need):
            return False
        seq.blocks.extend(self.allocator.allocate(need))
        return True

    def _release(self, seq: Sequence) -> None:
        """Give back ``seq``'s KV blocks: to the prefix cache (full computed blocks) or the pool."""
        if self.cache is not None and seq.blocks:
            self.cache.release(seq.adapter_name, seq.cache_keys(0, seq.num_computed), seq.blocks,
                               seq.num_cached)
        else:
            self.allocator.free(seq.blocks)
        seq.blocks = []
        seq.num_cached = 0

    def _match(self, seq: Sequence) -> None:
        """A fresh sequence starts from the longest prefix cached under its adapter."""
        if self.cache is None or seq.blocks or seq.num_computed:
            return
        pages = self.cache.match(seq.adapter_name, seq.cache_keys(0, seq.num_tokens))
        seq.blocks, seq.num_cached = pages, len(pages)
        seq.num_computed = len(pages) * self.block_size

    def _admissible(self, seq: Sequence, budget: int) -> bool:
        """Whether a fresh sequence whose cached prefix is partly in host memory could get the pages of those
        blocks and of its first chunk, checked before :meth:`_match` copies them back. A sequence that cannot
        grow after its match gives its blocks straight back, and a swapper then moves them out again for the
        running sequences: every iteration it waited, its prefix crossed the host link twice (the swap thrash
        of the H100 multi-turn run). Without host blocks the match moves nothing and is simply tried."""
        if self.cache is None or seq.blocks or seq.num_computed:
            return True
        unpinned, pinned, host = self.cache.peek(seq.adapter_name, seq.cache_keys(0, seq.num_tokens))
        if not host:
            return True
        matched = unpinned + pinned + host
        n = min(seq.num_tokens - matched * self.block_size, budget)
        need = host + -(-(matched * self.block_size + n) // self.block_size) - matched
        return self.allocator.available() - unpinned >= need

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)            # it keeps its place: oldest waiting first

    def unfinished(self) -> list[Sequence]:
        """Running then waiting sequences, each in arrival order."""
        return list(self.running) + list(self.waiting)

    def schedule(self, eligible: set[str] | tuple[str, ...] | None = None) -> SchedulerOutput:
        """``eligible``: request ids the mode policy picked for this iteration (None: all)."""
        budget = self.config.max_num_batched_tokens
        ok = (lambda s: True) if eligible is None else (lambda s, e=set(eligible): s.request_id in e)
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        truncated: list[Sequence] = []
        queue = [s for s in self.running if ok(s)]    # the others keep their KV and sit this one out
        limit = self.allocator.num_blocks             # once per call: it sums over the resident adapters
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if len(seq.blocks) + self._blocks_needed(seq, n) > limit:
                self.finish(seq, "length")      # preempting would only bring it back to the same wall
                truncated.append(seq)
                continue
            while not self._grow(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n
        # admit waiting sequences only when nothing was preempted (they would thrash)
        for seq in [s for s in self.waiting if ok(s)]:
            if preempted or budget <= 0 or len(scheduled) >= self.config.max_num_seqs:
                break
            if not self._admissible(seq, budget):
                break
            self._match(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._grow(seq, n):
                self._release(seq)              # back to a fresh start (matched blocks unpinned)
                seq.num_computed = 0
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        self.running.sort(key=lambda s: s.arrival)
        return SchedulerOutput(tuple(scheduled), tuple(preempted), tuple(truncated))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and free its KV blocks (running or waiting)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
