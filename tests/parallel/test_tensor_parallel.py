"""Tensor parallelism on the CPU (gloo, 2 processes): the same tokens and logits as one process, for a batch of
base rows and adapters of ranks 4/8/16 with chunked prefill, preemption, prefix caching, and merged and mixed
modes, on the torch paths and on the Triton kernels (interpreted) with the decode graphs' emulation; a killed
worker ends the run with a clear error."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import make_peft_adapter, make_tiny_model, prefill_logits
from vlora import LLM, SamplingParams
from vlora.engine.faults import EngineFatal
from vlora.engine.modes import Mode
from vlora.engine.sequence import Sequence

RANKS = {"a4": 4, "a8": 8, "a16": 16}
TARGETS = {"a4": ["q_proj", "v_proj"], "a8": None, "a16": ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
PROMPTS = [[5, 17, 33, 2, 99, 120, 7, 8, 9], [1, 2, 3], [250, 4, 4, 4, 9, 31, 77, 12, 13, 14, 200], [42, 43],
           [7, 7, 8, 200, 3]]
NAMES = [None, "a4", "a8", "a16", "a8"]
BLOCKS = 14           # the batch outgrows it: the newest sequences are preempted and recomputed


def build(root, kv_heads, model_type="llama", **overrides):
    path, hf = make_tiny_model(root, model_type, num_key_value_heads=kv_heads, **overrides)
    adapters = {}
    for i, (name, rank) in enumerate(RANKS.items()):
        kw = {} if TARGETS[name] is None else {"targets": TARGETS[name]}
        adapters[name] = make_peft_adapter(hf, root / name, rank, seed=10 + i, **kw)
    return path, adapters


def engine(path, adapters, tp, **kw):
    return LLM(str(path), adapters=adapters, num_blocks=BLOCKS, block_size=4, max_model_len=128, dtype="float32",
               max_num_seqs=8, max_num_batched_tokens=8, tensor_parallel_size=tp, **kw)   # prefill in chunks


def logits(llm, prompts=PROMPTS):
    eng = llm.engine
    return prefill_logits(eng, [Sequence(f"t{i}", list(p), SamplingParams(), None if a is None else eng.adapters.get(a),
                                         i) for i, (p, a) in enumerate(zip(prompts, NAMES))])


def greedy(llm, tokens=8, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, NAMES, SamplingParams(max_tokens=tokens, ignore_eos=True))]


def twice(llm):
    """The batch, then again (its prompts' blocks found in the prefix cache)."""
    first = greedy(llm)
    hits = llm.engine.prefix_cache.hit_tokens
    second = greedy(llm)
    assert llm.engine.prefix_cache.hit_tokens > hits
    return first + second


def close(got, want):
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


def test_tp2_matches_one_process_and_a_killed_worker_fails_fast(tiny_llama):
    path, adapters = tiny_llama
    one = engine(path, adapters, 1, prefix_caching=True)
    want_logits, want_tokens = logits(one), twice(one)
    two = engine(path, adapters, 2, prefix_caching=True)
    try:
        assert two.engine.pool.kv.shape[-2] == 1                     # each rank keeps its own KV head only
        close(logits(two), want_logits)
        assert twice(two) == want_tokens
        assert two.engine.scheduler.num_preemptions > 0
        ran = two.engine.orchestrator.mode_iterations
        two.engine.merge_adapter("a8")               # each rank folds its slices of a8 into its shard
        assert greedy(two) == want_tokens[:5] and ran[Mode.MIXED] > 0
        only = two.generate([PROMPTS[2], PROMPTS[4]], "a8", SamplingParams(max_tokens=8, ignore_eos=True))
        assert [o.token_ids for o in only] == [want_tokens[2], want_tokens[4]] and ran[Mode.MERGED] > 0
        two.engine.unmerge_adapter()
        unmerged = ran[Mode.UNMERGED]
        assert greedy(two) == want_tokens[:5] and ran[Mode.UNMERGED] > unmerged
        two.engine.prefix_cache.clear()
        assert two.engine.allocator.num_free == BLOCKS
        two.engine.add_request(PROMPTS[0], "a8", SamplingParams(max_tokens=50, ignore_eos=True))
        two.engine.step()
        worker = two.engine.model.group.procs[0]
        worker.kill()
        t0 = time.monotonic()
        dead = "^(tensor-parallel worker 1 exited|the tensor-parallel group failed)"
        with pytest.raises(EngineFatal, match=dead):
            for _ in range(50):
                two.engine.step()
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineFatal):                             # the group stays failed
            two.engine.step()
    finally:
        two.close()


