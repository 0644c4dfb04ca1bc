"""The cache swapper (FastLibra §5): which cached KV blocks and adapters stay in the GPU pool.

Every node of the dependency tree (an adapter, or a block of KV under one) is
scored by FastLibra's cost model, the expected TTFT saved by keeping it on the
GPU:

* Eq. 3, adapters a batch is expected to need: ``Low = Σ_a 1 - (1 - prob_a)^BS``
  over registered adapters, ``BS`` the mean batch size of the last 5 seconds;
* Eq. 4, reward for holding fewer adapters than that:
  ``LoRA_Eval = max(1, Low / Now)`` (``Now``: adapters resident). We apply it
  to adapter nodes only (for a KV block it would scale every block alike and
  change no order);
* Eq. 5, ``Retain_Eval = cost · prob · (1 - sigmoid(t / τ))``: ``cost`` the
  node's transfer time (bytes / host-link bandwidth), ``prob`` the share of
  requests that used it (``visits / requests`` from the tree), ``t`` the
  seconds since its last use and ``τ`` a decay time (the paper leaves the
  time unit open; τ sets it). For large ``t`` the decay is ``e^(-t/τ)``, so
  ``k`` times the visits is worth ``τ·ln k`` seconds of recency. τ is 1 s
  (``sigmoid`` of the seconds, the formula as printed): with 10 s, the early
  blocks of a finished chat (one visit per turn) outranked for about 20 s the
  newest blocks of chats in their think time (one visit, being new), so the
  busy watermark pushed out the history that the next turn would match
  (``tests/memory/test_swapper.py``);
* Eq. 6, ``Eval = LoRA_Eval · Retain_Eval``.

Every monitor interval (:meth:`CacheSwapper.tick`), pool usage above the high
watermark swaps out GPU leaves (KV blocks none of whose children is on the GPU,
and adapters with no KV on the GPU and no running request) in increasing
``Eval`` until usage is back under it; usage below the low watermark swaps in
host nodes next to the GPU part of the tree (a block whose parent is on the
GPU under a resident adapter, or an adapter that has been used) in decreasing
``Eval`` until it reaches the low watermark. When the pool runs out of pages
between ticks (:meth:`reclaim`, the pool's first reclaimer), the same order
frees them. Swapped-out KV goes to host memory (pinned on CUDA) up to a host
budget; past it the least valuable host leaves are forgotten. Adapters always
stay in the host store, so swapping one out only frees its pages.

Host memory for KV is one buffer of page-sized slots (pinned on CUDA, and
then allocated at start-up: pinning gigabytes stalls for seconds). Swap-outs
run on a copy stream of their own. Those of the busy watermark keep their
page until the copy has landed (:attr:`leaving`), so the iterations never
wait for them: on the compute stream they would queue the iterations behind
them (docs/decisions.md, 'Swap-outs off the compute stream'). Those that make room
now free their page at once, and the current stream waits for the copies
before it writes it. Swap-ins run on a copy stream (:mod:`vlora.memory.copier`) beside the
iterations. Until a block's copy has landed the block is *in flight*: pinned
(no eviction or swap-out may take its page), its host slot held (nothing may
overwrite what the copy reads), and its page reported by :meth:`in_flight`, so
that the scheduler admits a request whose prefix came back only once it has
landed (the request waits, the running batch does not). On the CPU the copies
are made at once.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

import torch

from vlora.memory.copier import StreamCopier, SyncCopier
from vlora.memory.pinned import pinned_empty


def host_slot_buffer(slots: int, page_elems: int, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
    """Host memory for ``slots`` swapped-out KV pages of ``page_elems`` each: page-locked where the pool is on a
    GPU (the copies are asynchronous), plain on the CPU."""
    shape = (slots, page_elems)
    return pinned_empty(shape, dtype) if cuda else torch.empty(shape, dtype=dtype)


class CacheSwapper:
    def __init__(self, pool, tree, store, lookup, *, high: float = 0.95, low: float = 0.70, interval_s: float = 0.1,
                 decay_s: float = 1.0, host_kv_bytes: int = 4 << 30, link_bytes_per_s: float = 25e9,
                 fill_window_s: float = 0.02, clock=time.monotonic, copier=None, out_copier=None):
        if not 0 < low < high <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low < high <= 1, got low={low}, high={high}")
        self.pool, self.tree, self.store, self.lookup = pool, tree, store, lookup   # lookup: name -> adapter | None
        self.high, self.low, self.interval_s, self.decay_s = high, low, interval_s, decay_s
        self.host_kv_bytes, self.link = host_kv_bytes, link_bytes_per_s
        self.clock = tree.time = clock
        tree.swapper = self
        self.page_bytes = pool.page_elems * pool.buf.element_size()
        self.fill_flights = max(1, int(link_bytes_per_s * fill_window_s) // self.page_bytes)   # see _fill
        self.host_nodes: set = set()
        self.host_slots = host_kv_bytes // self.page_bytes
        self._host_buf: torch.Tensor | None = None
        if pool.buf.is_cuda:              # pinning gigabytes takes seconds: at start-up, not mid-serving
            _ = self.host_buf
        self._free_slots: list[int] = list(range(self.host_slots - 1, -1, -1))
        self._batches: deque[tuple[float, int]] = deque()
        self._last_tick = -math.inf
        self.swapped_out = self.swapped_in = self.dropped = 0
        self.batch = max(1, pool.num_pages // 256)     # pages reclaimed at least per ranking
        self.adapters_out = self.adapters_in = 0
        self.copier = copier or (StreamCopier(pool.buf.device) if pool.buf.is_cuda else SyncCopier())
        self.out_copier = out_copier or (StreamCopier(pool.buf.device) if pool.buf.is_cuda else SyncCopier())
        self._leaving: deque = deque()       # (token, page) of swap-outs whose page is freed when they land
        self._out_token: dict = {}           # host node -> its swap-out's token, until it has landed
        self._outs: deque = deque()          # (token, node) of every swap-out not known to have landed, in order
        self._flights: deque = deque()       # (token, node, page, slot) of swap-ins not known to have landed, in order
        self._landing: set[int] = set()           # pages of those swap-ins
        # told of every copy, in issue order: ("out", page, slot) or ("in", page, slot); tensor parallelism's
        # workers make the same copies of their slices of the pages (Executor.mirror_kv_swaps)
        self.mirror: Callable[[str, int, int], None] | None = None

    # -- the cost model -------------------------------------------------------------------------------
    def batch_size(self) -> float:
        now = self.clock()
        while self._batches and self._batches[0][0] < now - 5.0:
            self._batches.popleft()
        return sum(b for _, b in self._batches) / len(self._batches) if self._batches else 1.0

    def _prob(self, node) -> float:
        return node.visits / max(1, self.tree.requests)

    def expected_adapters(self) -> float:
        """Eq. 3 over the adapters the tree has seen."""
        bs = self.batch_size()
        return sum(1 - (1 - self._prob(n)) ** bs for n in self.tree.root.children.values() if n.key is not None)

    def eval(self, node, now: float | None = None, lora_eval: float | None = None) -> float:
        """Eq. 6 for a tree node (an adapter node when ``node.parent`` is the root)."""
        now = self.clock() if now is None else now
        decay = 1.0 - 1.0 / (1.0 + math.exp(-max(0.0, now - node.used_at) / self.decay_s))
        retain = self._bytes(node) / self.link * self._prob(node) * decay
        if node.parent is self.tree.root:
            return (self._lora_eval() if lora_eval is None else lora_eval) * retain
        return retain

    def _bytes(self, node) -> int:
        if node.parent is not self.tree.root:
            return self.page_bytes
        adapter = self.lookup(node.key) if node.key is not None and self.store is not None else None
        return 0 if adapter is None else self.store.pages_needed(adapter) * self.page_bytes

    def _resident(self, name) -> bool:
        return name is None or self.store is None or name in self.store.resident

    def _lora_eval(self) -> float:
        if self.store is None:
            return 1.0
        return max(1.0, self.expected_adapters() / max(1, len(self.store.resident)))

    # -- candidates -----------------------------------------------------------------------------------
    def _out_candidates(self) -> list:
        """GPU leaves: unpinned KV blocks with no GPU child, and resident adapters no running request uses with
        no KV on the GPU; ``(eval, kind, node-or-name)`` in increasing ``Eval``."""
        now = self.clock()
        lora = self._lora_eval()
        out = [(self.eval(n, now), 0, n) for n in self.tree.gpu_leaves() if n.refs == 0]
        for name in self.store.resident if self.store is not None else ():
            cand = self._adapter_candidate(name, now, lora)
            if cand is not None:
                out.append(cand)
        out.sort(key=lambda c: c[0])
        return out

    def _adapter_candidate(self, name, now: float, lora: float):
        """``(eval, 1, name)`` when resident adapter ``name`` may leave: no running request uses it and none of
        its KV is on the GPU (GPU blocks hang from the adapter node, so its children tell)."""
        if name not in self.store.resident or name in self.store.protected or name in self.store.keep:
            return None
        node = self.tree.root.children.get(name)
        if node is not None and self.tree.has_gpu_child(node):
            return None
        return (self.eval(node, now, lora) if node is not None else 0.0, 1, name)

    def _in_candidates(self) -> list:
        """Host blocks whose parent is on the GPU under a resident adapter (or the base model), and used adapters
        not resident; in decreasing ``Eval``."""
        now = self.clock()
        lora = self._lora_eval()
        out = [(self.eval(n, now), 0, n) for n in self.host_nodes if self._parent_on_gpu(n)]
        for node in self.tree.root.children.values():
            if not self._resident(node.key) and node.visits:
                out.append((self.eval(node, now, lora), 1, node.key))
        out.sort(key=lambda c: -c[0])
        return out

    def _parent_on_gpu(self, node) -> bool:
        p = node.parent
        return p.page is not None or (p.parent is self.tree.root and self._resident(p.key))

    # -- moves ----------------------------------------------------------------------------------------
    @property
    def host_buf(self) -> torch.Tensor:
        if self._host_buf is None:
            self._host_buf = host_slot_buffer(self.host_slots, self.pool.page_elems, self.pool.buf.dtype,
                                              self.pool.buf.is_cuda)
        return self._host_buf

    def _slot(self, protect, worth: float | None = None) -> int | None:
        """A free host slot, forgetting the least valuable host leaves for it if there is none. ``worth``: the
        ``Eval`` of the block that wants the slot; only host leaves worth no more are forgotten (None: any)."""
        if not self._free_slots:
            self.poll()                 # slots of swap-ins that have landed come back
        if not self._free_slots:        # forget a batch at once: ranking every host block per slot cost O(n²)
            now = self.clock()
            leaves = [(self.eval(n, now), n) for n in self.host_nodes
                      if not n.children and n.refs == 0 and n is not protect]
            for value, victim in heapq.nsmallest(max(1, self.host_slots // 64), leaves, key=lambda v: v[0]):
                if worth is not None and value > worth:
                    break
                del victim.parent.children[victim.key]
                self.forget(victim)
                self.dropped += 1
            if not self._free_slots:
                return None
        return self._free_slots.pop()

    def _swap_out_block(self, node, defer: bool = False) -> None:
        """Move a GPU leaf block to host memory, or forget it when host memory is full of more valuable blocks.
        A block with no children is weighed alone: copying it out only to displace a block worth more would
        spend the link for less (docs/decisions.md, 'A childless block weighed before its swap-out'). A block
        with host blocks below it takes a slot whatever it is worth (forgetting it would forget them too)."""
        worth = None if node.children else self.eval(node)
        slot = self._slot(node, worth) if self.host_slots else None
        if slot is None:
            self.tree._remove(node)
            self.dropped += 1
            return
        token = self.out_copier.copy(self.host_buf[slot], self.pool.kv[node.page].view(-1))
        if self.mirror is not None:
            self.mirror("out", node.page, slot)
        self.tree.lost_page(node)
        if token is None:
            self.pool.free([node.page])
        else:
            self._out_token[node] = token
            self._outs.append((token, node))
            if defer:                     # the page is free once the copy has landed (poll)
                self._leaving.append((token, node.page))
            else:                         # free now; the caller's barrier queues its next writer after the copy
                self.pool.free([node.page])
        node.page, node.host = None, slot
        self.host_nodes.add(node)
        self.swapped_out += 1

    def swap_in(self, node, room_made: bool = False) -> bool:
        """Bring a host block back into a page (its parent is on the GPU); False when no page can be had.
        ``room_made``: the caller already asked the pool for room; take a free page or give up."""
        if node.host is None or not (self.pool.num_free >= 1 if room_made else self.pool.make_room(1)):
            return False
        if node.host is None:             # making room swapped out a block and forgot this one for its slot
            return False
        page = self.pool.allocate(1)[0]
        token = self.copier.copy(self.pool.kv[page].view(-1), self.host_buf[node.host],
                                 after=self._out_token.pop(node, None))
        if self.mirror is not None:
            self.mirror("in", page, node.host)
        node.page = page
        self.tree.gained_page(node)
        if token is None:
            self.forget(node)
        else:                             # in flight: pinned, its slot held until the copy has landed
            self.host_nodes.discard(node)
            self._flights.append((token, node, page, node.host))
            self._landing.add(page)
            node.host = None
            self.tree._pin(node, 1)
        self.swapped_in += 1
        return True

    def poll(self) -> int:
        """Retire the copies that have landed (in issue order: one stream per direction): the pages of
        swap-outs go back to the pool. Returns how many swap-ins are still in flight."""
        while self._leaving and self.out_copier.done(self._leaving[0][0]):
            self.pool.free([self._leaving.popleft()[1]])
        while self._outs and self.out_copier.done(self._outs[0][0]):
            token, node = self._outs.popleft()
            if self._out_token.get(node) is token:     # (not swapped in or forgotten since)
                del self._out_token[node]
        while self._flights and self.copier.done(self._flights[0][0]):
            _, node, page, slot = self._flights.popleft()
            self._landing.discard(page)
            self._free_slots.append(slot)
            self.tree._pin(node, -1)
        return len(self._flights)

    def in_flight(self, pages) -> bool:
        """Whether any of ``pages`` is still being filled by a swap-in."""
        return bool(self._landing) and self.poll() > 0 and any(p in self._landing for p in pages)

    def wait_oldest(self) -> None:
        """Block until the oldest swap-in in flight has landed (the engine has nothing else to run)."""
        if self._flights:
            self.copier.wait(self._flights[0][0])
            self.poll()

    def settle(self) -> None:
        """Block until every swap-in has landed (before the tree drops or forgets nodes wholesale). Swap-outs
        under way are left alone: their blocks are host blocks already, and their pages are in no tree."""
        while self._flights:
            self.wait_oldest()

    def drain(self) -> None:
        """Block until every copy has landed and every page on its way out is back in the pool (the engine is
        idle, or the tree is cleared)."""
        self.settle()
        while self._outs:
            self.out_copier.wait(self._outs[-1][0])
            self.poll()
        self._take_leaving()

    def _take_leaving(self) -> None:
        """Free the pages of the swap-outs under way now; the current stream waits for their copies."""
        if self._leaving:
            self.out_copier.barrier()
            self.pool.free([page for _, page in self._leaving])
            self._leaving.clear()

    @property
    def leaving(self) -> int:
        """KV pages whose swap-out is under way: neither in the tree nor free until it lands."""
        return len(self._leaving)

    def swap_out_subtree(self, adapter_node) -> None:
        """The adapter leaves the pool: its GPU blocks go to host memory, leaves first (kept for its return)."""
        order = [n for n in self.tree._nodes(adapter_node) if n.page is not None]
        for n in reversed(order):                     # children after parents in _nodes: reversed is leaves-first
            if n.page is not None:
                self._swap_out_block(n)
        self.out_copier.barrier()                     # the freed pages are written only after their copies

    def forget(self, node) -> None:
        """The node's host copy is no longer needed (back on the GPU, or forgotten): free its slot."""
        if node in self.host_nodes:     # a swap-out still under way into the slot is fine: the slot's next
            self.host_nodes.discard(node)     # writer is a later swap-out on the same stream, its next reader a
            self._free_slots.append(node.host)   # swap-in after that one
            self._out_token.pop(node, None)
            node.host = None

    def reclaim(self, pages: int, defer: bool = False) -> int:
        """Free ``pages`` pages by swapping out the least valuable GPU leaves (the pool's first reclaimer). At
        least ``batch`` pages go at once. One ranking serves the whole call (ranking walked the tree once per
        level of every chain, most of the CPU time of a busy engine): a block whose last GPU child leaves joins
        the candidates then, and so does an adapter whose last GPU block leaves.

        ``defer`` (the monitor's busy watermark): blocks leave on the swap-out stream and their pages come back
        when the copies land, so the iterations meanwhile do not wait for them. Otherwise (the pool needs the
        pages now) the swap-outs already under way give their pages first, then blocks leave with their pages
        freed at once, and the current stream waits for the copies before it writes them."""
        gone = lambda: self.pool.num_free + len(self._leaving)     # noqa: E731 (freed, or freed on landing)
        taken = 0
        if not defer:                     # the pages on their way out come first
            before = self.pool.num_free
            self.poll()
            self._take_leaving()
            taken = self.pool.num_free - before
            if taken >= pages:
                return taken
        start = gone()
        pages = max(pages - taken, self.batch)
        now, lora = self.clock(), self._lora_eval()
        order = itertools.count()
        heap = [(e, next(order), kind, what) for e, kind, what in self._out_candidates()]
        heapq.heapify(heap)
        while heap and gone() - start < pages:
            _, _, kind, what = heapq.heappop(heap)
            parent = what.parent if kind == 0 else None
            free = gone()
            self._move_out(kind, what, defer)
            if parent is None or gone() == free:           # an adapter, or a block that could not go
                continue
            if parent.parent is self.tree.root:            # the adapter's last GPU block went: it may go too
                cand = self._adapter_candidate(parent.key, now, lora) if self.store is not None else None
                if cand is not None:
                    heapq.heappush(heap, (cand[0], next(order), 1, parent.key))
            elif parent.page is not None and parent.refs == 0 and not self.tree.has_gpu_child(parent):
                heapq.heappush(heap, (self.eval(parent, now), next(order), 0, parent))   # a new leaf
        if not defer:                     # one barrier for the pages freed at once (nothing wrote them meanwhile)
            self.out_copier.barrier()
        return taken + gone() - start

    def _move_out(self, kind: int, what, defer: bool = False) -> None:
        if kind == 0:
            if what.page is not None and not any(c.page is not None for c in what.children.values()):
                self._swap_out_block(what, defer)
        elif what in self.store.resident and what not in self.store.protected and what not in self.store.keep:
            self.store.evict(what)                     # its (empty) GPU subtree: nothing to move
            self.adapters_out += 1

    # -- the monitor ----------------------------------------------------------------------------------
    def usage(self) -> float:
        """Share of the pool in use, pages on their way out counted free, and so are a merged copy's (it gives
        its pages first when KV needs them: cached KV should not leave to make room for it)."""
        return 1.0 - (self.pool.num_free + self.pool.num_reserved_pages + len(self._leaving)) / self.pool.num_pages

    def tick(self, batch_size: int) -> None:
        """Called every engine step: record the batch size; every ``interval_s`` balance the pool."""
        now = self.clock()
        self._batches.append((now, batch_size))
        self.poll()
        if now - self._last_tick < self.interval_s:
            return
        self._last_tick = now
        if self.usage() > self.high:
            self.reclaim(math.ceil((self.usage() - self.high) * self.pool.num_pages), defer=True)
        elif self.usage() < self.low:
            self._fill()

    def _fill(self) -> None:
        """Swap in by decreasing ``Eval`` while usage is under the low watermark (a block brought back makes
        its children candidates: candidates are re-ranked until none fits). Blocks go on the copy stream only
        while the copies in flight would take the link less than ``fill_window_s``: a request's own swap-in
        queues behind them on that stream, so an idle fill of the whole gap (a large share of the pool, which
        takes the host link many iterations' time to copy) would hold up every prefix asked for meanwhile. The
        rest waits for later ticks."""
        moved, capped = True, False
        while moved and self.usage() < self.low:
            moved = False
            for _, kind, what in self._in_candidates():
                if self.usage() >= self.low:
                    return
                if kind == 0:
                    if capped or what in self._out_token:     # (a block stays out until its copy out lands)
                        continue
                    if len(self._flights) >= self.fill_flights and self.poll() >= self.fill_flights:
                        capped = True             # adapters load on their own stream: they still may
                        continue
                    if what.host is not None and self._parent_on_gpu(what) and self._spare(1):
                        moved |= self.swap_in(what)
                else:
                    adapter = self.lookup(what)
                    if adapter is not None and self._spare(self.store.pages_needed(adapter)) \
                            and self.store.load(adapter):
                        self.adapters_in += 1
                        moved = True

    def _spare(self, pages: int) -> bool:
        """Whether ``pages`` more pages are free and keep usage under the high watermark (idle swap-ins never
        evict anything, nor make the pool busy)."""
        return pages <= self.pool.num_free and self.pool.num_free - pages >= (1 - self.high) * self.pool.num_pages

    def stats(self) -> dict:
        return {"swapped_out": self.swapped_out, "swapped_in": self.swapped_in, "in_flight": len(self._flights),
                "leaving": len(self._leaving),
                "host_blocks": len(self.host_nodes),
                "host_dropped": self.dropped, "adapters_out": self.adapters_out, "adapters_in": self.adapters_in}
