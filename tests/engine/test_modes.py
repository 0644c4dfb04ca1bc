"""Merged, unmerged and mixed (deLoRA) modes give every request the same output."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_parity import NAMES, PROMPTS, build, vlora_logits
from vlora import LLM, SamplingParams
from vlora.engine.modes import Mode

SP = SamplingParams(max_tokens=6, min_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_outputs_are_identical_whatever_the_mode(tmp_path, kernel):
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4, lora_kernel=kernel)
    eng = llm.engine
    base_weights = {g: t.clone() for g, t in eng.model.stacked.items()}
    unmerged_logits = vlora_logits(llm, PROMPTS, NAMES)
    unmerged = [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)]

    eng.merge_adapter("a8")                      # NAMES mixes base, a4, a8, a16: mixed mode
    batch = [None if n is None else eng.adapters.get(n) for n in NAMES]
    assert eng.runner.modes.mode_for(batch) is Mode.MIXED
    lora = eng.runner._lora_batch([(i, i + 1, a) for i, a in enumerate(batch)])     # one launch: pairs, no pass 2
    assert lora.extra is None and [s.pair for s in lora.segments] == [None, batch[2], batch[2]]
    assert [s.adapter.name for s in lora.segments] == ["a8", "a4", "a16"]          # base row: - a8 alone
    assert lora.segments[0].scale == -batch[2].scaling
    assert lora.kernel is None or lora.kernel["qkv"].pair is not None
    for a, b in zip(vlora_logits(llm, PROMPTS, NAMES), unmerged_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)] == unmerged

    only_a8 = [o.token_ids for o in llm.generate(PROMPTS, ["a8"] * 4, SP)]   # merged mode: no LoRA at all
    assert eng.runner.modes.mode_for([eng.adapters.get("a8")]) is Mode.MERGED
    eng.merge_adapter("a16")                     # switch: unmerge a8, merge a16
    assert [o.token_ids for o in llm.generate(PROMPTS, ["a8"] * 4, SP)] == only_a8
    assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)] == unmerged

    eng.unmerge_adapter()
    assert eng.runner.modes.num_switches == 3
    for g, t in eng.model.stacked.items():
        assert torch.equal(t, base_weights[g])  # bit for bit
    assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)] == unmerged


def test_unregistering_the_merged_adapter_unmerges_it(tmp_path):
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4)
    before = {g: t.clone() for g, t in llm.engine.model.stacked.items()}
    llm.engine.merge_adapter("a4")
    llm.unregister_adapter("a4")
    assert llm.engine.runner.modes.merged is None
    assert all(torch.equal(t, before[g]) for g, t in llm.engine.model.stacked.items())


@pytest.mark.parametrize("policy", ["vlora", "merged-only", "dlora"])
def test_mode_policies_change_speed_not_answers(tmp_path, policy):
    path, paths, _ = build(tmp_path)
    prompts = [PROMPTS[i % 4] + [i + 30] for i in range(12)]
    names = ["a8"] * 8 + ["a4", None, "a16", "a8"]             # skewed: a8 dominates
    sp = SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(path), adapters=paths, num_blocks=96, block_size=4)
                .generate(prompts, names, sp)]
    llm = LLM(str(path), adapters=paths, num_blocks=96, block_size=4, max_num_seqs=8, policy=policy,
              starvation_s=0.05)
    assert [o.token_ids for o in llm.generate(prompts, names, sp)] == expected
    orch = llm.engine.orchestrator
    assert orch.mode_iterations[Mode.MERGED] > 0                # the dominant adapter ran merged
    assert orch.decisions[Mode.MERGED] > 0
    if policy != "vlora":
        assert orch.decisions[Mode.MIXED] == 0                 # only V-LoRA's policy uses deLoRA
    assert llm.engine.runner.modes.num_switches >= 1


def test_switching_back_reuses_the_restore_record(tmp_path, monkeypatch):
    """With the fused merge (forced on this CPU), merging the adapter unmerged last reuses its restore record;
    another adapter gets a record of its own (the kept one freed first); the base weights come back bit for bit
    each time and the answers do not change; unregistering drops the kept record."""
    from vlora.lora import merge

    monkeypatch.setattr(merge, "_use_kernel", lambda weights, kernel: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4)
    eng, modes = llm.engine, llm.engine.runner.modes
    base = {g: t.clone() for g, t in eng.model.stacked.items()}
    eng.merge_adapter("a8")
    only_a8 = [o.token_ids for o in llm.generate(PROMPTS, ["a8"] * 4, SP)]
    first = modes.record
    for name in ("a4", "a8", "a8", "a4"):
        eng.unmerge_adapter()
        assert all(torch.equal(t, base[g]) for g, t in eng.model.stacked.items())
        eng.merge_adapter(name)
    assert modes.num_reused == 1 and modes.record is not first      # a8 once; a4 came after a8, not a4
    eng.unmerge_adapter()
    eng.merge_adapter("a4")
    assert modes.num_reused == 2
    eng.unmerge_adapter()
    eng.merge_adapter("a8")
    assert [o.token_ids for o in llm.generate(PROMPTS, ["a8"] * 4, SP)] == only_a8
    eng.unmerge_adapter()
    assert modes.kept is not None and modes.kept.adapter.name == "a8"
    llm.unregister_adapter("a8")
    assert modes.kept is None
    assert all(torch.equal(t, base[g]) for g, t in eng.model.stacked.items())


@pytest.mark.gpu
def test_gpu_mixed_mode_in_one_launch_gives_the_two_launch_and_unmerged_tokens(tmp_path):
    """On a GPU (Triton kernels, CUDA-graph decode, fp32): with a8 merged, a batch of base, a4, a8 and a16 rows
    gives the unmerged tokens whether mixed mode runs in one launch or two, and both graph kinds replayed."""
    from dataclasses import replace

    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4, device="cuda", dtype="float32",
              policy="unmerged")                  # the modes switched by hand only
    eng = llm.engine
    unmerged = [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)]
    eng.merge_adapter("a8")
    for launches in ("one", "two"):
        eng.runner.lora_launch = replace(eng.runner.lora_launch, mixed=launches)
        eng.runner.graphs.launch = eng.runner.lora_launch
        assert [o.token_ids for o in llm.generate(PROMPTS, NAMES, SP)] == unmerged, launches
    from vlora.engine.cuda_graphs import MIXED, PAIRED

    assert {MIXED, PAIRED} <= {kind for _, kind, _ in eng.runner.graphs.graphs}


def test_graph_replays_follow_a_change_of_mixed_launch(tmp_path):
    """The replayed decode's LoRA segments are reused while the batch's adapters stay the same, but not across
    a change of how mixed mode launches: each launch kind then replays its own graph kind (CPU graph emulation,
    Triton interpreter), with the unmerged tokens."""
    from dataclasses import replace

    from vlora.engine.cuda_graphs import MIXED, PAIRED

    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4, dtype="float32", kernels="triton",
              lora_kernel="triton", max_num_seqs=4, max_model_len=128)
    eng = llm.engine
    eng.runner.enable_graphs(4, eng.max_model_len, columns=4)
    short, sp = [p[:4] for p in PROMPTS], SamplingParams(max_tokens=3, ignore_eos=True)
    unmerged = [o.token_ids for o in llm.generate(short, NAMES, sp)]
    eng.merge_adapter("a8")
    kinds = []
    for launches in ("one", "two"):
        eng.runner.lora_launch = replace(eng.runner.lora_launch, mixed=launches)
        eng.runner.graphs.launch = eng.runner.lora_launch
        before = set(eng.runner.graphs.graphs)
        assert [o.token_ids for o in llm.generate(short, NAMES, sp)] == unmerged, launches
        kinds.append({kind for _, kind, _ in set(eng.runner.graphs.graphs) - before})
    assert kinds == [{PAIRED}, {MIXED}]


def check_mixed_graphs_in_mixed_mode(tmp_path, **kw):
    """V-LoRA's mixed mode (a8 merged, the other adapters' and the base rows carrying it subtracted) in the mixed
    graphs of prompts prefilled beside decodes: every token equal to PEFT's."""
    from tests.models.test_fast_path import GRAPH_NAMES, GRAPH_PROMPTS, GRAPH_SPS, mixed_graphs_engine

    path, paths, pm = build(tmp_path)
    llm, want = mixed_graphs_engine(path, paths, pm, 4, **kw)
    g = llm.engine.runner.graphs
    llm.engine.merge_adapter("a8")
    mixed = [o.token_ids for o in llm.generate(GRAPH_PROMPTS[:4], GRAPH_NAMES[:4], GRAPH_SPS[:4])]   # every name
    assert mixed == want
    assert (g.mixed_kind, True) in {(kind, m) for _, kind, m in g.graphs}
    assert llm.engine.runner.modes.merged is not None
    llm.engine.pool.check()
    assert llm.engine.pool.kv_pages == 0


def test_mixed_graphs_in_mixed_mode_on_cpu(tmp_path):
    """The CPU emulation, Triton kernels in the interpreter."""
    check_mixed_graphs_in_mixed_mode(tmp_path, kernels="triton", lora_kernel="triton")


@pytest.mark.gpu
def test_cuda_mixed_graphs_in_mixed_mode(tmp_path):
    check_mixed_graphs_in_mixed_mode(tmp_path, device="cuda", dtype="float32")