SHORT = [p[:5] for p in PROMPTS]      # the interpreter runs a kernel's programs one at a time: few tokens


def test_tp2_triton_kernels_and_decode_graphs_match_one_process(one_layer_llama):
    """Each rank's pool holds its slices of the adapters where rank 0's store put its own; when the store moves
    them (evicted, placed again elsewhere), the workers follow. Decode iterations replay the graphs on every
    rank (their CPU emulation), in mixed mode too."""
    path, adapters = one_layer_llama
    one = engine(path, adapters, 1)
    want_logits, want_tokens, want_more = logits(one, SHORT), greedy(one, 3, SHORT), greedy(one, 8, SHORT)
    two = LLM(str(path), adapters=adapters, num_blocks=130, block_size=4, max_model_len=128, dtype="float32",
              max_num_seqs=8, max_num_batched_tokens=8, prefix_caching=True, tensor_parallel_size=2,
              kernels="triton", lora_kernel="triton", max_loras=0, max_lora_rank=16)   # 122 pages hold the adapters
    try:
        eng = two.engine
        eng.runner.enable_graphs(8, eng.max_model_len, columns=2)
        close(logits(two, SHORT), want_logits)
        graphs, store = eng.runner.graphs, eng.adapters.store
        first = store.resident["a16"].placement.host["qkv"][0]       # placed last of three: the lowest pages
        assert greedy(two, 3, SHORT) == want_tokens
        assert graphs.num_replays > 0
        store.protected = set()
        store.reclaim(store.pool.num_pages)              # every adapter out; a16 back first: new offsets for all
        store.ensure([eng.adapters.get("a16")], set())
        assert store.resident["a16"].placement.host["qkv"][0] != first
        eng.merge_adapter("a8")              # mixed mode: the others add theirs and subtract a8's slices
        ran, hits = eng.orchestrator.mode_iterations, eng.prefix_cache.hit_tokens
        assert greedy(two, 3, SHORT) == want_tokens and ran[Mode.MIXED] > 0
        assert eng.prefix_cache.hit_tokens > hits                 # the base-model prompt's blocks
        assert any(kind == 2 for _, kind, _ in graphs.graphs)
        # async scheduling (nothing merged), once the graphs of these batches are captured (a first capture runs
        # synchronously): decodes queued behind one another, the workers' rows reading the tokens rank 0 sampled
        # (broadcast from its device) in place of ones not yet on the host
        eng.unmerge_adapter()
        assert greedy(two, 8, SHORT) == want_more and eng.num_overlapped > 0
    finally:
        two.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_two_gpus_gives_the_tokens_of_one(tiny_llama):
    path, adapters = tiny_llama
    kw = dict(adapters=adapters, num_blocks=BLOCKS, block_size=4, max_model_len=128, dtype="float32", device="cuda",
              max_num_seqs=8, max_num_batched_tokens=8, kernels="torch", lora_kernel="torch")
    want = greedy(LLM(str(path), **kw))
    two = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        assert greedy(two) == want
    finally:
        two.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("all_reduce", ["nccl", "symm_mem", "auto"])
def test_tp2_cuda_graph_decode_on_two_gpus_equals_one_gpu_eager(tiny_llama, all_reduce):
    """Triton kernels, adapters in each rank's pool and decode replayed from CUDA graphs captured on both ranks
    (their all-reduces inside), against one GPU running eagerly; then in mixed mode."""
    path, adapters = tiny_llama
    kw = dict(adapters=adapters, num_blocks=BLOCKS, block_size=4, max_model_len=128, dtype="float32", device="cuda",
              max_num_seqs=8, max_num_batched_tokens=8)
    one = LLM(str(path), cuda_graphs=False, **kw)
    want = greedy(one)
    one.engine.merge_adapter("a8")
    want_mixed = greedy(one)
    two = LLM(str(path), tensor_parallel_size=2, all_reduce=all_reduce, **kw)
    try:
        if all_reduce == "auto":           # calibrated at start-up: both kinds timed at every decode size
            timings = two.engine.model.all_reduce_timings
            assert timings and all(t["nccl_ms"] > 0 and t["one_shot_ms"] > 0 for t in timings)
        graphs = two.engine.runner.graphs
        assert graphs is not None and two.engine.runner.use_kernels
        two.engine.runner.capture_graphs(mixed=True)      # every rank captures the same graphs, in order
        assert greedy(two) == want and graphs.num_replays > 0
        two.engine.merge_adapter("a8")
        replays = graphs.num_replays
        assert greedy(two) == want_mixed and graphs.num_replays > replays
    finally:
        two.close()


