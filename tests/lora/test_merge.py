"""Swift merge/unmerge: bitwise exact after many cycles, and merged == unmerged outputs."""

from __future__ import annotations

import random

import pytest
import torch

from tests.models.test_parity import NAMES, PROMPTS, build, vlora_logits
from vlora import LLM
from vlora.lora.adapter import ModelShape
from vlora.lora.merge import group_widths, merge_, unmerge_
from vlora.lora.random_adapter import write_random_adapter
from vlora.lora.registry import AdapterRegistry

HID, Q, KV, INTER, LAYERS = 64, 64, 32, 128, 3
INS = {"q_proj": HID, "k_proj": HID, "v_proj": HID, "o_proj": Q, "gate_proj": HID, "up_proj": HID, "down_proj": INTER}
OUTS = {"q_proj": Q, "k_proj": KV, "v_proj": KV, "o_proj": HID, "gate_proj": INTER, "up_proj": INTER, "down_proj": HID}
WIDTHS = group_widths(Q, KV, HID, INTER)
# bitwise equal after 1,000 cycles in the dtype the engine serves on GPUs; fewer in the others, whose codes and
# exceptions take the same paths
CYCLES = {torch.bfloat16: 1000, torch.float32: 250, torch.float16: 250}


def stacked_weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {grp: torch.randn(LAYERS, sum(wd), INS[{"qkv": "q_proj", "o": "o_proj", "gate_up": "gate_proj",
                                               "down": "down_proj"}[grp]], generator=g) * 0.02
         for grp, wd in WIDTHS.items()}
    w["qkv"][0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])     # signed zeros, tiny values
    return {k: v.to(dtype) for k, v in w.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_thousand_merge_unmerge_cycles_are_bitwise_exact(tmp_path, dtype):
    shape = ModelShape("tiny", LAYERS, INS, OUTS)
    reg = AdapterRegistry(shape, 64, torch.float32, torch.device("cpu"), check_base_model=False)
    rng = random.Random(0)
    targets = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
               ("down_proj",), ("k_proj", "up_proj")]
    adapters = [reg.register(f"a{i}", write_random_adapter(tmp_path / f"a{i}", shape, rank=rng.choice([4, 8, 16]),
                                                            seed=i, std=rng.choice([0.01, 0.1, 0.5]),
                                                            targets=targets[i % 4]))
                for i in range(8)]
    weights = stacked_weights(dtype)
    original = {k: v.clone() for k, v in weights.items()}
    exceptions = 0
    cycles = CYCLES[dtype]
    for cycle in range(cycles):
        a = adapters[rng.randrange(len(adapters))]
        rec = merge_(weights, WIDTHS, a, scale=rng.choice([a.scaling, -a.scaling, 7.5]), chunk_elems=rng.choice([1 << 20, 5000]))
        if cycle % 100 == 0:
            assert any(not torch.equal(weights[g], original[g]) for g in weights)   # the merge did change W
        exceptions += rec.num_exceptions()
        unmerge_(weights, WIDTHS, rec, chunk_elems=rng.choice([1 << 20, 3000]))
        if cycle % 97 == 0 or cycle == cycles - 1:
            for g in weights:
                assert torch.equal(weights[g].view(torch.uint8), original[g].view(torch.uint8)), (cycle, g)
    assert exceptions > 0                      # the exception path was exercised too


def test_merged_model_gives_the_unmerged_outputs(tmp_path):
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4)
    model = llm.engine.model
    cfg = model.cfg
    widths = group_widths(cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size)
    unmerged = vlora_logits(llm, PROMPTS, ["a8"] * len(PROMPTS))
    before = {g: t.clone() for g, t in model.stacked.items()}
    rec = merge_(model.stacked, widths, llm.engine.adapters.get("a8"))
    merged = vlora_logits(llm, PROMPTS, [None] * len(PROMPTS))
    for a, b in zip(merged, unmerged):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    unmerge_(model.stacked, widths, rec)
    for g, t in model.stacked.items():
        assert torch.equal(t, before[g])
    base_again = vlora_logits(llm, PROMPTS, NAMES)
    torch.testing.assert_close(base_again[1], vlora_logits(llm, PROMPTS, NAMES)[1])


def test_restore_record_costs_a_fraction_of_the_weights(tmp_path):
    """A realistic adapter (|ΔW| a few % of |W|): 2-bit codes and few exceptions, far below a copy."""
    shape = ModelShape("tiny", LAYERS, INS, OUTS)
    reg = AdapterRegistry(shape, 64, torch.float32, torch.device("cpu"), check_base_model=False)
    adapter = reg.register("a", write_random_adapter(tmp_path / "a", shape, rank=16, seed=1, std=0.01))
    weights = stacked_weights(torch.bfloat16)
    rec = merge_(weights, WIDTHS, adapter)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert rec.num_exceptions() < 0.05 * weight_bytes / 2
    assert rec.restore_bytes() < weight_bytes / 5
