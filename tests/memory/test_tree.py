"""Prefix caching in the dependency tree: same tokens with and without it, reuse only under the same adapter,
pages never leak or overlap under random workloads, cached KV dropped with its adapter."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models.test_parity import NAMES, build
from vlora import LLM, SamplingParams


def chats(seed=0, n=6):
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(13)]          # a shared "system prompt"
    return [system + [rng.randrange(3, 250) for _ in range(rng.randint(1, 9))] for _ in range(n)]


def test_multi_turn_reuse_gives_the_same_tokens(tmp_path):
    path, paths, _ = build(tmp_path)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = LLM(str(path), adapters=paths, num_blocks=128, block_size=4)
    cached = LLM(str(path), adapters=paths, num_blocks=128, block_size=4, prefix_caching=True)
    tree = cached.engine.prefix_cache
    histories = {a: chats(seed=i, n=1)[0] for i, a in enumerate(NAMES)}
    for turn in range(3):                                         # each turn: the whole history + new tokens
        prompts = [histories[a] for a in NAMES]
        want = [o.token_ids for o in plain.generate(prompts, NAMES, sp)]
        got = [o.token_ids for o in cached.generate(prompts, NAMES, sp)]
        assert got == want
        for a, p, out in zip(NAMES, prompts, got):
            histories[a] = p + out + [7 + turn, 11]
    assert tree.hit_tokens > 0
    cached.engine.pool.check()
    tree.clear()
    assert cached.engine.pool.num_free == cached.engine.pool.num_pages


def test_prefix_is_never_shared_across_adapters(tmp_path):
    path, paths, _ = build(tmp_path)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    llm = LLM(str(path), adapters=paths, num_blocks=128, block_size=4, prefix_caching=True)
    tree = llm.engine.prefix_cache
    prompt = chats()[0]
    llm.generate([prompt], ["a4"], sp)
    before = tree.hit_tokens
    llm.generate([prompt], ["a8"], sp)                            # same tokens, other adapter: no hit
    assert tree.hit_tokens == before
    llm.generate([prompt], [None], sp)                            # nor for the base model
    assert tree.hit_tokens == before
    llm.generate([prompt], ["a4"], sp)                            # the same adapter: hit
    assert tree.hit_tokens > before
    llm.unregister_adapter("a4")                                  # its cached KV goes with it
    assert "a4" not in tree.root.children
    llm.engine.pool.check()


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 6)), min_size=1, max_size=10),
       st.integers(10, 40))
def test_random_workloads_keep_pages_consistent(tmp_path_factory, jobs, num_blocks):
    """Shared prefixes, several adapters, a small pool (preemption, cache eviction): tokens equal to an
    engine without caching; afterwards every page is free once the cache is cleared."""
    path, paths, _ = _built(tmp_path_factory)
    base = chats(seed=1, n=4)
    prompts = [base[i][:8 + 3 * j] for i, j, _ in jobs]
    names = [NAMES[(i + j) % 4] for i, j, _ in jobs]
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for _, _, m in jobs]
    want = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=256, block_size=4)
            .generate(prompts, names, sps)]
    llm = LLM(str(path), adapters=paths, num_blocks=num_blocks, block_size=4, prefix_caching=True,
              max_num_batched_tokens=16, max_num_seqs=4)
    got = [o.token_ids for o in llm.generate(prompts, names, sps)]
    again = [o.token_ids for o in llm.generate(prompts, names, sps)]     # now from the cache where it is
    assert got == want and again == want
    pool, tree = llm.engine.pool, llm.engine.prefix_cache
    pool.check()
    tree.check()
    assert pool.kv_pages == tree.num_pages == len(tree.pages()) == len(set(tree.pages()))
    tree.clear()
    assert pool.num_free == pool.num_pages


_BUILT = {}


def _built(factory):
    if "x" not in _BUILT:
        _BUILT["x"] = build(factory.mktemp("model"))
    return _BUILT["x"]


def test_cached_kv_only_below_resident_adapters(tmp_path):
    """Kernel path with room for about one adapter: adapters come and go, and the tree never keeps KV in the
    pool under an adapter that left it (the swapper moves that KV to host memory and brings it back); tokens
    stay those of the plain engine."""
    path, paths, _ = build(tmp_path)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [p for p in chats(seed=3, n=6)]
    names = [NAMES[1 + i % 3] for i in range(6)]
    want = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=128, block_size=4)
            .generate(prompts + prompts, names + names, sp)]
    llm = LLM(str(path), adapters=paths, num_blocks=12, block_size=4, lora_kernel="triton", max_loras=1,
              max_lora_rank=16, prefix_caching=True, memory_policy="fastlibra")
    store, tree = llm.engine.adapters.store, llm.engine.prefix_cache
    got, seen_gone = [], 0
    for p, a in zip(prompts + prompts, names + names):
        got.append(llm.generate([p], [a], sp)[0].token_ids)
        gone = [node for name, node in tree.root.children.items() if name is not None and name not in store.resident]
        assert all(n.page is None for node in gone for n in tree._nodes(node) if n is not node)
        seen_gone += sum(1 for node in gone for n in tree._nodes(node) if n.host is not None)
    assert seen_gone > 0                                          # KV kept in host memory under a gone adapter
    assert got == want and store.num_evictions > 0
    assert llm.engine.swapper.swapped_out > 0 and llm.engine.swapper.swapped_in > 0     # out and back
    llm.engine.pool.check()


def test_a_request_that_cannot_be_admitted_leaves_the_cache_alone(tmp_path):
    """A fresh request whose first chunk does not fit while another holds the pool waits without evicting the
    cached history of a chat (it could not have run after evicting it either) and without being looked up again
    every iteration it waits; it runs once the pool has room, with the tokens of an engine without caching."""
    path, _, _ = build(tmp_path)
    chat, long, fresh = list(range(3, 23)), list(range(100, 132)), list(range(150, 190))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    sp_long = SamplingParams(max_tokens=8, ignore_eos=True)
    want = LLM(str(path), num_blocks=128, block_size=4).generate([fresh], None, sp)[0].token_ids
    llm = LLM(str(path), num_blocks=16, block_size=4, prefix_caching=True)
    eng, tree = llm.engine, llm.engine.prefix_cache
    llm.generate([chat], None, sp)                               # 5 blocks of history cached
    eng.add_request(long, None, sp_long, request_id="long")      # 32 + 8 tokens: 8 to 10 of 16 pages
    eng.step()
    eng.add_request(fresh, None, sp, request_id="fresh")         # 10 pages: more than free + cached
    lookups, outs, waited = tree.lookup_tokens, {}, 0
    while "long" not in outs:
        for o in eng.step():
            outs[o.request_id] = o
        if any(s.request_id == "fresh" for s in eng.scheduler.waiting):
            waited += 1
            assert tree.num_pages == 5, "cached history evicted for a request that could not run"
            assert tree.lookup_tokens == lookups
    assert waited > 0 and eng.scheduler.admissions_blocked >= waited
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs["fresh"].token_ids == want
    eng.pool.check()


def test_preemptions_and_recomputed_tokens_are_counted(tmp_path):
    """The scheduler's counters (the memory benchmark reports them): every prompt position computed once
    without preemption; with it, the positions computed again are counted as recomputed."""
    path, _, _ = build(tmp_path)
    prompts = [list(range(3 + i, 23 + i)) for i in range(6)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    roomy = LLM(str(path), num_blocks=256, block_size=4)
    want = [o.token_ids for o in roomy.generate(prompts, None, sp)]
    c = roomy.engine.scheduler.counters()
    assert c["preemptions"] == c["recomputed_tokens"] == 0
    assert c["prompt_tokens_computed"] == sum(map(len, prompts))
    assert c["computed_tokens"] == sum(len(p) + 12 - 1 for p in prompts)   # the last token is never fed back
    tight = LLM(str(path), num_blocks=14, block_size=4, max_num_batched_tokens=8, max_num_seqs=6)
    assert [o.token_ids for o in tight.generate(prompts, None, sp)] == want
    c = tight.engine.scheduler.counters()
    assert c["preemptions"] > 0 and c["recomputed_tokens"] > 0
    assert c["computed_tokens"] == sum(len(p) + 12 - 1 for p in prompts) + c["recomputed_tokens"]
    assert c["prompt_tokens_computed"] >= sum(map(len, prompts))
