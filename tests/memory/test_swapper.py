"""The cache swapper (FastLibra cost model, watermarks, host tier) and the fixed-pool baseline: the cost model's
orderings, KV content intact through swaps under random interleavings (hypothesis), engine outputs unchanged,
1,000 adapters registered with the host memory they take reported."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models.test_parity import NAMES, build
from tests.memory.test_tree import chats
from vlora import LLM, SamplingParams
from vlora.config import CacheConfig, ConfigError
from vlora.memory.copier import StreamCopier
from vlora.memory.pool import UnifiedPool
from vlora.memory.swapper import CacheSwapper
from vlora.memory.tree import PrefixTree

BS = 2                                                    # tokens per block in the data-structure tests


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class DeferredCopier:
    """A copy stream in slow motion: a copy is made only when it lands (:meth:`land`, or ``wait``), reading its
    source then, so a host slot or page reused before its copy landed shows up as wrong KV. Copies land in issue
    order. A copy ``after`` another copier's token makes that one land first (a stream waits for an event);
    ``barrier`` lands everything (the current stream waits for this one)."""

    class Token:
        def __init__(self, owner, dst, src):
            self.owner, self.dst, self.src, self.landed = owner, dst, src, False

    def __init__(self):
        self.pending: list = []

    def copy(self, dst, src, after=None):
        if after is not None and after.owner is not self:
            after.owner.wait(after)
        self.pending.append(self.Token(self, dst, src))
        return self.pending[-1]

    def barrier(self) -> None:
        self.land()

    def done(self, token) -> bool:
        return token.landed

    def land(self, n: int | None = None) -> None:
        for tok in self.pending[:n]:
            tok.dst.copy_(tok.src)
            tok.landed = True
        self.pending = self.pending[len(self.pending) if n is None else n:]

    def wait(self, token) -> None:
        if not token.landed:
            self.land(self.pending.index(token) + 1)


def _setup(pages=16, host_blocks=6, copier=None, **kw):
    pool = UnifiedPool(pages, 1, BS, 1, 4, torch.float32, torch.device("cpu"))     # pages of 16 elements
    tree = PrefixTree(pool, BS)
    clock = Clock()
    swapper = CacheSwapper(pool, tree, None, lambda name: None, clock=clock,
                           host_kv_bytes=host_blocks * pool.page_elems * 4, copier=copier, **kw)
    pool.reclaimers.insert(0, swapper.reclaim)
    pool.reclaimable.insert(0, tree.reclaimable)             # as the engine has it (make_room counts on it)
    pool.reclaimable.insert(0, lambda: swapper.leaving)
    return pool, tree, swapper, clock


def _value(adapter, tokens) -> float:
    return float(zlib.crc32(repr((adapter, tuple(tokens))).encode()) % 10007)


def _serve(pool, tree, adapter, tokens, wait: bool = True) -> bool:
    """One request: match, check the matched KV is this adapter's for these tokens, compute the rest (write
    its blocks' values), give it back. False when the pool had no room. A prefix still being copied back is
    waited for, or (``wait=False``) given back unread: the request went away while it waited."""
    unpinned, pinned, host = tree.peek(adapter, tokens)
    pages = tree.match(adapter, tokens)
    assert unpinned + pinned <= len(pages) <= unpinned + pinned + host    # GPU blocks lead the path; host ones
    while tree.in_flight(pages):
        if not wait:
            tree.release(adapter, tokens[:len(pages) * BS], pages, len(pages))
            return False
        tree.swapper.wait_oldest()
    for i, p in enumerate(pages):                                          # come back as far as pages allow
        assert torch.all(pool.kv[p] == _value(adapter, tokens[:(i + 1) * BS])), "wrong KV served"
    need = -(-len(tokens) // BS) - len(pages)
    if not pool.make_room(need):
        tree.release(adapter, tokens[:len(pages) * BS], pages, len(pages))
        return False
    new = pool.allocate(need)
    for i, p in enumerate(new, start=len(pages)):
        pool.kv[p].fill_(_value(adapter, tokens[:(i + 1) * BS]))
    tree.release(adapter, tokens, pages + new, len(pages))
    return True


def _invariants(pool, tree, swapper):
    pool.check()
    tree.check()
    assert pool.kv_pages == tree.num_pages + swapper.leaving == len(tree.pages()) + swapper.leaving
    for n in tree._nodes():
        if n.parent is None or n.parent is tree.root:
            continue
        assert (n.page is None) != (n.host is None), "a block is on exactly one side"
        if n.page is not None and n.parent.parent is not tree.root:
            assert n.parent.page is not None, "a GPU block under a host block"
    assert swapper.host_nodes == {n for n in tree._nodes() if n.host is not None}
    assert set(swapper._out_token) <= swapper.host_nodes, "a swap-out token outlived its host copy"
    assert len(swapper.host_nodes) * swapper.page_bytes <= swapper.host_kv_bytes
    flying = [slot for _, _, _, slot in swapper._flights]
    held = [n.host for n in swapper.host_nodes] + flying + swapper._free_slots
    assert sorted(held) == list(range(swapper.host_slots)), "a host slot lost, or held twice"
    for _, node, page, _ in swapper._flights:
        assert node.page == page and node.refs > 0, "a block in flight must stay pinned on its page"


PROMPTS_ = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9, 9, 9, 9], [1, 2, 8, 8, 8], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]
OPS = st.lists(st.tuples(st.sampled_from(["req", "req", "req", "tick", "pressure", "evict_all"]),
                         st.integers(0, 3), st.sampled_from([None, "x", "y"]), st.floats(0, 3)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(OPS, st.integers(6, 16), st.integers(0, 8))
def test_random_interleavings_keep_kv_intact_and_never_leak(ops, pages, host_blocks):
    pool, tree, swapper, clock = _setup(pages, host_blocks, high=0.8, low=0.4, interval_s=0.5)
    for op, k, adapter, dt in ops:
        clock.t += dt
        if op == "req":
            _serve(pool, tree, adapter, PROMPTS_[k] + [k] * (k % 2))
        elif op == "tick":
            swapper.tick(batch_size=k + 1)
        elif op == "pressure":
            pool.make_room(k + 1)
        else:
            swapper.reclaim(pool.num_pages)
        _invariants(pool, tree, swapper)
    tree.clear()
    assert pool.num_free == pool.num_pages and not swapper.host_nodes


ASYNC_OPS = st.lists(st.tuples(st.sampled_from(["req", "req", "leave", "tick", "tick", "pressure", "evict_all",
                                                "out_later", "land", "land_out", "forget"]),
                               st.integers(0, 3), st.sampled_from([None, "x", "y"]), st.floats(0, 3)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(ASYNC_OPS, st.integers(6, 16), st.integers(0, 8))
def test_swap_ins_in_flight_keep_kv_intact_and_never_leak(ops, pages, host_blocks):
    """Swap-ins and swap-outs that land late (two copy streams): requests that wait for them, or leave before
    they land, pressure and reclaims meanwhile, adapters forgotten; what a request reads is always its KV, no
    host slot or page is reused before its copy landed, and nothing leaks."""
    copier, out = DeferredCopier(), DeferredCopier()
    pool, tree, swapper, clock = _setup(pages, host_blocks, copier=copier, out_copier=out, high=0.8, low=0.4,
                                        interval_s=0.5)
    for op, k, adapter, dt in ops:
        clock.t += dt
        if op in ("req", "leave"):
            _serve(pool, tree, adapter, PROMPTS_[k] + [k] * (k % 2), wait=op == "req")
        elif op == "tick":
            swapper.tick(batch_size=k + 1)
        elif op == "pressure":
            pool.make_room(k + 1)
        elif op == "land":
            copier.land(k)
        elif op == "land_out":
            out.land(k)
        elif op == "out_later":                              # the busy watermark's way: pages free on landing
            swapper.reclaim(k + 1, defer=True)
        elif op == "forget":
            tree.forget_adapter(adapter)
        else:
            swapper.reclaim(pool.num_pages)
        _invariants(pool, tree, swapper)
    tree.clear()
    assert pool.num_free == pool.num_pages and not swapper.host_nodes and not swapper._flights
    assert sorted(swapper._free_slots) == list(range(swapper.host_slots))


def test_a_block_in_flight_is_neither_read_nor_evicted_before_it_lands():
    copier = DeferredCopier()
    pool, tree, swapper, _ = _setup(pages=8, host_blocks=8, copier=copier)
    prompt = PROMPTS_[3]
    assert _serve(pool, tree, "x", prompt)                   # 5 full blocks cached
    swapper.reclaim(pool.num_pages)
    pages = tree.match("x", prompt)                          # all 5 come back on the copy stream
    assert len(pages) == 5 and tree.in_flight(pages) and swapper.stats()["in_flight"] == 5
    tree.release("x", prompt[:5 * BS], pages, 5)             # the request left; the copies still fly
    assert swapper.reclaim(pool.num_pages) == 0 and tree.evict(8) == 0    # pinned while in flight
    copier.land(2)
    assert swapper.poll() == 3 and tree.in_flight(pages) and not tree.in_flight(pages[:2])
    copier.land()
    assert not tree.in_flight(pages)
    for i, p in enumerate(pages):
        assert torch.all(pool.kv[p] == _value("x", prompt[:(i + 1) * BS]))
    assert swapper.reclaim(pool.num_pages) == 5              # landed: unpinned, may leave again
    _invariants(pool, tree, swapper)


def test_a_block_on_its_way_out_keeps_its_page_and_comes_back_intact():
    """The busy watermark's swap-outs go on their own stream: the page stays taken until the copy has landed,
    and a request that wants the block back meanwhile reads it only after the copy out."""
    copier, out = DeferredCopier(), DeferredCopier()
    pool, tree, swapper, clock = _setup(pages=18, host_blocks=12, copier=copier, out_copier=out)
    prompt = PROMPTS_[3]
    assert _serve(pool, tree, "x", prompt)                   # 5 full blocks cached (6 pages used, 1 freed)
    leaving = list(tree.pages())
    assert swapper.reclaim(5, defer=True) == 5 and swapper.leaving == 5 and tree.num_pages == 0
    assert swapper.usage() == 0 and pool.num_free == 13      # counted free for the watermarks, not yet given
    clock.t += 1
    swapper.tick(1)                                          # idle, but blocks on their way out stay out
    assert swapper.swapped_in == 0
    assert _serve(pool, tree, "y", [7] * 13)                 # 7 pages: free ones, none of those leaving
    assert not set(leaving) & set(tree.pages())
    _invariants(pool, tree, swapper)
    pages = tree.match("x", prompt)                          # back into free pages before the copies out land
    assert len(pages) == 5
    while tree.in_flight(pages):
        swapper.wait_oldest()
    for i, p in enumerate(pages):
        assert torch.all(pool.kv[p] == _value("x", prompt[:(i + 1) * BS]))
    tree.release("x", prompt[:len(pages) * BS], pages, len(pages))
    out.land()
    swapper.poll()
    assert swapper.leaving == 0
    _invariants(pool, tree, swapper)
    tree.clear()
    assert pool.num_free == pool.num_pages


def test_the_pool_takes_the_pages_on_their_way_out_when_it_needs_them():
    copier, out = DeferredCopier(), DeferredCopier()
    pool, tree, swapper, _ = _setup(pages=8, host_blocks=8, copier=copier, out_copier=out)
    prompt = PROMPTS_[3]
    assert _serve(pool, tree, "x", prompt)
    swapper.reclaim(5, defer=True)
    assert pool.num_free == 3 and pool.available() >= 3
    assert _serve(pool, tree, "y", [6] * 13)                 # 7 pages: 3 free, 4 taken from those leaving
    assert swapper.leaving == 0 and not out.pending           # taken after their copies (the barrier)
    assert _serve(pool, tree, "x", prompt)                   # the host copies are intact
    _invariants(pool, tree, swapper)


def test_room_made_now_takes_the_pages_on_their_way_out_before_moving_more():
    copier, out = DeferredCopier(), DeferredCopier()
    pool, tree, swapper, _ = _setup(pages=12, host_blocks=12, copier=copier, out_copier=out)
    assert _serve(pool, tree, "x", PROMPTS_[3])
    swapper.reclaim(3, defer=True)                           # 2 of the 5 blocks stay on the GPU
    assert pool.make_room(pool.num_free + 3) and pool.num_free == 10
    assert swapper.swapped_out == 3 and swapper.leaving == 0 and tree.num_pages == 2   # none more went out
    assert _serve(pool, tree, "x", PROMPTS_[3])
    _invariants(pool, tree, swapper)


def test_drain_lands_every_copy_and_returns_the_pages():
    copier, out = DeferredCopier(), DeferredCopier()
    pool, tree, swapper, _ = _setup(pages=12, host_blocks=12, copier=copier, out_copier=out)
    assert _serve(pool, tree, "x", PROMPTS_[3])
    swapper.reclaim(3, defer=True)
    assert swapper.leaving == 3
    swapper.drain()
    assert swapper.leaving == 0 and not out.pending and pool.num_free == 12 - tree.num_pages
    assert _serve(pool, tree, "x", PROMPTS_[3])                 # the host copies are intact
    _invariants(pool, tree, swapper)


def test_swapped_out_kv_comes_back_intact():
    pool, tree, swapper, _ = _setup(pages=8, host_blocks=8)
    prompt = PROMPTS_[3]
    assert _serve(pool, tree, "x", prompt)                   # 11 tokens: 5 full blocks cached
    assert swapper.reclaim(pool.num_pages) == 5 and pool.num_free == pool.num_pages
    assert swapper.swapped_out == 5 and len(swapper.host_nodes) == 5
    assert _serve(pool, tree, "x", prompt)                   # matched from host: contents checked in _serve
    assert swapper.swapped_in == 5 and tree.hit_tokens == 5 * BS
    _invariants(pool, tree, swapper)


def test_host_budget_forgets_the_least_valuable_leaves():
    pool, tree, swapper, clock = _setup(pages=8, host_blocks=2)
    _serve(pool, tree, "x", PROMPTS_[0])                     # 7 tokens: 3 full blocks cached
    swapper.reclaim(pool.num_pages)
    assert len(swapper.host_nodes) == 2 and swapper.dropped == 1
    depth = {n: len(list(_ancestors(n))) for n in swapper.host_nodes}
    assert sorted(depth.values()) == [1, 2]                  # the path's root side is kept, leaves went first


def test_a_block_worth_less_than_the_host_blocks_is_forgotten_not_copied_out():
    pool, tree, swapper, clock = _setup(pages=8, host_blocks=2)
    for _ in range(3):
        _serve(pool, tree, "x", [1, 2, 3, 4, 5])             # 2 blocks, 3 visits each
    swapper.reclaim(pool.num_pages)
    assert len(swapper.host_nodes) == 2 and swapper.swapped_out == 2
    _serve(pool, tree, "y", [7, 7, 7])                        # 1 block, 1 visit: worth less
    swapper.reclaim(pool.num_pages)
    assert swapper.swapped_out == 2 and swapper.dropped == 1 and "y" not in {
        n.parent.key for n in swapper.host_nodes}
    clock.t += 30                                             # x's blocks go cold; a fresh block is worth more
    _serve(pool, tree, "y", [8, 8, 8])
    swapper.reclaim(pool.num_pages)
    assert swapper.swapped_out == 3 and any(n.parent.key == "y" for n in swapper.host_nodes)
    _invariants(pool, tree, swapper)


def _ancestors(n):
    while n.parent is not None and n.parent.parent is not None:
        n = n.parent
        yield n


def test_cost_model_orders_by_frequency_recency_and_size():
    pool, tree, swapper, clock = _setup(pages=32)
    for _ in range(3):
        _serve(pool, tree, "x", [1, 2, 3])                   # x's block: 3 visits
    _serve(pool, tree, "y", [7, 7, 7])                       # y's block: 1 visit
    bx = tree.root.children["x"].children[(1, 2)]
    by = tree.root.children["y"].children[(7, 7)]
    assert swapper.eval(bx) > swapper.eval(by)               # frequency
    clock.t += 50.0
    _serve(pool, tree, "y", [7, 7, 7])
    _serve(pool, tree, "y", [7, 7, 7])
    _serve(pool, tree, "y", [7, 7, 7])                       # y: 4 visits, recent; x: 3 visits, 50 s ago
    assert swapper.eval(by) > swapper.eval(bx)               # recency
    decay = 1 - 1 / (1 + math.exp(-50.0 / swapper.decay_s))
    want = swapper.page_bytes / swapper.link * bx.visits / tree.requests * decay
    assert swapper.eval(bx) == pytest.approx(want)           # Eq. 5
    assert swapper._out_candidates()[0][2] is bx             # swapped out first


def test_finished_chat_goes_before_the_newest_blocks_of_a_chat_between_turns():
    """Recency first: a chat whose four turns ended 6 s ago (its early blocks visited four times) leaves the GPU
    before the blocks a chat in its think time wrote 1.5 s ago (visited once, being new), which its next turn
    will match. With a 10 s decay time the four visits outweighed 5 s of age, and the busy watermark pushed out
    the live chat's history, to copy it back a moment later."""
    pool, tree, swapper, clock = _setup(pages=32, host_blocks=32)
    done = [1, 2, 3, 4, 5]
    for turn in range(4):                                    # one turn a second, each on the whole history
        assert _serve(pool, tree, "x", done)
        done = done + [10 + turn, 20 + turn]
        clock.t += 1.0
    clock.t += 4.5
    live = [7, 7, 8, 8, 9, 9, 6]
    assert _serve(pool, tree, "x", live)                     # 3 new blocks, a turn that just ended
    clock.t += 1.5
    live_nodes = [n for n in tree._nodes(tree.root.children["x"]) if n.key[:1] in ((7,), (8,), (9,))]
    assert len(live_nodes) == 3
    done_pages = tree.num_pages - len(live_nodes)
    assert swapper.reclaim(done_pages) == done_pages
    assert all(n.page is not None for n in live_nodes), "the live chat's history went to host memory"
    _invariants(pool, tree, swapper)


