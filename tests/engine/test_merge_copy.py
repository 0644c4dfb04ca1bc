"""Merged copies in pool pages: merged mode by pointer, bitwise the in-place merge, base weights never written,
the copy dropped when KV needs its pages."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_parity import NAMES, PROMPTS, build, vlora_logits
from vlora import LLM, SamplingParams
from vlora.engine.modes import Mode
from vlora.engine.orchestrator import Costs, Pending, stay_pays, switch_pays
from vlora.lora import merge

SP = SamplingParams(max_tokens=10, min_tokens=10, ignore_eos=True)
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.dtype])


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[g]), bits(b[g])) for g in a)


@pytest.mark.parametrize("fused", [False, True], ids=["torch-merge", "fused-merge"])
def test_merged_copy_is_bitwise_the_in_place_merge_and_never_writes_the_base(tmp_path, monkeypatch, fused):
    """The copy holds the bits an in-place (first) merge writes, so merged and mixed logits are bitwise the
    in-place ones; switching to and from it many times leaves the base weights bitwise untouched and the
    unmerged logits bitwise unchanged. Fused: the Triton merge kernel (interpreter), as on a GPU."""
    if fused:
        monkeypatch.setattr(merge, "_use_kernel", lambda weights, kernel: True)
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=256, block_size=4, merged_copy=True)
    eng, modes = llm.engine, llm.engine.runner.modes
    copies = modes.copies
    base = {g: t.clone() for g, t in eng.model.stacked.items()}
    unmerged = vlora_logits(llm, PROMPTS, NAMES)

    eng.merge_adapter("a8")                                  # in place: the reference
    in_place = {g: t.clone() for g, t in eng.model.stacked.items()}
    mixed_ref, merged_ref = vlora_logits(llm, PROMPTS, NAMES), vlora_logits(llm, PROMPTS, ["a8"] * 4)
    eng.unmerge_adapter()
    assert same_bits(dict(eng.model.stacked), base)

    a8 = eng.adapters.get("a8")
    modes.merge(a8, copy_keep_free=0)                        # a copy: every group (a8 targets all seven)
    assert modes.on_copy and modes.merged is a8 and copies.num_made == 1
    assert set(copies.copy.weights) == set(base)
    assert same_bits(copies.copy.weights, in_place)
    assert same_bits(dict(eng.model.stacked), base)          # the base weights were only read
    assert all(getattr(layer, "qkv").weight.data_ptr() != base_ptr for layer, base_ptr in
               zip(eng.model.layers, [t.data_ptr() for t in eng.model.stacked["qkv"]]))
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(vlora_logits(llm, PROMPTS, NAMES), mixed_ref))
        assert all(torch.equal(a, b) for a, b in zip(vlora_logits(llm, PROMPTS, ["a8"] * 4), merged_ref))
        modes.unmerge()                                      # a pointer change back
        assert modes.merged is None and not modes.on_copy
        assert same_bits(dict(eng.model.stacked), base)
        assert all(torch.equal(a, b) for a, b in zip(vlora_logits(llm, PROMPTS, NAMES), unmerged))
        modes.merge(a8, copy_keep_free=0)                    # back to the resident copy: a pointer change
    assert copies.num_made == 1 and modes.num_copy_switches == 6
    eng.pool.check()

    a4 = eng.adapters.get("a4")                              # another adapter's copy replaces it: qkv only
    modes.merge(a4, copy_keep_free=0)
    assert copies.copy.adapter is a4 and set(copies.copy.weights) == {"qkv"} and copies.num_dropped == 1
    assert eng.model.layers[0].o.weight.data_ptr() == eng.model.stacked["o"][0].data_ptr()
    llm.unregister_adapter("a4")                             # its copy goes with it
    assert copies.copy is None and modes.merged is None
    assert same_bits(dict(eng.model.stacked), base)
    eng.pool.check()
    assert eng.pool.num_free == eng.pool.num_pages


def test_switches_between_a_copy_and_an_in_place_merge(tmp_path):
    """A copy of one adapter resident while another merges in place (the policy asked for no copy): each switch
    takes the right path, and the answers are the unmerged ones throughout."""
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=256, block_size=4, merged_copy=True)
    eng, modes = llm.engine, llm.engine.runner.modes
    base = {g: t.clone() for g, t in eng.model.stacked.items()}
    want = [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)]
    a8, a16 = eng.adapters.get("a8"), eng.adapters.get("a16")
    modes.merge(a8, copy_keep_free=0)
    modes.merge(a16)                                         # in place, a8's copy kept
    assert modes.record is not None and not modes.on_copy and modes.copies.copy.adapter is a8
    assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)] == want
    modes.merge(a8)                                          # a16 unmerged in place, then a8's copy pointed at
    assert modes.on_copy and modes.record is None
    assert same_bits(dict(eng.model.stacked), base)
    assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)] == want
    modes.merge(a16)
    modes.unmerge()
    assert same_bits(dict(eng.model.stacked), base)


@pytest.mark.parametrize("policy", ["vlora", "merged-only"])
def test_policies_with_merged_copies_give_the_unmerged_tokens(tmp_path, policy):
    """The policy merges into copies (the pool has room), switches by pointer, and every request gets the tokens
    of the unmerged engine."""
    path, paths, _ = build(tmp_path)
    prompts = [PROMPTS[i % 4] + [i + 30] for i in range(12)]
    names = ["a8"] * 8 + ["a4", None, "a16", "a8"]
    sp = SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=96, block_size=4)
                .generate(prompts, names, sp)]
    llm = LLM(str(path), adapters=paths, num_blocks=512, block_size=4, max_num_seqs=8, policy=policy,
              starvation_s=0.05, merged_copy=True)
    assert [o.token_ids for o in llm.generate(prompts, names, sp)] == expected
    modes = llm.engine.runner.modes
    assert modes.copies.num_made >= 1 and llm.engine.orchestrator.mode_iterations[Mode.MERGED] > 0
    assert modes.record is None and modes.kept is None         # no merge went in place
    llm.engine.pool.check()


def test_the_copy_gives_its_pages_to_kv_and_the_run_completes(tmp_path):
    """A pool the copy nearly fills: the requests' KV takes its pages (the layers go back to the base weights,
    unmerged mode) and every request completes with the unmerged tokens."""
    path, paths, _ = build(tmp_path)
    sp = SamplingParams(max_tokens=30, min_tokens=30, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=96, block_size=4)
                .generate(PROMPTS, NAMES, sp)]
    llm = LLM(str(path), adapters=paths, num_blocks=160, block_size=4, merged_copy=True)
    eng, modes = llm.engine, llm.engine.runner.modes
    base = {g: t.clone() for g, t in eng.model.stacked.items()}
    modes.merge(eng.adapters.get("a8"), copy_keep_free=0)
    pages = modes.copies.copy.pages
    assert modes.on_copy and eng.pool.num_free == eng.pool.num_pages - pages < 40     # 4 requests need ~40
    assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, sp)] == expected
    assert modes.copies.copy is None and modes.copies.num_dropped == 1 and modes.merged is None
    assert same_bits(dict(eng.model.stacked), base)
    eng.pool.check()
    assert eng.pool.kv_pages == 0 and eng.pool.num_free == eng.pool.num_pages


def test_the_policy_makes_no_copy_where_kv_demand_needs_the_pages(tmp_path):
    """With the same small pool, the policy's merges go in place: a copy would leave less than the requests'
    KV demand free."""
    path, paths, _ = build(tmp_path)
    sp = SamplingParams(max_tokens=30, min_tokens=30, ignore_eos=True)
    llm = LLM(str(path), adapters=paths, num_blocks=160, block_size=4, policy="merged-only", merged_copy=True)
    want = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=96, block_size=4)
            .generate(PROMPTS, ["a8"] * 4, sp)]
    assert [o.token_ids for o in llm.generate(PROMPTS, ["a8"] * 4, sp)] == want
    modes = llm.engine.runner.modes
    assert modes.copies.num_made == 0 and modes.num_switches >= 1


def test_graph_sets_follow_the_weights_the_layers_read(tmp_path):
    """Decode graphs (the CPU emulation) keep one set per weight set: switching to a copy replays and captures
    the copy's set, switching back the base's; tokens as unmerged either way."""
    path, paths, _ = build(tmp_path)
    sp = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True)
    kw = dict(adapters=paths, num_blocks=256, block_size=4, kernels="triton", lora_kernel="triton")
    want = [o.token_ids for o in LLM(str(path), cuda_graphs=False, **kw).generate(PROMPTS[:2], ["a8"] * 2, sp)]
    llm = LLM(str(path), merged_copy=True, max_model_len=128, **kw)
    eng = llm.engine
    eng.runner.enable_graphs(4, eng.max_model_len)
    g, modes = eng.runner.graphs, eng.runner.modes
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], ["a8"] * 2, sp)] == want
    base_set = dict(g.graphs)
    modes.merge(eng.adapters.get("a8"), copy_keep_free=0)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], ["a8"] * 2, sp)] == want
    assert g._weights == modes.copies.copy.key
    assert g.graphs and not {id(v[0]) for v in g.graphs.values()} & {id(v[0]) for v in base_set.values()}
    modes.unmerge()
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], ["a8"] * 2, sp)] == want
    assert g._weights is None and all(g.graphs[k] is v for k, v in base_set.items())


def test_start_up_profile_times_a_copy_and_the_policy_reads_it(tmp_path):
    """The profile makes a copy, switches to and from it, and leaves nothing behind (no copy, nothing merged,
    the base weights bitwise); the orchestrator prices a resident copy's switches with its figure."""
    from vlora.engine.mode_costs import ModeCosts, profile_copy
    from vlora.engine.orchestrator import Orchestrator

    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=256, block_size=4, merged_copy=True)
    eng, modes = llm.engine, llm.engine.runner.modes
    base = {g: t.clone() for g, t in eng.model.stacked.items()}
    make_s, copy_s = profile_copy(modes, eng.adapters.get("a8"), reps=2)
    assert make_s > copy_s >= 0.0 and modes.copies.num_made == 2
    assert modes.copies.copy is None and modes.merged is None and same_bits(dict(eng.model.stacked), base)
    eng.pool.check()
    assert eng.pool.num_free == eng.pool.num_pages
    profile = ModeCosts({m: {1: 0.005} for m in Mode}, 0.03, 0.01, 0.012, make_s, copy_s)
    orch = Orchestrator("vlora", 0.5, 8, profile)
    modes.merge(eng.adapters.get("a8"), copy_keep_free=0)
    costs = orch.costs(1, modes, keep_free=0)
    assert costs.copied == "a8" and costs.merge_cost("a8") == copy_s and costs.can_copy
    assert costs.merge_cost("a4") == make_s and costs.unmerge_cost_of("a8") == copy_s
    assert orch.costs(1, modes).can_copy is False                  # no copy asked for: a merge goes in place


