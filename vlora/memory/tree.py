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
requests are pinned (reference counts); unpinned leaves are evicted least
recently used first when the pool needs pages, and an adapter's whole subtree
is dropped when the adapter leaves the pool (KV is only kept below a resident
adapter).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: object                       # adapter name under the root, else a tuple of block_size token ids
    parent: "Node | None"
    page: int | None = None           # the KV page (None: the root and adapter nodes)
    refs: int = 0                     # running requests using this block
    last_use: int = 0
    children: dict = field(default_factory=dict)


class PrefixTree:
    def __init__(self, pool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.root = Node("root", None)
        self._clock = itertools.count(1)
        self.num_pages = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

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
        node = self._adapter(adapter, create=False)
        pages: list[int] = []
        now = next(self._clock)
        for i in range((len(tokens) - 1) // bs):
            if node is None:
                break
            node = node.children.get(tuple(tokens[i * bs:(i + 1) * bs]))
            if node is None:
                break
            node.refs += 1
            node.last_use = now
            pages.append(node.page)
        self.hit_tokens += len(pages) * bs
        return pages

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
                child.refs -= 1
            elif child is None:
                child = node.children[key] = Node(key, node, pages[i])
                self.num_pages += 1
            else:
                drop.append(pages[i])             # computed twice (another request cached it meanwhile)
            child.last_use = now
            node = child
        drop.extend(pages[full:])
        if drop:
            self.pool.free(drop)

    def evict(self, pages: int) -> int:
        """Free up to ``pages`` pages from unpinned leaves, least recently used first; returns pages freed."""
        freed = 0
        while freed < pages:
            leaves = [n for n in self._nodes() if n.page is not None and not n.children and n.refs == 0]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.last_use):
                if freed >= pages:
                    break
                self._remove(leaf)
                freed += 1
        return freed

    def drop_adapter(self, adapter: str | None) -> None:
        """Forget everything cached under ``adapter`` (it left the pool); none of it may be in use."""
        node = self.root.children.pop(adapter, None)
        if node is None:
            return
        pages = [n.page for n in self._nodes(node) if n.page is not None]
        assert all(n.refs == 0 for n in self._nodes(node)), "cached KV of an adapter in use"
        self.num_pages -= len(pages)
        if pages:
            self.pool.free(pages)

    def clear(self) -> None:
        for name in list(self.root.children):
            self.drop_adapter(name)

    def _remove(self, leaf: Node) -> None:
        del leaf.parent.children[leaf.key]
        self.num_pages -= 1
        self.pool.free([leaf.page])

    def _nodes(self, start: Node | None = None):
        stack = [start or self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def pages(self) -> list[int]:
        return [n.page for n in self._nodes() if n.page is not None]