def test_expected_adapters_eq3():
    pool, tree, swapper, clock = _setup()
    for name, times in (("x", 3), ("y", 1)):
        for _ in range(times):
            _serve(pool, tree, name, [1, 2, 3])
    swapper.tick(batch_size=4)
    bs = swapper.batch_size()
    assert bs == 4
    want = (1 - (1 - 3 / 4) ** 4) + (1 - (1 - 1 / 4) ** 4)
    assert swapper.expected_adapters() == pytest.approx(want)


def test_watermarks_swap_out_when_busy_and_in_when_idle():
    pool, tree, swapper, clock = _setup(pages=10, host_blocks=10, high=0.75, low=0.45, interval_s=0.1)
    _serve(pool, tree, "x", PROMPTS_[3])                     # 5 of 10 pages: between the watermarks
    _serve(pool, tree, "y", [4] * 9)                         # 9 of 10: busy
    clock.t += 1
    swapper.tick(1)
    assert swapper.usage() <= 0.75 and swapper.swapped_out >= 2
    swapper.reclaim(pool.num_pages)                          # everything to the host: idle
    clock.t += 1
    swapper.tick(1)
    assert swapper.usage() >= 0.45 and swapper.swapped_in > 0
    _invariants(pool, tree, swapper)


def test_idle_swap_ins_keep_the_copy_stream_short():
    """An idle fill puts at most ``fill_window_s`` of link time on the copy stream; the rest waits for later
    ticks, so a request's own swap-in never queues behind the whole gap."""
    copier = DeferredCopier()
    pool, tree, swapper, clock = _setup(pages=10, host_blocks=10, high=0.95, low=0.9, copier=copier,
                                        link_bytes_per_s=2 * 64 / 0.02)     # 2 pages of 64 bytes per window
    assert swapper.fill_flights == 2
    _serve(pool, tree, "x", PROMPTS_[3])                     # 5 blocks
    swapper.reclaim(pool.num_pages)                          # all on the host; the adapter (base) stays
    clock.t += 1
    swapper.tick(1)
    assert swapper.stats()["in_flight"] == 2 and swapper.swapped_in == 2
    clock.t += 1
    swapper.tick(1)                                          # nothing landed: nothing more issued
    assert swapper.swapped_in == 2
    copier.land()
    clock.t += 1
    swapper.tick(1)
    assert swapper.swapped_in == 4
    copier.land()
    clock.t += 1
    swapper.tick(1)
    copier.land()
    swapper.poll()
    assert swapper.swapped_in == 5 and not swapper.host_nodes
    pages = tree.match("x", PROMPTS_[3])
    for i, p in enumerate(pages):
        assert torch.all(pool.kv[p] == _value("x", PROMPTS_[3][:(i + 1) * BS]))
    tree.release("x", PROMPTS_[3][:len(pages) * BS], pages, len(pages))
    _invariants(pool, tree, swapper)


