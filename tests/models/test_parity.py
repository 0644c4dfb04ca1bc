"""Parity with transformers + PEFT (mixed-batch ``adapter_names``) on tiny random configs."""

from __future__ import annotations

import peft
import pytest
import torch

from tests.helpers import make_peft_adapter, make_tiny_model, prefill_logits
from vlora import LLM, SamplingParams
from vlora.engine.sequence import Sequence

RANKS = {"a4": 4, "a8": 8, "a16": 16}
TARGETS = {"a4": ["q_proj", "v_proj"], "a8": None, "a16": ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
PROMPTS = [[5, 17, 33, 2, 99, 120, 7], [1, 2, 3], [250, 4, 4, 4, 9, 31, 77, 12, 13, 14, 200], [42, 43]]
NAMES = [None, "a4", "a8", "a16"]


def build(tmp_path, model_type="llama", **overrides):
    path, hf = make_tiny_model(tmp_path, model_type, name=f"tiny-{model_type}", **overrides)
    paths = {}
    for i, (name, r) in enumerate(RANKS.items()):
        kw = {"targets": TARGETS[name]} if TARGETS[name] else {}
        paths[name] = make_peft_adapter(hf, tmp_path / name, r, seed=10 + i, use_rslora=(name == "a8"), **kw)
    pm = peft.PeftModel.from_pretrained(hf, str(paths["a4"]), adapter_name="a4")
    for name in ("a8", "a16"):
        pm.load_adapter(str(paths[name]), adapter_name=name)
    pm.eval()
    return path, paths, pm


def peft_logits(pm, prompts, names) -> list[torch.Tensor]:
    """Logits of every prompt position, one mixed batch, right padding."""
    n = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (n - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in prompts])
    with torch.no_grad():
        logits = pm(input_ids=ids, attention_mask=mask, adapter_names=[a or "__base__" for a in names]).logits
    return [logits[i, :len(p)] for i, p in enumerate(prompts)]


def vlora_logits(llm: LLM, prompts, names) -> list[torch.Tensor]:
    """Logits of every prompt position, all prompts prefilled in one iteration."""
    eng = llm.engine
    adapter = lambda a: None if a is None else eng.adapters.get(a)        # noqa: E731
    return prefill_logits(eng, [Sequence(f"t{i}", list(p), SamplingParams(), adapter(a), i)
                                for i, (p, a) in enumerate(zip(prompts, names))])


def peft_greedy(pm, prompt, name, max_new_tokens) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      min_new_tokens=max_new_tokens, do_sample=False, adapter_names=[name or "__base__"])
        return pm.generate(**kwargs)[0, len(prompt):].tolist()


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    ("qwen2", {}),
    ("mistral", {"sliding_window": 4}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
])
def test_mixed_batch_logits_match_peft(tmp_path, model_type, overrides):
    path, paths, pm = build(tmp_path, model_type, **overrides)
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4)
    ours = vlora_logits(llm, PROMPTS, NAMES)
    refs = peft_logits(pm, PROMPTS, NAMES)
    for a, r, name in zip(ours, refs, NAMES):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4 * r.abs().max().item(), msg=f"adapter {name}")


def test_triton_kernel_path_matches_peft(tmp_path):
    """The engine's ATMM path (Triton interpreter on CPU) gives PEFT's mixed-batch logits."""
    path, paths, pm = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4, lora_kernel="triton")
    assert llm.engine.runner.tiling is not None
    ours = vlora_logits(llm, PROMPTS, NAMES)
    for a, r, name in zip(ours, peft_logits(pm, PROMPTS, NAMES), NAMES):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4 * r.abs().max().item(), msg=f"adapter {name}")
    llm.unregister_adapter("a8")                     # its buffer range is reused by the next adapter
    llm.register_adapter("a8b", paths["a8"])
    again = vlora_logits(llm, PROMPTS, [None, "a4", "a8b", "a16"])
    torch.testing.assert_close(again[2], ours[2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_cuda_engine_with_atmm_matches_peft(tmp_path, dtype, tol):
    path, paths, pm = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=32, block_size=4, device="cuda", dtype=dtype)
    assert llm.engine.runner.tiling is not None
    ours = vlora_logits(llm, PROMPTS, NAMES)
    for a, r, name in zip(ours, peft_logits(pm, PROMPTS, NAMES), NAMES):
        a = a.float().cpu()
        assert (a - r).norm() / r.norm() <= tol, f"adapter {name}"


def test_concurrent_greedy_requests_arriving_at_different_iterations(tmp_path):
    path, paths, pm = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4)
    eng, n_new = llm.engine, 12
    ids, tokens = {}, {}
    for i, (p, a) in enumerate(zip(PROMPTS, NAMES)):
        ids[eng.add_request(p, a, SamplingParams(max_tokens=n_new, min_tokens=n_new, ignore_eos=True))] = i
        for _ in range(i + 1):                     # request i+1 joins a batch already decoding
            for out in eng.step():
                tokens[ids[out.request_id]] = out.token_ids
    while eng.has_unfinished():
        for out in eng.step():
            tokens[ids[out.request_id]] = out.token_ids
    for i, (p, a) in enumerate(zip(PROMPTS, NAMES)):
        assert tokens[i] == peft_greedy(pm, p, a, n_new), f"request {i} on {a}"


def test_preemption_and_chunked_prefill_keep_tokens_identical(tmp_path):
    path, paths, _ = build(tmp_path)
    prompts = [PROMPTS[i % 4] + [i + 20] * (i % 5) for i in range(8)]
    names = [NAMES[i % 4] for i in range(8)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy = LLM(str(path), adapters=paths, num_blocks=256, block_size=4)
    expected = [o.token_ids for o in roomy.generate(prompts, names, sp)]
    assert roomy.engine.scheduler.num_preemptions == 0
    tight = LLM(str(path), adapters=paths, num_blocks=14, block_size=4, max_num_batched_tokens=8, max_num_seqs=8)
    got = [o.token_ids for o in tight.generate(prompts, names, sp)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.allocator.num_free == 14      # every block came back


def test_seeded_sampling_does_not_depend_on_batch(tmp_path):
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=128, block_size=4)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], ["a8"], sp)[0].token_ids
    batch = llm.generate(PROMPTS, NAMES[:1] + ["a8"] * 3, [sp] * 4)
    assert batch[2].token_ids == alone
    assert batch[1].token_ids != alone or batch[1].prompt_token_ids == PROMPTS[2]
