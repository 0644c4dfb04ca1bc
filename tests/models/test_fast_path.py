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
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4, kernels="triton", lora_kernel="triton")
    assert llm.engine.runner.use_kernels
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
                kernels="triton")
    assert [o.token_ids for o in tight.generate(prompts, names, sp)] == expected
    assert tight.engine.scheduler.num_preemptions > 0


GRAPH_PROMPTS = [PROMPTS[i % 4] + [i + 20] * (i % 3) for i in range(7)]
GRAPH_NAMES = [NAMES[(i + 2) % 4] for i in range(7)]        # the longest-running request is a base-model one
GRAPH_SPS = [SamplingParams(max_tokens=3 + i, min_tokens=3 + i, ignore_eos=True) for i in range(7)]


def check_graph_decode(path, paths, pm, **kw):
    """Requests of different lengths and adapters join and leave (batch sizes between buckets, LoRA segments
    split into tile-high pieces): every token equal to PEFT's (which the eager engine's equal: test_parity)."""
    want = [peft_greedy(pm, p, a, sp.max_tokens) for p, a, sp in zip(GRAPH_PROMPTS, GRAPH_NAMES, GRAPH_SPS)]
    kw = {"policy": "unmerged", **kw}                    # the modes switched by hand only
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128, **kw)
    if llm.engine.runner.graphs is None:                 # CPU: the emulation (same buffers, re-run forward)
        llm.engine.runner.enable_graphs(8, llm.engine.max_model_len, columns=2)    # 3 adapters: tables grow
    got = [o.token_ids for o in llm.generate(GRAPH_PROMPTS, GRAPH_NAMES, GRAPH_SPS)]
    g = llm.engine.runner.graphs
    assert g.num_replays > 0
    assert {kind for _, kind, _ in g.graphs} == {0, 1}                 # base-only and LoRA iterations replayed
    assert got == want
    llm.engine.merge_adapter("a8")      # merged mode replays graphs too (no second pass); same tokens
    merged = [o.token_ids for o in llm.generate(GRAPH_PROMPTS[0::4], "a8", GRAPH_SPS[0::4])]
    assert merged == want[0::4]
    replays = g.num_replays             # mixed mode (a8 merged, the others add theirs and subtract it): its graphs
    mixed = [o.token_ids for o in llm.generate(GRAPH_PROMPTS[:4], GRAPH_NAMES[:4], GRAPH_SPS[:4])]   # every name
    assert mixed == want[:4]
    assert g.num_replays > replays and g.mixed_kind in {kind for _, kind, _ in g.graphs}    # one launch by default
    assert llm.engine.runner.modes.merged is not None
    llm.engine.pool.check()
    assert llm.engine.pool.kv_pages == 0                   # every KV block came back


def test_graph_decode_buffers_on_cpu(tmp_path):
    """The graph path's static buffers, padding rows, scratch slot and segment splitting, emulated on a CPU
    with the Triton kernels in the interpreter."""
    path, paths, pm = build(tmp_path)
    check_graph_decode(path, paths, pm, kernels="triton", lora_kernel="triton")


def mixed_graphs_engine(path, paths, pm, n: int = len(GRAPH_PROMPTS), **kw):
    """An engine that prefills at most 6 prompt tokens beside decodes within a token budget of 8 (every prompt
    is admitted while others decode, some in two chunks, several chunks in one iteration), those iterations
    replayed from mixed graphs (emulated on a CPU); and PEFT's tokens of the first ``n`` graph requests."""
    want = [peft_greedy(pm, p, a, sp.max_tokens) for p, a, sp in zip(GRAPH_PROMPTS[:n], GRAPH_NAMES, GRAPH_SPS)]
    kw = {"policy": "unmerged", **kw}                    # the modes switched by hand only
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128,
              max_num_batched_tokens=8, max_prefill_tokens_with_decodes=6, **kw)
    assert llm.engine.config.scheduler.max_prefill_tokens_with_decodes == 6
    if llm.engine.runner.graphs is None:                 # CPU: the emulation
        llm.engine.runner.enable_graphs(8, llm.engine.max_model_len, columns=2, mixed_tokens=6)
    return llm, want


def test_mixed_graph_iteration_that_samples_no_row_on_cpu(tmp_path):
    """A prompt alone, longer than the token budget: its first chunk, replayed from a mixed graph with no
    decode beside it, samples nothing (no row's logits are kept); the tokens are PEFT's."""
    path, paths, pm = build(tmp_path)
    llm, _ = mixed_graphs_engine(path, paths, pm, 0, kernels="triton", lora_kernel="triton")
    prompt = PROMPTS[0] + PROMPTS[1] + PROMPTS[2]
    assert len(prompt) > 8
    out = llm.generate([prompt], [NAMES[1]], SamplingParams(max_tokens=3, min_tokens=3, ignore_eos=True))
    assert out[0].token_ids == peft_greedy(pm, prompt, NAMES[1], 3)
    assert llm.engine.runner.iterations["mixed_graph"] > 0