def test_bad_watermarks_and_policy_are_refused():
    pool = UnifiedPool(4, 1, BS, 1, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="watermarks"):
        CacheSwapper(pool, PrefixTree(pool, BS), None, lambda n: None, high=0.5, low=0.7)
    with pytest.raises(ConfigError, match="memory_policy"):
        CacheConfig(memory_policy="fifo")
    with pytest.raises(ValueError, match="adapter_limit"):
        UnifiedPool(4, 1, BS, 1, 4, torch.float32, torch.device("cpu"), adapter_limit=9)


# -- the engine ---------------------------------------------------------------------------------------------

def test_engine_outputs_unchanged_through_swaps_and_fixed_pools(tmp_path):
    """Kernel path, room for about one adapter and little KV: the swapper moves cached KV and adapters out and
    back; plain LRU discards; the fixed-pool baseline keeps its pools apart; all give the plain engine's
    tokens."""
    path, paths, _ = build(tmp_path)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    base = chats(seed=5, n=4)
    prompts = [base[i % 4] + [9 + i] * (i % 3) for i in range(8)]
    names = [NAMES[1 + i % 3] for i in range(8)]
    want = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=128, block_size=4)
            .generate(prompts, names, sp)]
    for policy in ("fastlibra", "unified", "lru-fixed"):
        llm = LLM(str(path), adapters=paths, num_blocks=14, block_size=4, lora_kernel="triton", max_loras=1,
                  max_lora_rank=16, prefix_caching=True, memory_policy=policy, adapter_pool_fraction=0.7)
        got = [llm.generate([p], [a], sp)[0].token_ids for p, a in zip(prompts, names)]
        assert got == want, policy
        eng = llm.engine
        eng.pool.check()
        if policy == "fastlibra":      # KV of evicted adapters kept in host memory, and reused
            assert eng.swapper.swapped_out > 0 and eng.prefix_cache.hit_tokens > 0
        else:
            assert eng.swapper is None
        if policy == "lru-fixed":
            assert eng.pool.num_adapter_pages <= eng.pool.adapter_limit
        eng.prefix_cache.clear()
        for name in list(eng.adapters.store.resident):
            eng.adapters.store.evict(name)
        assert eng.pool.num_free == eng.pool.num_blocks