KILL_SCRIPT = """
import sys
from vlora import LLM, SamplingParams

if __name__ == "__main__":
    path, a8, all_reduce = sys.argv[1], sys.argv[2], sys.argv[3]
    llm = LLM(path, adapters={"a8": a8}, block_size=4, num_blocks=64, max_model_len=128, dtype="float32",
              device="cuda", tensor_parallel_size=2, all_reduce=all_reduce)
    llm.generate([[1, 2, 3]], "a8", SamplingParams(max_tokens=4, ignore_eos=True))     # graphs captured
    eng = llm.engine
    eng.add_request([5, 6, 7], "a8", SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.model.group.procs[0].kill()
    while True:
        eng.step()
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("all_reduce", ["nccl", "auto"])
def test_tp2_worker_killed_during_graph_decode_ends_the_process(tiny_llama, tmp_path, all_reduce):
    """A collective replayed from a CUDA graph has no timeout: the process must still end, non-zero, saying why
    (EngineFatal, or rank 0's watchdog when it is blocked on the GPU), also where the one-shot all-reduce (a
    kernel that waits for its peer's signal) is in the graphs."""
    import subprocess
    import sys

    path, adapters = tiny_llama
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    t0 = time.monotonic()
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script), str(path), str(adapters["a8"]), all_reduce],
                          capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert proc.returncode != 0 and "tensor-parallel" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 240


def test_tp2_adapter_reloaded_under_its_name_while_merged_reaches_the_workers(tiny_llama):
    """An adapter merged, unloaded, and another loaded under the same name and merged: every rank serves the new
    one (a worker that compared the merged adapter by name kept the old one folded into its shard)."""
    path, adapters = tiny_llama
    one = engine(path, {"a16": adapters["a16"]}, 1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in one.generate([PROMPTS[2]], "a16", params)]
    two = engine(path, {"a8": adapters["a8"]}, 2)
    try:
        two.engine.merge_adapter("a8")
        ran = two.engine.orchestrator.mode_iterations
        two.generate([PROMPTS[2]], "a8", params)
        merged = ran[Mode.MERGED]
        assert merged > 0
        two.engine.unregister_adapter("a8")
        two.register_adapter("a8", adapters["a16"])      # the same name, other weights
        two.engine.merge_adapter("a8")
        assert [o.token_ids for o in two.generate([PROMPTS[2]], "a8", params)] == want
        assert ran[Mode.MERGED] > merged
    finally:
        two.close()


