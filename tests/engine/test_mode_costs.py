"""The start-up profile of the inference modes: which graph replays it times, and how the policy reads it."""

from __future__ import annotations

import pytest
import torch

from vlora.engine.mode_costs import ModeCosts, profile_steps
from vlora.engine.modes import Mode
from vlora.engine.orchestrator import Orchestrator
from vlora.lora.batch import LoRALaunch, PackedAdapter


class FakeGraphs:
    """Records the replays asked for (CPU: nothing to time but the calls)."""

    scratch_slot = 4095
    device = torch.device("cpu")

    def __init__(self, mixed: str = "one"):
        self.calls = []
        self.launch = LoRALaunch(mixed=mixed)

    def run(self, ids, positions, slots, lens, tables, counts, segments, minus=()):
        self.calls.append((len(ids), set(slots), list(segments), list(minus)))


def adapter(slot: int, rank: int) -> PackedAdapter:
    return PackedAdapter(slot, f"a{slot}", rank, 2.0, ())


@pytest.mark.parametrize("launches", ["one", "two"])
def test_profile_times_each_mode_per_bucket_on_the_scratch_slot(launches):
    """Mixed iterations are timed as the engine launches them: segments paired with the merged adapter, or a
    second pass."""
    graphs = FakeGraphs(launches)
    merged, others = adapter(0, 64), [adapter(i, 16) for i in range(1, 4)]
    steps = profile_steps(graphs, [merged] + others, [1, 4], reps=2)
    assert set(steps) == set(Mode) and all(set(t) == {1, 4} and min(t.values()) >= 0 for t in steps.values())
    assert all(slots == {FakeGraphs.scratch_slot} for _, slots, _, _ in graphs.calls)   # no sequence's KV
    at4 = [c for c in graphs.calls if c[0] == 4]
    is_mixed = lambda c: c[3] or any(s.pair is not None for s in c[2])     # noqa: E731
    base = [c for c in at4 if not c[2] and not c[3]]
    unmerged = [c for c in at4 if c[2] and not is_mixed(c)]
    mixed = [c for c in at4 if is_mixed(c)]
    assert base and unmerged and mixed
    segs = unmerged[0][2]
    assert [(s.start, s.end) for s in segs] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert {s.adapter.name for s in segs} == {"a1", "a2", "a3"} and merged not in [s.adapter for s in segs]
    own, minus = mixed[0][2], mixed[0][3]
    assert [(s.start, s.end) for s in own] == [(1, 2), (2, 3), (3, 4)]     # row 0 is the merged adapter's
    assert merged not in [s.adapter for s in own]
    if launches == "one":
        assert not minus and all((s.pair, s.pair_scale) == (merged, -merged.scaling) for s in own)
    else:
        assert all(s.pair is None for s in own)
        assert len(minus) == 1 and (minus[0].start, minus[0].end, minus[0].adapter) == (1, 4, merged)
        assert minus[0].scale == -merged.scaling
    with pytest.raises(ValueError, match="two resident adapters"):
        profile_steps(graphs, [merged], [1])


def test_costs_are_read_per_batch_size_and_switch_kind():
    p = ModeCosts({Mode.MERGED: {1: 0.006, 8: 0.007}, Mode.MIXED: {1: 0.0075, 8: 0.0085},
                   Mode.UNMERGED: {1: 0.0070, 8: 0.0080}}, merge_s=0.038, reuse_s=0.011, unmerge_s=0.012)
    assert p.step(Mode.MIXED, 1) == 0.0075 and p.step(Mode.MIXED, 5) == 0.0085 and p.step(Mode.MIXED, 64) == 0.0085
    assert ModeCosts().step(Mode.MERGED, 3) == 0.0
    assert p.as_dict()["step_ms"]["mixed"][8] == 8.5 and p.as_dict()["reuse_ms"] == 11.0

    class Switcher:
        kept = None

    orch = Orchestrator("vlora", 0.5, 64, p)
    c = orch.costs(6, Switcher())
    assert c.step_s == {Mode.MERGED: 0.007, Mode.MIXED: 0.0085, Mode.UNMERGED: 0.0080}
    assert (c.switch_s, c.unmerge_cost, c.merge_cost("a"), c.kept) == (0.038, 0.012, 0.038, None)
    kept = type("Record", (), {"adapter": adapter(3, 8)})()
    Switcher.kept = kept
    assert orch.costs(1, Switcher()).merge_cost("a3") == 0.011