def test_adapter_larger_than_its_pool_is_refused(tmp_path):
    from vlora.lora.adapter import AdapterError

    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), num_blocks=14, block_size=4, lora_kernel="triton", max_loras=0, max_lora_rank=16,
              memory_policy="lru-fixed", adapter_pool_fraction=0.2)
    with pytest.raises(AdapterError, match="could never be loaded"):
        llm.register_adapter("a16", paths["a16"])
    assert "a16" not in llm.engine.adapters and "a16" not in llm.engine.adapters.store._host


def test_thousand_adapters_registered_host_memory_reported(tmp_path, capsys):
    """1,000 adapters in host memory on a tiny model; requests for a few of them run."""
    from vlora.lora.adapter import ModelShape
    from vlora.lora.random_adapter import write_random_adapter

    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), num_blocks=64, block_size=4, lora_kernel="triton", max_loras=2, max_lora_rank=8)
    eng = llm.engine
    shape = ModelShape(eng.adapters.shape.name, eng.adapters.shape.num_layers, eng.adapters.shape.in_features,
                       eng.adapters.shape.out_features)
    src = write_random_adapter(tmp_path / "src", shape, rank=4, seed=0)
    for i in range(1000):
        llm.register_adapter(f"t{i}", src)
    host = eng.adapters.store.host_bytes()
    one = sum(t.numel() * t.element_size() for t in _tensors(eng.adapters.get("t0")))
    assert host == 1000 * one
    with capsys.disabled():
        print(f"\n1000 adapters (rank 4) registered: {host / 2**20:.1f} MiB of host memory")
    assert len(eng.adapters) == 1000 and host > 0
    out = llm.generate([[5, 6, 7]] * 3, ["t0", "t500", "t999"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [2, 2, 2]
    assert len(eng.adapters.store.resident) <= 3 and eng.adapters.store.num_loads >= 3


def _tensors(adapter):
    for groups in adapter.layers:
        for gw in groups.values():
            yield gw.a
            for sl in gw.slices:
                yield sl.b


def test_a_request_that_cannot_be_admitted_leaves_its_host_prefix_in_host_memory(tmp_path):
    """A follow-up turn whose history is in host memory waits while a long request holds the pool: its blocks
    are not copied back (and given straight back) every iteration it waits, only once it fits; tokens as
    without caching."""
    path, _, _ = build(tmp_path)
    first = list(range(3, 23))                                   # 20 tokens: 5 blocks of 4
    turn2, long = first + [40, 41, 42], list(range(100, 140))
    sp_short, sp_long = SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True)
    want = LLM(str(path), num_blocks=128, block_size=4).generate([turn2, long], None, sp_short)[0].token_ids
    llm = LLM(str(path), num_blocks=16, block_size=4, prefix_caching=True, memory_policy="fastlibra")
    eng = llm.engine
    llm.generate([first], None, sp_short)                        # its KV cached ...
    eng.swapper.reclaim(eng.pool.num_pages)                      # ... and moved to host memory
    assert len(eng.swapper.host_nodes) == 5 and eng.prefix_cache.num_pages == 0
    eng.add_request(long, None, sp_long, request_id="long")      # 40 + 12 tokens: 13 of 16 pages
    eng.step()
    eng.add_request(turn2, None, sp_short, request_id="turn2")   # needs 5 host blocks + 1 new page: does not fit
    outs = {}
    while eng.has_unfinished():
        waiting = any(s.request_id == "turn2" for s in eng.scheduler.waiting)
        before = eng.swapper.swapped_in
        for o in eng.step():
            outs[o.request_id] = o
        if waiting and "long" not in outs:
            assert eng.swapper.swapped_in == before, "host blocks copied in for a request that could not run"
    assert outs["turn2"].token_ids == want
    assert eng.swapper.swapped_in == 5 and eng.prefix_cache.hit_tokens >= 20
    eng.pool.check()


def test_a_prefix_copied_back_holds_up_its_request_and_nobody_else(tmp_path):
    """A follow-up turn whose history is in host memory: its blocks come back on a copy stream (here one that
    lands only when told), the request waits for them while a running request keeps decoding, then runs from
    the cached prefix; tokens as without caching."""
    path, _, _ = build(tmp_path)
    first = list(range(3, 23))                                   # 20 tokens: 5 blocks of 4
    turn2, other = first + [40, 41, 42], list(range(100, 110))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), num_blocks=128, block_size=4).generate([turn2, other], None, sp)]
    llm = LLM(str(path), num_blocks=32, block_size=4, prefix_caching=True, memory_policy="fastlibra")
    eng = llm.engine
    copier = eng.swapper.copier = DeferredCopier()
    llm.generate([first], None, SamplingParams(max_tokens=1, ignore_eos=True))
    eng.swapper.reclaim(eng.pool.num_pages)                      # its KV moved to host memory
    assert len(eng.swapper.host_nodes) == 5
    eng.add_request(other, None, sp, request_id="other")
    eng.step()                                                   # "other" runs its prompt
    eng.add_request(turn2, None, sp, request_id="turn2")
    outs, steps_waiting = {}, 0
    while eng.has_unfinished():
        if any(s.request_id == "turn2" for s in eng.scheduler.waiting) and steps_waiting < 3:
            steps_waiting += 1                                   # the copies stay in flight for three steps
        elif copier.pending:
            copier.land()
        before = len(eng._seqs["other"].output_token_ids) if "other" in eng._seqs else None
        for o in eng.step():
            outs[o.request_id] = o
        if steps_waiting < 3:
            assert all(s.request_id != "turn2" for s in eng.scheduler.running), "ran before its prefix landed"
            assert len(eng._seqs["other"].output_token_ids) == before + 1, "the running request was held up"
    assert steps_waiting == 3 and eng.scheduler.admissions_deferred >= 3
    assert [outs["turn2"].token_ids, outs["other"].token_ids] == want
    assert eng.swapper.swapped_in == 5 and eng.prefix_cache.hit_tokens >= 20
    assert eng.scheduler.counters()["prompt_tokens_computed"] == len(first) + 3 + len(other)   # turn2: 3 new
    eng.prefix_cache.clear()
    eng.pool.check()
    assert eng.pool.num_free == eng.pool.num_pages