def check_mixed_graphs(path, paths, pm, **kw):
    """Prompts prefilled beside decodes replay mixed graphs, base-only and with LoRA: every token equal to
    PEFT's. Prompts that want their logprobs run eagerly. (V-LoRA's mixed mode: tests/engine/test_modes.py.)"""
    llm, want = mixed_graphs_engine(path, paths, pm, **kw)
    g = llm.engine.runner.graphs
    assert g.mixed_buckets
    got = [o.token_ids for o in llm.generate(GRAPH_PROMPTS, GRAPH_NAMES, GRAPH_SPS)]
    assert got == want
    base = [o.token_ids for o in llm.generate(GRAPH_PROMPTS[::4], None, GRAPH_SPS[::4])]    # no adapter at all
    assert base == [peft_greedy(pm, p, None, sp.max_tokens) for p, sp in zip(GRAPH_PROMPTS[::4], GRAPH_SPS[::4])]
    assert {(kind, mixed) for _, kind, mixed in g.graphs} >= {(0, True), (1, True)}
    counted = dict(llm.engine.runner.iterations)           # forwards by how they ran (vlora_iterations_total)
    assert counted["mixed_graph"] > 0 and counted["decode_graph"] > 0, counted
    replays = g.num_replays
    out = llm.generate(GRAPH_PROMPTS[:2], GRAPH_NAMES[:2],
                       [SamplingParams(max_tokens=3, min_tokens=3, ignore_eos=True, prompt_logprobs=1)] * 2)
    assert [o.token_ids for o in out] == [w[:3] for w in want[:2]]
    assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(out, GRAPH_PROMPTS[:2]))
    assert g.num_replays > replays                          # their decodes still replay
    after = llm.engine.runner.iterations
    assert after["eager"] > counted["eager"] and after["decode_graph"] > counted["decode_graph"]
    # a mixed graph captured on first use that runs out of device memory: its iterations run eagerly, the
    # same tokens, and it is not tried again
    dropped = [k for k in g.graphs if k[2]]
    for k in dropped:
        del g.graphs[k]
    tried = []

    def out_of_memory(b, kind, mixed):
        tried.append((b, kind, mixed))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test's)")
    capture, g.capture = g.capture, out_of_memory
    try:
        before = dict(llm.engine.runner.iterations)
        half = len(GRAPH_PROMPTS) // 2
        got = llm.generate(GRAPH_PROMPTS[:half], GRAPH_NAMES[:half], GRAPH_SPS[:half])
        assert [o.token_ids for o in got] == want[:half]
    finally:
        g.capture = capture
    assert tried and len(tried) == len(set(tried)) and g.uncapturable == set(tried)
    assert llm.engine.runner.iterations["mixed_graph"] == before["mixed_graph"]
    assert llm.engine.runner.iterations["eager"] > before["eager"]
    llm.engine.pool.check()
    assert llm.engine.pool.kv_pages == 0


def test_mixed_graphs_on_cpu(tmp_path):
    """Mixed graphs' static buffers (decode rows, chunk slots, padding, segments over both), emulated on a CPU
    with the Triton kernels in the interpreter."""
    path, paths, pm = build(tmp_path)
    check_mixed_graphs(path, paths, pm, kernels="triton", lora_kernel="triton")


@pytest.mark.gpu
def test_cuda_mixed_graphs_equal_peft(tmp_path):
    path, paths, pm = build(tmp_path)
    check_mixed_graphs(path, paths, pm, device="cuda", dtype="float32")


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_decode(tmp_path):
    """fp32, so that the comparison is about the graph machinery, not bf16 rounding."""
    path, paths, pm = build(tmp_path)
    check_graph_decode(path, paths, pm, device="cuda", dtype="float32")


def check_graph_columns(path, paths, columns, **kw):
    """Adapter columns of the graphs' offset tables: reused for adapters that left the pool, grown (with a
    recapture of the LoRA graphs, even when no other graph holds their memory) when all are in use."""
    names = {f"x{i}": paths[n] for i, n in enumerate(["a4", "a8", "a16", "a4", "a8", "a16"])}
    prompts = [PROMPTS[i % 4] for i in range(6)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    eager = LLM(str(path), adapters=names, num_blocks=64, block_size=4, max_num_seqs=4, cuda_graphs=False, **kw)
    want = [eager.generate([p], [n], sp)[0].token_ids for p, n in zip(prompts, names)]
    llm = LLM(str(path), adapters=names, num_blocks=8, block_size=4, max_num_seqs=4, max_lora_rank=16, max_model_len=128,
              **kw)
    llm.engine.runner.enable_graphs(4, llm.engine.max_model_len, columns=columns)
    got = [llm.generate([p], [n], sp)[0].token_ids for p, n in zip(prompts, names)]
    assert got == want
    g = llm.engine.runner.graphs
    assert g.num_replays > 0 and {lora for _, lora, _ in g.graphs} == {True}
    return g, llm.engine.adapters.store


def test_graph_columns_are_recycled_on_cpu(tmp_path):
    path, paths, _ = build(tmp_path)
    g, store = check_graph_columns(path, paths, 2, kernels="triton", lora_kernel="triton", max_loras=1)
    assert store.num_evictions > 0
    assert next(iter(g.col_tables.values()))[0].shape[1] <= 4     # bounded by adapters resident at once


@pytest.mark.gpu
def test_cuda_graph_columns_grow_and_recycle(tmp_path):
    path, paths, _ = build(tmp_path)
    check_graph_columns(path, paths, 1, device="cuda", dtype="float32")