def _pending(adapter: str, n: int, remaining: int) -> list[Pending]:
    return [Pending(f"{adapter}-{i}", adapter, 0.0, remaining) for i in range(n)]


def test_costs_price_a_resident_copy_as_a_pointer_change():
    steps = {Mode.MERGED: 0.005, Mode.UNMERGED: 0.006, Mode.MIXED: 0.007}
    in_place = Costs(steps, switch_s=0.03, unmerge_s=0.012, reuse_s=0.01, kept="x")
    copied = Costs(steps, switch_s=0.03, unmerge_s=0.012, reuse_s=0.01, kept="x", copied="x", copy_s=1e-5)
    room = Costs(steps, switch_s=0.03, unmerge_s=0.012, reuse_s=0.01, make_s=0.04, can_copy=True)
    assert in_place.round_trip("x") == pytest.approx(0.022) and copied.round_trip("x") == pytest.approx(2e-5)
    assert room.round_trip("y") == pytest.approx(0.04 + 0.0) and room.unmerge_cost_of("y") == 0.012
    short = _pending("x", 4, 3)                 # 3 steps x 1 ms saved: pays against a pointer change only
    assert switch_pays(short, copied) and not switch_pays(short, in_place)
    # mixed mode 1 ms slower than unmerged for 20 steps: staying pays against an in-place round trip, not
    # against a copy's (leaving and coming back are pointer changes)
    mine, others = _pending("x", 2, 50), _pending("y", 1, 20)
    assert stay_pays(in_place, mine, others, "x") and not stay_pays(copied, mine, others, "x")