def test_engine_tokens_unchanged_with_copies_both_ways_landing_late(tmp_path):
    """Chats on a small pool with the busy watermark always on: swap-outs keep their pages until they land,
    swap-ins wait for them, and both kinds land a few at a time, steps later. Tokens are as without caching,
    some pages were on their way out while others ran, and the pool is whole at the end."""
    path, _, _ = build(tmp_path)
    firsts = [list(range(3 + 30 * i, 23 + 30 * i)) for i in range(3)]
    prompts = firsts + [f + [40, 41, 42] for f in firsts]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), num_blocks=128, block_size=4).generate(prompts, None, sp)]
    llm = LLM(str(path), num_blocks=32, block_size=4, prefix_caching=True, memory_policy="fastlibra")
    eng = llm.engine
    sw = eng.swapper
    sw.copier, sw.out_copier = DeferredCopier(), DeferredCopier()
    sw.interval_s, sw.high, sw.low = 0.0, 0.3, 0.1      # every step is busy: blocks leave on the swap-out stream
    rng = torch.Generator().manual_seed(0)
    outs, saw_leaving = {}, 0
    for turn in (prompts[:3], prompts[3:]):
        if turn[0] is prompts[3]:                            # the histories leave as the busy watermark sends them
            sw.reclaim(eng.pool.num_pages, defer=True)
        for p in turn:
            eng.add_request(p, None, sp, request_id=str(prompts.index(p)))
        while eng.has_unfinished():
            for c in (sw.copier, sw.out_copier):
                c.land(int(torch.randint(0, 3, (1,), generator=rng)))
            saw_leaving = max(saw_leaving, sw.leaving)
            for o in eng.step():
                outs[o.request_id] = o
    assert [outs[str(i)].token_ids for i in range(6)] == want
    assert saw_leaving > 0 and sw.swapped_out > 0 and sw.swapped_in > 0
    assert sw.leaving == 0                                   # the idle engine took their pages back
    eng.prefix_cache.clear()
    eng.pool.check()
    assert eng.pool.num_free == eng.pool.num_pages


