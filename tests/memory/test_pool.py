"""The unified pool: page bookkeeping under random interleavings (hypothesis), adapters loaded on demand and
evicted under pressure with unchanged outputs."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models.test_parity import NAMES, PROMPTS, build
from vlora import LLM, SamplingParams
from vlora.memory.kv_cache import OutOfBlocks
from vlora.memory.pool import UnifiedPool

OPS = st.lists(st.tuples(st.sampled_from(["kv", "free_kv", "adapter", "release", "reclaim"]),
                         st.integers(1, 6), st.integers(0, 10**6)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_pages_never_overlap_or_leak(ops):
    pool = UnifiedPool(24, 1, 2, 1, 8, torch.float32, torch.device("cpu"))     # pages of 32 elements
    owned: dict[str, list[int]] = {}
    kv: list[list[int]] = []
    marks: dict[str, tuple[int, int, float]] = {}
    for i, (op, n, pick) in enumerate(ops):
        if op == "kv":
            try:
                kv.append(pool.allocate(n))
            except OutOfBlocks:
                assert n > pool.num_free
        elif op == "free_kv" and kv:
            pool.free(kv.pop(pick % len(kv)))
        elif op == "adapter":
            name, sizes = f"a{i}", [n * 7, 40, 5]
            try:
                offs = pool.place_adapter(name, sizes)
            except OutOfBlocks:
                continue
            owned[name] = pool.adapter_pages[name]
            pages = owned[name]
            assert pages == list(range(pages[0], pages[0] + len(pages)))          # one contiguous run
            for off, size in zip(offs, sizes):                                    # matrices inside the run
                assert pages[0] * pool.page_elems <= off and off + size <= (pages[-1] + 1) * pool.page_elems
                pool.buf[off:off + size] = float(i)
            marks[name] = (offs[0], sizes[0], float(i))
        elif op == "release" and owned:
            name = sorted(owned)[pick % len(owned)]
            pool.release_adapter(name)
            del owned[name], marks[name]
        elif op == "reclaim" and owned:
            name = sorted(owned)[0]
            pool.reclaimers = [lambda pages, name=name: (pool.release_adapter(name), owned.pop(name),
                                                         marks.pop(name))]
            pool.reclaimable = [lambda name=name: len(pool.adapter_pages[name])]
            pool.make_room(pool.num_free + 1)
            pool.reclaimers, pool.reclaimable = [], []
        pool.check()
        kv_pages = [p for b in kv for p in b]
        assert not set(kv_pages) & {p for ps in owned.values() for p in ps}
        for off, size, v in marks.values():                  # nobody else wrote into an adapter's pages
            assert torch.all(pool.buf[off:off + size] == v)
    for b in kv:
        pool.free(b)
    for name in list(owned):
        pool.release_adapter(name)
    pool.check()
    assert pool.num_free == pool.num_pages


def test_make_room_frees_nothing_when_it_cannot_free_enough():
    """A caller that gives up when the pages cannot be had (an admission that waits, a running request about to
    preempt another) must not have emptied the cache on the way; ``partial`` callers take what there is."""
    pool = UnifiedPool(10, 1, 2, 1, 8, torch.float32, torch.device("cpu"))
    cached = pool.allocate(4)                          # idle pages a reclaimer could free
    running = pool.allocate(4)
    pool.reclaimers = [lambda n: pool.free([cached.pop() for _ in range(min(n, len(cached)))])]
    pool.reclaimable = [lambda: len(cached)]
    assert pool.available() == 6
    assert not pool.make_room(7) and len(cached) == 4 and pool.num_free == 2
    assert pool.make_room(3) and len(cached) == 3 and pool.num_free == 3        # only what is missing
    assert not pool.make_room(7, partial=True) and not cached and pool.num_free == 6
    pool.free(running)
    pool.check()


def test_adapters_swap_in_and_out_with_unchanged_tokens(tmp_path):
    """A pool with room for about one adapter serving requests of three: adapters are evicted and brought back
    mid-run, and every request's tokens equal those of the torch path (adapters never leave host memory)."""
    path, paths, _ = build(tmp_path)
    prompts = [PROMPTS[i % 4] + [i + 30] * (i % 3) for i in range(9)]
    names = [NAMES[1 + i % 3] for i in range(9)]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=64, block_size=4)
            .generate(prompts, names, sp)]
    llm = LLM(str(path), adapters=paths, num_blocks=24, block_size=4, lora_kernel="triton", max_loras=1, max_lora_rank=16,
              max_num_seqs=2)
    store = llm.engine.adapters.store
    got = []
    for p, a in zip(prompts, names):                         # one after another: each needs its adapter back
        got.append(llm.generate([p], [a], sp)[0].token_ids)
    assert got == want
    assert store.num_evictions > 0 and store.num_loads > 3   # evicted and reloaded
    batched = [o.token_ids for o in llm.generate(prompts, names, sp)]   # competing for pages in one run
    assert batched == want
    llm.engine.pool.check()
    assert llm.engine.pool.kv_pages == 0
    llm.unregister_adapter("a4")                             # its pages, if resident, come back
    assert "a4" not in llm.engine.pool.adapter_pages
    llm.engine.pool.check()


def test_a_sequence_larger_than_kv_can_get_finishes_instead_of_hanging(tmp_path):
    """Pages pinned by its own adapter are not KV's: a sequence that can never fit is finished ("length") and
    reported, also when the mode policy's first schedule came back empty."""
    path, paths, _ = build(tmp_path)
    for policy in ("unmerged", "merged-only"):
        llm = LLM(str(path), adapters=paths, num_blocks=4, block_size=4, lora_kernel="triton", max_loras=1,
                  max_lora_rank=16, policy=policy)
        eng = llm.engine
        rid = eng.add_request([5, 6, 7], "a16", SamplingParams(max_tokens=200, ignore_eos=True))
        final = None
        for _ in range(300):
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    final = o
            if not eng.has_unfinished():
                break
        assert final is not None and final.finish_reason == "length", policy
        assert not eng.has_unfinished() and eng.pool.kv_pages == 0
        eng.pool.check()