@pytest.mark.gpu
def test_gpu_merged_copy_on_cuda_graphs_is_bitwise_the_in_place_merge(tmp_path):
    """On a GPU (Triton kernels, CUDA-graph decode, bf16): decode tokens and logits with the copy equal the
    in-place merge's bitwise; graph replays after each switch read the weights of their own set (no stale
    weights); the base weights are never written."""
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=512, block_size=4, device="cuda", dtype="bfloat16",
              merged_copy=True, max_num_seqs=8, policy="unmerged")          # the modes switched by hand only
    eng, modes = llm.engine, llm.engine.runner.modes
    base = {g: t.clone() for g, t in eng.model.stacked.items()}
    unmerged = [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)]
    eng.merge_adapter("a8")
    in_place = {g: t.clone() for g, t in eng.model.stacked.items()}
    mixed_ref = [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)]
    merged_ref = [o.token_ids for o in llm.generate(PROMPTS, ["a8"] * 4, SP)]
    eng.unmerge_adapter()
    a8 = eng.adapters.get("a8")
    for _ in range(3):
        modes.merge(a8, copy_keep_free=0)
        assert modes.on_copy and same_bits(modes.copies.copy.weights, in_place)
        assert [o.token_ids for o in llm.generate(PROMPTS, ["a8"] * 4, SP)] == merged_ref
        assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)] == mixed_ref
        modes.unmerge()
        assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)] == unmerged
        assert same_bits(dict(eng.model.stacked), base)
    assert modes.copies.num_made == 1
    g = eng.runner.graphs
    assert g.num_replays > 0 and any(g._other_sets.values())      # both weight sets captured