@pytest.mark.gpu
def test_gpu_engine_profiles_its_modes_and_keeps_its_weights():
    """On a GPU: the profile times every mode at every bucket and each switch, leaves the base weights bit for
    bit as loaded and nothing merged, and the engine then serves with the orchestrator reading it."""
    import tempfile
    from pathlib import Path

    from vlora import LLM
    from vlora.bench.harness import run_workload
    from vlora.bench.workloads import RequestSpec
    from vlora.lora.random_adapter import write_random_adapter

    llm = LLM("random:tiny-llama", device="cuda", kv_cache_memory_gb=1, max_num_seqs=8, max_lora_rank=16,
              max_num_batched_tokens=512, policy="vlora")
    eng = llm.engine
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate((8, 16, 8)):
            llm.register_adapter(f"a{i}", write_random_adapter(Path(tmp) / f"a{i}", eng.adapters.shape, r, seed=i))
        before = {k: w.clone() for k, w in eng.runner.modes.weights.items()}
        costs = eng.profile_modes(reps=3)
        assert costs is not None and eng.orchestrator.profile is costs and eng.runner.modes.merged is None
        assert all(torch.equal(before[k], w) for k, w in eng.runner.modes.weights.items())
        assert set(costs.step_s[Mode.MIXED]) == set(eng.runner.graphs.buckets)
        assert min(min(t.values()) for t in costs.step_s.values()) > 0
        assert min(costs.merge_s, costs.reuse_s, costs.unmerge_s) > 0
        res = run_workload(eng, [RequestSpec(0.01 * i, f"a{i % 3}" if i % 4 else None, 12, 6) for i in range(8)])
    assert res.metrics()["finished"] == 8


def test_default_policy_merges_on_one_gpu_only():
    """No policy asked for: V-LoRA's on one GPU (the paired runs' evidence), unmerged on the CPU and under
    tensor parallelism; one asked for is kept."""
    from dataclasses import replace

    from vlora import LLM
    from vlora.config import EngineConfig, ModelConfig
    from vlora.engine.engine import default_policy

    cfg = EngineConfig()
    assert cfg.scheduler.policy is None
    assert default_policy(cfg, torch.device("cuda")) == "vlora"
    assert default_policy(cfg, torch.device("cpu")) == "unmerged"
    tp = replace(cfg, model=ModelConfig(tensor_parallel_size=2))
    assert default_policy(tp, torch.device("cuda")) == "unmerged"
    assert LLM("random:tiny-llama", device="cpu", num_blocks=16).engine.config.scheduler.policy == "unmerged"
    eng = LLM("random:tiny-llama", device="cpu", num_blocks=16, policy="dlora").engine
    assert eng.config.scheduler.policy == "dlora" and eng.orchestrator.policy == "dlora"


def test_profile_policy_times_the_modes_only_for_merging_policies():
    """``LLM`` and ``vlora serve`` time the modes before serving under vlora and dlora (one device); not under
    the policies that never weigh modes, nor under tensor parallelism."""
    from types import SimpleNamespace

    from vlora.builder import profile_policy

    def engine(policy, tp=1):
        calls = []
        cfg = SimpleNamespace(scheduler=SimpleNamespace(policy=policy), model=SimpleNamespace(tensor_parallel_size=tp))
        return SimpleNamespace(config=cfg, profile_modes=lambda: calls.append(1)), calls

    for policy, tp, want in (("vlora", 1, 1), ("dlora", 1, 1), ("unmerged", 1, 0), ("merged-only", 1, 0),
                             ("vlora", 2, 0)):
        eng, calls = engine(policy, tp)
        profile_policy(eng)
        assert len(calls) == want, (policy, tp)


@pytest.mark.gpu
def test_gpu_llm_profiles_the_modes_at_start_under_the_default_policy(tmp_path):
    """On a GPU, ``LLM`` with adapters and the default policy (vlora) has the modes timed before its first
    request, with nothing merged; under unmerged nothing is timed."""
    from vlora import LLM
    from vlora.lora.adapter import ModelShape
    from vlora.lora.random_adapter import write_random_adapter

    probe = LLM("random:tiny-llama", device="cuda", kv_cache_memory_gb=1, max_num_seqs=8, max_lora_rank=16)
    shape = probe.engine.adapters.shape
    assert isinstance(shape, ModelShape) and probe.engine.mode_costs is None      # no adapters: nothing timed
    paths = {f"a{i}": str(write_random_adapter(tmp_path / f"a{i}", shape, r, seed=i)) for i, r in enumerate((8, 16))}
    kw = dict(device="cuda", kv_cache_memory_gb=1, max_num_seqs=8, max_lora_rank=16, adapters=paths)
    llm = LLM("random:tiny-llama", **kw)
    eng = llm.engine
    assert eng.config.scheduler.policy == "vlora"
    assert eng.mode_costs is not None and eng.orchestrator.profile is eng.mode_costs
    assert eng.runner.modes.merged is None
    assert LLM("random:tiny-llama", policy="unmerged", **kw).engine.mode_costs is None
