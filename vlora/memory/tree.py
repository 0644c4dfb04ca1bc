"""Dependency tree of cached KV (FastLibra §4): adapters under the root, token-block prefixes under them.

The root's children are adapters (``None``: the base model); every deeper node
is one full KV block (``block_size`` token ids) whose KV was computed under that
adapter, child of the block before it. A new request walks its adapter's
subtree along its own tokens and reuses the pages of the longest cached prefix
of full blocks (at least one token is always left to compute, so there are
logits to sample from). KV computed under one adapter is never found from
another. A finished or preempted request gives its full blocks to the tree
(a block the tree already holds is freed instead), so the next turn of a chat
or the next request with the same system prompt skips them.

Pages held by the tree count as KV pages of the pool. Nodes used by running
requests are pinned (reference counts). Without a swapper, unpinned leaves are
evicted least recently used first when the pool needs pages, and an adapter's
whole subtree is dropped when the adapter leaves the pool (KV is only kept
below a resident adapter). With a swapper (:mod:`vlora.memory.swapper`) a node
may instead sit in host memory (``host``): a GPU node's parent is always on the
GPU (or is a resident adapter), so nodes leave the GPU from the leaves and come
back from the root side; :meth:`match` brings host blocks on its path back.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: object                       # adapter name under the root, else a tuple of block_size token ids
    parent: "Node | None"
    page: int | None = None           # the KV page (None: the root and adapter nodes)
    refs: int = 0                     # running requests using this block
    last_use: int = 0                 # logical clock (LRU order)
    children: dict = field(default_factory=dict)
    host: object = None               # the block's KV in host memory while it is swapped out (page is None)
    visits: int = 0                   # requests that used this node (the swapper's frequency)
    used_at: float = 0.0              # wall clock of the last use (the swapper's recency)
    gpu_children: int = 0             # children on the GPU (a GPU node with none is a leaf that may leave)


class PrefixTree:
    def __init__(self, pool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.root = Node("root", None)
        self._clock = itertools.count(1)
        self._order = itertools.count()   # heap tie-breaks
        self.num_pages = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.requests = 0                 # matches made (the denominator of the visit frequencies)
        self.swapper = None               # set by a CacheSwapper: host blocks on a path come back through it
        self.time = time.monotonic
        self._leaves: dict[Node, None] = {}   # GPU nodes with no GPU child, kept as pages come and go (an
        #                                       ordered set: ranking them walked the whole GPU tree each time)
        self._unpinned = 0                    # GPU nodes no running request uses (reclaimable, per admission)

    def gained_page(self, node: Node) -> None:
        """``node`` has just been given a page (cached, or brought back from host memory)."""
        self.num_pages += 1
        node.parent.gpu_children += 1
        self._leaves.pop(node.parent, None)
        if node.gpu_children == 0:
            self._leaves[node] = None
        self._unpinned += node.refs == 0

    def lost_page(self, node: Node) -> None:
        """``node``'s page is about to go (freed, or swapped out); ``node.parent`` is still set."""
        self.num_pages -= 1
        self._leaves.pop(node, None)
        self._unpinned -= node.refs == 0
        parent = node.parent
        parent.gpu_children -= 1
        if parent.gpu_children == 0 and parent.page is not None:
            self._leaves[parent] = None

    def _adapter(self, name: str | None, create: bool) -> Node | None:
        node = self.root.children.get(name)
        if node is None and create:
            node = self.root.children[name] = Node(name, self.root)
        return node

    def match(self, adapter: str | None, tokens: list[int]) -> list[int]:
        """Pages of the longest cached prefix of full blocks of ``tokens`` (leaving one token uncomputed),
        pinned for the caller until it :meth:`release` s them."""
        bs = self.block_size
        self.lookup_tokens += len(tokens)
        self.requests += 1
        node = self._adapter(adapter, create=self.swapper is not None)   # the swapper counts adapter visits
        wall = self.time()
        if node is not None:
            node.visits += 1
            node.used_at = wall
        path = []
        for i in range((len(tokens) - 1) // bs):
            if node is None:
                break
            node = node.children.get(tuple(tokens[i * bs:(i + 1) * bs]))
            if node is None:
                break
            path.append(node)
        now = next(self._clock)
        for n in path:                    # pinned first: room made for the host part cannot take them
            self._pin(n, 1)
        on_host = sum(n.page is None for n in path)
        if on_host:                       # one request for room; as many as fit come back, the rest is recomputed
            self.pool.make_room(on_host, partial=True)
        pages: list[int] = []
        for k, n in enumerate(path):
            if n.page is None and not self.swapper.swap_in(n, room_made=True):   # no page for it: stop here
                for rest in path[k:]:
                    self._pin(rest, -1)
                break
            n.last_use = now
            n.visits += 1
            n.used_at = wall
            pages.append(n.page)
        self.hit_tokens += len(pages) * bs
        return pages

    def in_flight(self, pages: list[int]) -> bool:
        """Whether any of ``pages`` (from :meth:`match`) is still being copied back from host memory: the
        request that holds them must not run yet."""
        return self.swapper is not None and self.swapper.in_flight(pages)

    def peek(self, adapter: str | None, tokens: list[int]) -> tuple[int, int, int]:
        """What :meth:`match` would find, with no side effect: blocks of the path on the GPU and unpinned, on the
        GPU and pinned, and in host memory."""
        bs = self.block_size
        node = self.root.children.get(adapter)
        free = pinned = host = 0
        for i in range((len(tokens) - 1) // bs):
            node = None if node is None else node.children.get(tuple(tokens[i * bs:(i + 1) * bs]))
            if node is None:
                break
            if node.page is None:
                host += 1
            elif node.refs:
                pinned += 1
            else:
                free += 1
        return free, pinned, host

    def reclaimable(self) -> int:
        """GPU pages of unpinned blocks: what eviction (or a swapper) could free, leaves first."""
        return self._unpinned

    def _pin(self, node: Node, delta: int) -> None:
        if node.page is not None and (node.refs == 0 or node.refs + delta == 0):
            self._unpinned -= delta
        node.refs += delta

    def release(self, adapter: str | None, tokens: list[int], pages: list[int], num_matched: int) -> None:
        """A request is done with ``pages`` (its block table; the KV of ``tokens`` is in them): unpin its first
        ``num_matched`` (they came from :meth:`match`), give its other full blocks to the tree, free the rest."""
        bs = self.block_size
        node = self._adapter(adapter, create=True)
        now = next(self._clock)
        full = min(len(tokens) // bs, len(pages))
        drop: list[int] = []
        for i in range(full):
            key = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(key)
            if i < num_matched:
                self._pin(child, -1)
            elif child is None:
                child = node.children[key] = Node(key, node, pages[i], visits=1, used_at=self.time())
                self.gained_page(child)
            elif child.page is None:               # swapped out meanwhile: take this copy, free the host one
                self.swapper.forget(child)
                child.page = pages[i]
                self.gained_page(child)
            else:
                drop.append(pages[i])             # computed twice (another request cached it meanwhile)
            child.last_use = now
            node = child
        drop.extend(pages[full:])
        if drop:
            self.pool.free(drop)

    def evict(self, pages: int) -> int:
        """Free up to ``pages`` pages from unpinned leaves, least recently used first; returns pages freed."""
        heap = [(n.last_use, next(self._order), n) for n in self.gpu_leaves() if n.refs == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < pages:       # one ranking: a parent joins the heap when its last GPU child goes
            leaf = heapq.heappop(heap)[2]
            parent = leaf.parent
            self._remove(leaf)
            freed += 1
            if parent.page is not None and parent.refs == 0 and not self.has_gpu_child(parent):
                heapq.heappush(heap, (parent.last_use, next(self._order), parent))
        return freed

    @staticmethod
    def has_gpu_child(node: Node) -> bool:
        return node.gpu_children > 0

    def gpu_nodes(self, start: Node | None = None):
        """KV nodes on the GPU under ``start`` (default: everywhere). The walk stops at host blocks: everything
        below one is in host memory too, and a large tree is mostly host blocks."""
        stack = [start or self.root]
        while stack:
            n = stack.pop()
            if n.page is not None:
                yield n
            if n.page is not None or n.parent is None or n.parent is self.root:
                stack.extend(n.children.values())

    def gpu_leaves(self) -> list[Node]:
        """KV nodes on the GPU none of whose children is (they may leave the GPU without breaking a path)."""
        return list(self._leaves)

    def drop_adapter(self, adapter: str | None) -> None:
        """``adapter`` left the pool: its cached KV goes to host memory (with a swapper) or is forgotten; none
        of it may be in use."""
        node = self.root.children.get(adapter)
        if node is None:
            return
        if self.swapper is not None:
            self.swapper.settle()             # swap-ins in flight hold their blocks pinned until they land
        assert all(n.refs == 0 for n in self._nodes(node)), "cached KV of an adapter in use"
        if self.swapper is not None:
            self.swapper.swap_out_subtree(node)
        else:
            self.forget_adapter(adapter)

    def clear(self) -> None:
        """Forget every cached block, on the GPU and in host memory."""
        for name in list(self.root.children):
            self.forget_adapter(name)
        if self.swapper is not None:
            self.swapper.drain()              # pages of swap-outs under way come back too

    def forget_adapter(self, adapter: str | None) -> None:
        """Forget every block cached under ``adapter``, on the GPU and in host memory (it is unregistered)."""
        if self.swapper is not None and adapter in self.root.children:
            self.swapper.settle()             # swap-ins in flight hold their blocks pinned until they land
        node = self.root.children.pop(adapter, None)
        if node is not None:
            assert all(n.refs == 0 for n in self._nodes(node)), "cached KV in use"
            pages = [n.page for n in self._nodes(node) if n.page is not None]
            for n in self._nodes(node):
                self._leaves.pop(n, None)
            self._unpinned -= len(pages)
            self.num_pages -= len(pages)
            if pages:
                self.pool.free(pages)
            if self.swapper is not None:
                for n in self._nodes(node):
                    self.swapper.forget(n)

    def _remove(self, leaf: Node) -> None:
        """Forget a KV leaf (its children, if any, are host blocks: forgotten with it)."""
        if leaf.page is not None:
            self.lost_page(leaf)
            self.pool.free([leaf.page])
        del leaf.parent.children[leaf.key]
        if self.swapper is not None:
            for n in self._nodes(leaf):
                self.swapper.forget(n)

    def _nodes(self, start: Node | None = None):
        stack = [start or self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def check(self) -> None:
        """Assert the incremental bookkeeping matches a walk: GPU-children counts and the set of GPU leaves."""
        for n in self._nodes():
            assert n.gpu_children == sum(c.page is not None for c in n.children.values()), "GPU-children count"
        walked = {n for n in self.gpu_nodes() if not any(c.page is not None for c in n.children.values())}
        assert walked == set(self._leaves), "GPU leaves"
        assert self._unpinned == sum(1 for n in self.gpu_nodes() if n.refs == 0), "unpinned GPU blocks"

    def pages(self) -> list[int]:
        return [n.page for n in self._nodes() if n.page is not None]
