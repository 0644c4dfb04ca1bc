"""LMMs under tensor parallelism (gloo, 2 processes): the vision tower on rank 0, the language model split; the
same logits and greedy tokens as one process for tiny random LLaVA (with a task head) and Qwen2-VL (M-RoPE)
batches of images, videos, text, base rows and adapters."""

from __future__ import annotations

import pytest

from tests.models import test_qwen2_vl as qwen
from tests.models import test_vision as llava
from tests.models.test_vision import close, our_logits, with_adapters, write_head
from vlora import LLM, SamplingParams


def _outputs(llm, cases, params):
    prompts, images, names = zip(*cases)
    outs = llm.generate(list(prompts), list(names), list(params), images=list(images))
    return [(o.token_ids, None if o.task is None else o.task.label) for o in outs]


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_lmm_tp2_matches_one_process(tmp_path, kind):
    make, cases = (llava.make_tiny_llava, llava.CASES) if kind == "llava" else (qwen.make_tiny_qwen2_vl, qwen.CASES)
    path, hf = make(tmp_path)
    paths, _ = with_adapters(tmp_path, hf)
    gen = SamplingParams(max_tokens=3, min_tokens=3, ignore_eos=True)
    params = [gen] * len(cases)
    if kind == "llava":                      # a task head reads the last hidden state (rank 0's, whole)
        paths["a8h"] = write_head(paths["a8"], tmp_path / "a8h", ["car", "bus", "bike"], seed=2)[0]
        cases = cases + [(cases[2][0], cases[2][1], "a8h")]
        params = params + [SamplingParams(task_head=True)]
    kw = dict(adapters=paths, num_blocks=96, block_size=4, dtype="float32", max_num_batched_tokens=24)
    one = LLM(str(path), **kw)
    want_logits, want = our_logits(one, cases), _outputs(one, cases, params)
    two = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        assert two.engine.vision is not None          # rank 0 encodes; the workers get the embeddings
        for got, ref in zip(our_logits(two, cases), want_logits):
            close(got, ref)
        assert _outputs(two, cases, params) == want
        if kind == "llava":
            assert want[-1][1] is not None
    finally:
        two.close()
