"""The engine's memory component: the unified pool, the adapter store, the prefix tree and the swapper.

The step loop talks to it at three points:

    runnable(running, waiting, room, merged)  # schedule: which requests' adapters can be resident now
    prepare(plan, modes)                      # before the run: the plan's adapters pinned, the merged one resident
    after(plan, waiting, idle)                # after the run: swapper monitor, adapter prefetch, drain when idle

Who gives pages to KV when the pool runs short is declared in ``RECLAIM_ORDER``
(per memory policy), not left to the order components were built in.
"""

from __future__ import annotations

from vlora.config import CacheConfig
from vlora.memory.pool import UnifiedPool
from vlora.memory.swapper import CacheSwapper
from vlora.memory.tree import PrefixTree

# Sources of pages for KV, tried in this order when the pool runs short (sources a configuration lacks are
# skipped). A merged copy (cache.merged_copy) goes first: it only saves switch time (its adapter merges in place
# without it), and it was made on an estimate of KV demand that the demand has now passed. Cached KV goes before
# idle adapters: an adapter costs a host copy to bring back, a cached block only a recompute when the same prefix
# comes again. FastLibra's swapper ranks cached KV and adapters together by its cost model, so it comes next and
# the LRU eviction of adapters is only its fallback. Fixed pools never give adapter pages to KV.
RECLAIM_ORDER: dict[str, tuple[str, ...]] = {
    "unified": ("merged_copy", "prefix_cache", "adapters"),
    "fastlibra": ("merged_copy", "swapper", "adapters"),
    "lru-fixed": ("prefix_cache",),
}


class MemoryManager:
    def __init__(self, pool: UnifiedPool, adapters, cache: CacheConfig):
        """``adapters``: the engine's :class:`~vlora.lora.registry.AdapterRegistry`. The adapters' users of
        ``pool`` pages come from it: its store (adapters kept in the pool, when the LoRA kernels run) and the merged
        copies it makes, so memory imports nothing from ``vlora.lora`` (the layering: docs/architecture.md)."""
        self.pool, self.adapters, self.store = pool, adapters, adapters.store
        # merged copies of the merged adapter's weights in pool pages (the mode switcher makes and points at them)
        self.copies = adapters.merged_copies() if cache.merged_copy and pool.adapter_limit is None else None
        self.tree = self.swapper = None
        if cache.prefix_caching:
            self.tree = PrefixTree(pool, cache.block_size)
            if cache.memory_policy == "fastlibra":
                self.swapper = CacheSwapper(pool, self.tree, self.store, adapters.find,
                                            host_kv_bytes=int(cache.host_kv_gb * 2**30))
            if self.store is not None:
                self.store.on_evict.append(self.tree.drop_adapter)   # its cached KV is keyed under it
        self.reclaim_order = RECLAIM_ORDER[cache.memory_policy]
        pool.reclaimers, pool.reclaimable = [], []
        for name in self.reclaim_order:
            source = self._source(name)
            if source is not None:
                pool.reclaimers.append(source[0])
                pool.reclaimable.extend(source[1])

    def _source(self, name: str):
        """(reclaimer, [estimates of what it could free]) of a declared source; None when it is absent."""
        if name == "prefix_cache" and self.tree is not None and self.swapper is None:
            return self.tree.evict, [self.tree.reclaimable]
        if name == "swapper" and self.swapper is not None:
            return self.swapper.reclaim, [lambda: self.swapper.leaving, self.tree.reclaimable]
        if name == "adapters" and self.store is not None:
            return self.store.reclaim, [self.store.reclaimable]
        if name == "merged_copy" and self.copies is not None:
            return self.copies.reclaim, [self.copies.reclaimable]
        return None

    # -- the step loop's three points -------------------------------------------------------------
    def runnable(self, running: list, waiting: list, room: int, merged) -> set[str] | None:
        """Kernel path: bring the adapters of the running requests, then of the first ``room`` waiting ones,
        into the pool (evicting idle ones). Those of running requests stay protected from eviction this
        iteration; those loaded only for waiting requests are pinned once the running sequences have their pages
        (:meth:`UnifiedPool.pin_wanted`), which may displace them. Returns the ids of the requests (running or
        waiting) that can run now; None: every one."""
        store = self.store
        if store is None:
            return None
        run_a = [s.adapter for s in running if s.adapter is not None]
        wait_a = [s.adapter for s in waiting[:room] if s.adapter is not None]
        keep = {a.name for a in run_a} | ({merged.name} if merged is not None else set())
        # waiting requests that hold cached blocks (a prefix being copied back): the KV below their adapter is
        # pinned, and an adapter leaves the pool only with its KV unused
        keep |= {s.adapter.name for s in waiting if s.blocks and s.adapter is not None}
        ok = store.ensure(run_a + wait_a, keep)
        store.protected = keep            # those of waiting requests are pinned after the running ones grew
        self.pool.wanted = ok - keep
        seqs = list(running) + list(waiting)
        if all(s.adapter is None or s.adapter.name in ok for s in seqs):
            return None
        return {s.request_id for s in seqs if s.adapter is None or s.adapter.name in ok}

    def prepare(self, plan, modes) -> None:
        """The plan's adapters stay pinned; mixed mode subtracts the merged adapter through the kernels, so it
        must be in the pool: if it cannot be, unmerge (outputs do not depend on the mode)."""
        store = self.store
        if store is None or modes.merged is None:
            return
        store.protected = store.protected | plan.adapter_names
        if modes.merged.name not in store.ensure([modes.merged], store.protected):
            modes.unmerge()

    def after(self, plan, waiting: list, idle: bool) -> None:
        """The swapper's monitor tick (or, when nothing ran, a wait for the prefix copy everyone waits on);
        queued requests' adapters prefetched while pages are spare; when the engine is idle, every swap-out
        under way lands and gives its page back."""
        if self.swapper is not None:
            if plan.is_empty:
                self.swapper.wait_oldest()
            self.swapper.tick(len(plan.scheduled))
        if self.store is not None:
            self.store.prefetch([s.adapter for s in waiting if s.adapter is not None],
                                keep_free_pages=self.pool.num_pages // 4)
        if self.swapper is not None and idle:
            self.swapper.drain()

    def release_pins(self) -> None:
        """Forget this iteration's adapter pins (after an aborted iteration: its requests are gone)."""
        if self.store is not None:
            self.store.protected = set()
            self.pool.wanted = set()