@pytest.mark.gpu
def test_gpu_swap_ins_on_the_copy_stream_keep_kv_intact():
    """The CUDA pool and its copy streams: reclaims now and on landing, matches that bring prefixes back while
    the current stream is busy (and their swap-outs may still be under way), requests that leave before their
    copies land; every block read after it landed is its KV."""
    dev = torch.device("cuda")
    pool = UnifiedPool(64, 1, BS, 1, 1 << 16, torch.float32, dev)          # pages of 256 KiB: copies take time
    tree = PrefixTree(pool, BS)
    swapper = CacheSwapper(pool, tree, None, lambda name: None, host_kv_bytes=48 * pool.page_elems * 4)
    pool.reclaimers.insert(0, swapper.reclaim)
    pool.reclaimable.insert(0, tree.reclaimable)
    pool.reclaimable.insert(0, lambda: swapper.leaving)
    busy = torch.randn(4096, 4096, device=dev)
    prompts = [[k] * (2 * BS * (k + 2)) + [99] for k in range(6)]
    left = 0
    for rnd in range(4):
        for k, p in enumerate(prompts):
            for _ in range(3):
                busy = busy @ busy / 64                 # the current stream is busy: the copies queue behind it
            wait = (rnd + k) % 3 != 0
            served = _serve(pool, tree, "x", p, wait=wait)
            assert served or not wait                   # the pool always has room here
            left += not served                          # left while its prefix was in flight
            if k % 2:
                swapper.reclaim(pool.num_pages, defer=rnd % 2 == 0)
            _invariants(pool, tree, swapper)
    assert swapper.swapped_in > 0 and left > 0 and isinstance(swapper.out_copier, StreamCopier)
    torch.cuda.synchronize()
    tree.clear()
    assert pool.num_free == pool.num_pages and not swapper._flights