def test_tp2_seeded_sampling_and_logprobs_equal_one_process(tiny_llama):
    """A seeded sampled request (penalties, bias, logprobs) gives the tokens of one process: rank 0 samples, and
    the sampler's noise depends only on the seed, the position and the token."""
    path, adapters = tiny_llama
    sp = SamplingParams(max_tokens=8, temperature=1.2, top_p=0.95, top_k=30, seed=7, ignore_eos=True,
                        presence_penalty=0.5, repetition_penalty=1.3, logit_bias={4: 3.0}, logprobs=2)
    got, want = one_and_two(path, adapters, PROMPTS, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert [t.logprob for t in g.logprobs] == pytest.approx([t.logprob for t in w.logprobs], abs=1e-4)


def one_and_two(path, adapters, prompts, sp, check=None):
    """The outputs of ``prompts`` at TP=2 and at TP=1 (``check`` sees the TP=2 engine before it generates)."""
    want = engine(path, adapters, 1).generate(prompts, NAMES, sp)
    two = engine(path, adapters, 2)
    try:
        if check is not None:
            check(two)
        return two.generate(prompts, NAMES, sp), want
    finally:
        two.close()


def test_tp2_vocab_parallel_head_and_embedding_give_the_logprobs_of_one_process(tmp_path):
    """Each rank holds half the vocabulary's rows of the (tied) embedding and LM head, the last rank's padded (301
    tokens): lookups summed, logits gathered, eagerly (prompt logprobs, prefill) and in the decode graphs'
    emulation; the tokens, their logprobs and the prompt logprobs are one process's."""
    path, adapters = build(tmp_path, kv_heads=2, vocab_size=301, tie_word_embeddings=True)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompts = [p + [300, 299] for p in PROMPTS]           # ids of the last rank's slice

    def halves(two):
        inner = two.engine.model.inner
        assert inner.embed.weight.shape[0] == 151 and inner.lm_head is None
        assert inner.vocab_part.shard.start == 0

    got, want = one_and_two(path, adapters, prompts, sp, halves)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert [t.logprob for t in g.logprobs] == pytest.approx([t.logprob for t in w.logprobs], abs=1e-4)
        assert [[i for i, _ in t.top] for t in g.logprobs] == [[i for i, _ in t.top] for t in w.logprobs]
        gp, wp = g.prompt_logprobs[1:], w.prompt_logprobs[1:]       # the first prompt token has none
        assert len(gp) == len(wp) > 0
        assert [t.logprob for t in gp] == pytest.approx([t.logprob for t in wp], abs=1e-4)
        assert [[i for i, _ in t.top] for t in gp] == [[i for i, _ in t.top] for t in wp]


def test_tp2_mixture_of_experts_gives_the_tokens_of_one_process(tmp_path):
    """Qwen3-MoE at TP=2: each rank holds half of every expert's width (the router whole, so both route alike)
    and the experts' partial outputs are summed; with attention adapters, the prompts' logits and the greedy
    tokens equal one process's."""
    from tests.models.test_architectures import build as build_arch

    path, adapters, _ = build_arch(tmp_path, "qwen3_moe")
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    seen = {}

    def halves(two):
        layer = two.engine.model.inner.layers[0]
        assert layer.experts_down.per_expert().shape == (8, 64, 16)          # 8 experts, hidden 64, width 32 / 2
        seen["logits"] = logits(two)

    got, want = one_and_two(path, adapters, PROMPTS, sp, halves)
    close(seen["logits"], logits(engine(path, adapters, 1)))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_tp2_random_preset_gives_the_tokens_of_one_process():
    """A ``random:<preset>`` model's shards hold the whole seeded model's values (each weight drawn whole, in
    pieces, and sliced), so TP=2 gives TP=1's greedy tokens, as a checkpoint does."""
    kw = dict(num_blocks=BLOCKS * 4, block_size=4, max_model_len=128, dtype="float32", device="cpu", seed=5)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM("random:tiny-llama", **kw).generate(PROMPTS, None, sp)]
    two = LLM("random:tiny-llama", tensor_parallel_size=2, **kw)
    try:
        got = [o.token_ids for o in two.generate(PROMPTS, None, sp)]
    finally:
        two.close()
    assert got == want


def fastlibra_chats(path, adapters, **kw):
    """Four chats' first turns, then their second turns (history + answer + a new message), at TP=1 and under
    TP=2 with FastLibra's swapper and a pool too small for the chats' cached KV: the tokens of both, and the
    swapper's counts."""
    firsts = [[5, 17, 33, 2, 99, 120, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9],
              [250, 4, 4, 4, 9, 31, 77, 12, 13, 14, 200, 201], [42, 43, 44, 45, 46, 47, 48, 49]]
    names = [None, "a4", "a8", "a16"]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)

    def chats(llm):
        answers = [llm.generate([p], [a], sp)[0].token_ids for p, a in zip(firsts, names)]
        follow = [p + list(o) + [60 + i, 61] for i, (p, o) in enumerate(zip(firsts, answers))]
        return answers + [llm.generate([p], [a], sp)[0].token_ids for p, a in zip(follow, names)]
    want = chats(engine(path, adapters, 1, **kw))
    two = engine(path, adapters, 2, prefix_caching=True, memory_policy="fastlibra", **kw)
    try:
        got = chats(two)
        sw = two.engine.swapper
        return got, want, (sw.swapped_out, sw.swapped_in, two.engine.prefix_cache.hit_tokens)
    finally:
        two.close()


def test_tp2_fastlibra_swaps_keep_the_tokens_of_one_process(tiny_llama):
    """FastLibra's swapper under TP=2: blocks go to host memory and come back on every rank alike (the workers
    copy their slices in rank 0's order), so each chat's second turn, its history found in host memory, gives
    one process's tokens."""
    got, want, (out, back, hits) = fastlibra_chats(*tiny_llama, device="cpu")
    assert got == want
    assert out > 0 and back > 0 and hits > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_fastlibra_swaps_on_two_gpus_keep_the_tokens_of_one(tiny_llama):
    """The same on two GPUs: Triton kernels, adapters in each rank's pool, rank 0's copies on its copy streams
    into pinned memory, the workers' on their own streams."""
    got, want, (out, back, hits) = fastlibra_chats(*tiny_llama, device="cuda")
    assert got == want
    assert out > 0 and back > 0 and hits > 0
