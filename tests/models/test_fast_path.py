"""The GPU fast path's pieces against the reference path: Triton paged attention inside the model
(interpreter on CPU) and CUDA-graph decode (GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_parity import NAMES, PROMPTS, build, peft_greedy, peft_logits, vlora_logits
from vlora import LLM, SamplingParams


@pytest.mark.parametrize("model_type,overrides", [("llama", {}), ("mistral", {"sliding_window": 4})])
def test_triton_attention_matches_peft(tmp_path, model_type, overrides):
    path, paths, pm = build(tmp_path, model_type, **overrides)
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4, attention="triton", lora_kernel="triton")
    assert llm.engine.runner.kernel_attention
    for a, r, name in zip(vlora_logits(llm, PROMPTS, NAMES), peft_logits(pm, PROMPTS, NAMES), NAMES):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4 * r.abs().max().item(), msg=f"adapter {name}")


def test_triton_attention_with_cached_prefix_keeps_tokens(tmp_path):
    """Chunked prefill (chunks over a cached prefix), decodes and preemption through the Triton kernels give
    the torch path's tokens."""
    path, paths, _ = build(tmp_path)
    prompts = [PROMPTS[i % 4] + [i + 20] * (i % 5) for i in range(6)]
    names = [NAMES[i % 4] for i in range(6)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = LLM(str(path), adapters=paths, num_blocks=256, block_size=4)
    expected = [o.token_ids for o in ref.generate(prompts, names, sp)]
    tight = LLM(str(path), adapters=paths, num_blocks=12, block_size=4, max_num_batched_tokens=6, max_num_seqs=6,
                attention="triton")
    assert [o.token_ids for o in tight.generate(prompts, names, sp)] == expected
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_decode(tmp_path):
    """fp32 so that the comparison is about the graph machinery, not bf16 rounding: requests of different
    lengths and adapters join and leave (batch sizes between buckets), every token equal to eager and PEFT."""
    path, paths, pm = build(tmp_path)
    prompts = [PROMPTS[i % 4] + [i + 20] * (i % 3) for i in range(7)]
    names = [NAMES[i % 4] for i in range(7)]
    sps = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(7)]
    kw = dict(adapters=paths, num_blocks=64, block_size=4, device="cuda", dtype="float32", max_num_seqs=8)
    eager = LLM(str(path), cuda_graphs=False, **kw)
    graphs = LLM(str(path), cuda_graphs=True, **kw)
    want = [o.token_ids for o in eager.generate(prompts, names, sps)]
    got = [o.token_ids for o in graphs.generate(prompts, names, sps)]
    g = graphs.engine.runner.graphs
    assert g is not None and g.num_replays > 0
    assert {lora for _, lora in g.graphs} == {False, True}          # base-only and LoRA iterations replayed
    assert got == want
    for p, a, sp, toks in zip(prompts, names, sps, got):
        assert toks == peft_greedy(pm, p, a, sp.max_tokens)
    # merged mode keeps graphs (no second pass); its requests' tokens are unchanged
    graphs.engine.merge_adapter("a8")
    merged = [o.token_ids for o in graphs.generate(prompts[2::4], "a8", sps[2::4])]
    assert merged == want[2::4]