@pytest.mark.gpu
def test_gpu_engine_follow_up_turn_from_host_memory_matches_the_gpu_cache():
    """A tiny model on the GPU: a follow-up turn whose history went to host memory comes back on the copy
    stream beside a running request; tokens as when the history stayed on the GPU (the same KV bytes)."""
    first = list(range(3, 40))
    turn2, other = first + [40, 41, 42], list(range(100, 130))
    sp = SamplingParams(max_tokens=8, ignore_eos=True)

    def serve(to_host: bool):
        llm = LLM("random:tiny-llama", device="cuda", num_blocks=64, block_size=4, prefix_caching=True,
                  memory_policy="fastlibra")
        eng = llm.engine
        llm.generate([first], None, SamplingParams(max_tokens=1, ignore_eos=True))
        if to_host:
            eng.swapper.reclaim(eng.pool.num_pages)
            assert len(eng.swapper.host_nodes) == 9
        eng.add_request(other, None, sp, request_id="other")
        eng.step()
        eng.add_request(turn2, None, sp, request_id="turn2")
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
        assert eng.prefix_cache.hit_tokens >= 36 and eng.swapper.swapped_in == (9 if to_host else 0)
        return [outs["turn2"].token_ids, outs["other"].token_ids]

    assert serve(True) == serve(False)
