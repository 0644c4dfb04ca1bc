"""Continuous batching: which sequences run this iteration, and how many tokens each.

Every iteration: running sequences first (oldest first, one decode token each, or
their next prefill chunk), then waiting sequences in arrival order while the
token budget, the sequence cap and free KV blocks allow. An iteration that
decodes computes at most ``max_prefill_tokens_with_decodes`` prompt tokens beside
its decodes, so that a long prompt does not stall the streams in flight. When a running sequence
needs a block and none is free, the newest running sequence is preempted: its
blocks are freed and it waits to be recomputed (prompt + tokens so far), so no
answer is lost or changed.

The orchestrator of V-LoRA (Alg. 1: inference modes, credits, admission control)
extends this class; this part is the memory-safe batching underneath it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from vlora.config import SchedulerConfig
from vlora.engine.sequence import Sequence, Status
from vlora.memory.pool import UnifiedPool


class ScheduledSeq(NamedTuple):         # a tuple: one is made per sequence per iteration
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
    def __init__(self, config: SchedulerConfig, allocator: UnifiedPool, block_size: int, cache=None,
                 max_chunks_with_decodes: int | None = None):
        """``cache``: a :class:`~vlora.memory.tree.PrefixTree` (prefix caching), or None;
        ``max_chunks_with_decodes``: most prompt chunks beside decodes (the chunk slots of the CUDA graphs such
        an iteration replays; None: no bound)."""
        self.max_chunks_with_decodes = max_chunks_with_decodes
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # sorted by arrival
        # counters (benchmarks): preemptions; tokens the model computed, of them prompt positions and positions a
        # sequence had computed before (KV lost to a preemption); admissions stopped because the oldest waiting
        # sequence could not get the pages of its first chunk; admissions put off while a prefix copied back
        # from host memory had not landed
        self.num_preemptions = 0
        self.computed_tokens = 0
        self.prompt_tokens_computed = 0
        self.recomputed_tokens = 0
        self.admissions_blocked = 0
        self.admissions_deferred = 0
        self._computed_before: dict[str, int] = {}   # preempted sequences: tokens they had computed

    def counters(self) -> dict[str, int]:
        return {"preemptions": self.num_preemptions, "computed_tokens": self.computed_tokens,
                "prompt_tokens_computed": self.prompt_tokens_computed, "recomputed_tokens": self.recomputed_tokens,
                "admissions_blocked": self.admissions_blocked, "admissions_deferred": self.admissions_deferred}

    def _count(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        self.computed_tokens += n
        prompt = len(seq.prompt_token_ids)
        if start < prompt:
            self.prompt_tokens_computed += min(start + n, prompt) - start
        before = self._computed_before.get(seq.request_id, 0)
        if start < before:
            self.recomputed_tokens += min(start + n, before) - start

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
        if self.cache is None or seq.blocks or seq.num_computed or _needs_prompt_logits(seq):
            return
        pages = self.cache.match(seq.adapter_name, seq.cache_keys(0, seq.num_tokens))
        seq.blocks, seq.num_cached = pages, len(pages)
        seq.num_computed = len(pages) * self.block_size

    def _admissible(self, seq: Sequence, budget: int) -> bool:
        """Whether a fresh sequence could get the pages of its first chunk and of the blocks of its cached prefix
        that are in host memory, checked before :meth:`_match` pins (and copies back) that prefix. A sequence that
        cannot grow after its match gives its blocks straight back: with host blocks, a swapper would move them
        out again for the running sequences, so every iteration it waits its prefix crosses the host link twice;
        without, every iteration it waits counts its prompt as looked up again and its path as visited again (the
        frequencies the swapper ranks by)."""
        if seq.blocks or seq.num_computed:
            return True
        unpinned = pinned = host = 0
        if self.cache is not None and not _needs_prompt_logits(seq):
            unpinned, pinned, host = self.cache.peek(seq.adapter_name, seq.cache_keys(0, seq.num_tokens))
        matched = unpinned + pinned + host
        n = min(seq.num_tokens - matched * self.block_size, budget)
        need = host + -(-(matched * self.block_size + n) // self.block_size) - matched
        if need <= self.allocator.num_free:
            return True
        return self.allocator.available() - unpinned >= need

    def _preempt(self, seq: Sequence) -> None:
        rid = seq.request_id
        self._computed_before[rid] = max(self._computed_before.get(rid, 0), seq.num_computed)
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
        # the others keep their KV and sit this one out
        queue = deque(self.running if eligible is None else [s for s in self.running if ok(s)])
        # prompt tokens beside decodes: few enough that the decoding streams are not stalled for long
        prompt_budget, chunks = budget, 1 << 30
        if any(seq.num_tokens - seq.num_computed == 1 for seq in queue):
            prompt_budget = self.config.max_prefill_tokens_with_decodes or budget
            chunks = self.max_chunks_with_decodes or chunks
        limit = self.allocator.num_blocks             # once per call: it sums over the resident adapters
        while queue and budget > 0:
            seq = queue.popleft()
            start = seq.num_computed
            left = seq.num_tokens - start
            n = min(left, budget) if left == 1 else min(left, budget, prompt_budget) if chunks > 0 else 0
            if n <= 0:
                continue                        # a prompt chunk waits for the next iteration
            need = self._blocks_needed(seq, n)           # most decodes need no new page
            if len(seq.blocks) + need > limit:
                self.finish(seq, "length")      # preempting would only bring it back to the same wall
                truncated.append(seq)
                continue
            if need > 0 and not self._grow_preempting(seq, n, queue, preempted):
                continue                        # it was preempted itself
            self._count(seq, n)
            scheduled.append(ScheduledSeq(seq, start, n))
            budget -= n
            if left > 1:
                prompt_budget -= n
                chunks -= 1
        # admit waiting sequences only when nothing was preempted (they would thrash); those whose adapter the
        # running sequences' pages displaced wait
        lost = self.allocator.pin_wanted()
        admitted = False
        for seq in [s for s in self.waiting if ok(s) and s.adapter_name not in lost]:
            if (preempted or min(budget, prompt_budget) <= 0 or chunks <= 0
                    or len(scheduled) >= self.config.max_num_seqs):
                break
            # the pages of as much of the prompt as the whole budget takes, although a bound beside decodes
            # computes less of it now: a prompt admitted with pages for one chunk only would preempt itself (the
            # newest sequence) for its next chunk where memory is short, and compute that chunk again
            if not self._admissible(seq, budget):
                self.admissions_blocked += 1
                break
            self._match(seq)
            if self.cache is not None and self.cache.in_flight(seq.blocks):
                self.admissions_deferred += 1   # its prefix is on its way back from host memory: it keeps the
                continue                        # blocks and its place, and the running batch goes on meanwhile
            n = min(seq.num_tokens - seq.num_computed, budget, prompt_budget)
            if not self._grow(seq, n):
                self._release(seq)              # back to a fresh start (matched blocks unpinned)
                seq.num_computed = 0
                self.admissions_blocked += 1
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted = True
            self._count(seq, n)
            scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
            prompt_budget -= n
            chunks -= 1
        if admitted:                            # preemptions keep the order; admissions may break it
            self.running.sort(key=lambda s: s.arrival)
        return SchedulerOutput(tuple(scheduled), tuple(preempted), tuple(truncated))

    def lookahead(self, ending: set[str], max_batch: int) -> list[str] | None:
        """The request ids of the decode to queue behind the one in flight, whose tokens are still on the device
        (each running sequence holds its pending token, counted computed): every running sequence but
        ``ending`` (those their pending token ends), one token each. None where :meth:`schedule` would do
        anything else with them: admit a waiting sequence (the batch has room; with none, it is admitted once a
        sequence ends, one iteration later than without the lookahead), compute more than one token of a
        sequence, need a page that would have to be reclaimed or a sequence preempted for, or outgrow
        ``max_batch`` or the token budget."""
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return None
        if any(seq.num_tokens - seq.num_computed != 1 for seq in self.running):
            return None
        ids = [seq.request_id for seq in self.running if seq.request_id not in ending]
        if not ids or len(ids) > min(max_batch, self.config.max_num_batched_tokens):
            return None
        limit, pages = None, 0
        for seq in self.running:
            if seq.request_id in ending:
                continue
            need = self._blocks_needed(seq, 1)       # its next token starts a page
            if need:
                pages += need
                limit = self.allocator.num_blocks if limit is None else limit
                if len(seq.blocks) + need > limit:
                    return None
        return ids if pages <= self.allocator.num_free else None

    def _grow_preempting(self, seq: Sequence, n: int, queue: deque, preempted: list) -> bool:
        """Pages for ``seq``'s next ``n`` tokens, preempting the newest sequences of ``queue`` (then ``seq``
        itself) until they fit; False when ``seq`` was preempted."""
        while not self._grow(seq, n):
            victim = queue.pop() if queue else seq
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and free its KV blocks (running or waiting)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self._computed_before.pop(seq.request_id, None)
        seq.status = Status.FINISHED
        seq.finish_reason = reason


def _needs_prompt_logits(seq: Sequence) -> bool:
    """Whether ``seq`` still needs the logits of prompt positions (prompt logprobs): its prompt is then computed
    in full, not taken from the prefix cache."""
    return seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt_token_ids)
