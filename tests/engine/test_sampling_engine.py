"""Sampling through the engine: seeded requests draw the same tokens alone, in a batch of mixed requests, after
preemption and recompute, and in the async loop; logprobs and prompt logprobs equal transformers' log-softmax."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_async_scheduling import requests, stub_llm
from tests.helpers import make_tiny_model
from vlora import LLM, SamplingParams

SEEDED = SamplingParams(max_tokens=12, temperature=1.3, top_p=0.9, top_k=40, seed=1234, ignore_eos=True,
                        presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.2,
                        logit_bias={7: 2.0, 9: -3.0})
PROMPT = [5, 17, 33, 2, 99, 120, 7, 8, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sampling"))


def engine(path, **kw) -> LLM:
    kw = {"num_blocks": 64, "block_size": 4, "max_model_len": 64, "dtype": "float32", "max_num_seqs": 64,
          "max_num_batched_tokens": 64, **kw}
    return LLM(str(path), device="cpu", **kw)


def others(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` requests of every kind of parameter: greedy, unseeded sampled, other seeds, penalties, logprobs."""
    prompts, params = [], []
    for i in range(n):
        prompts.append([(7 * i + j) % 200 + 3 for j in range(3 + i % 7)])
        params.append([SamplingParams(max_tokens=10, ignore_eos=True),
                       SamplingParams(max_tokens=10, temperature=0.9, ignore_eos=True),
                       SamplingParams(max_tokens=10, temperature=0.7, top_k=5, seed=i, ignore_eos=True),
                       SamplingParams(max_tokens=10, temperature=1.0, min_p=0.1, frequency_penalty=1.0,
                                      ignore_eos=True),
                       SamplingParams(max_tokens=10, temperature=0.5, top_p=0.5, logprobs=3, ignore_eos=True,
                                      min_tokens=4)][i % 5])
    return prompts, params


def test_seeded_request_alone_in_a_mixed_batch_and_after_preemption(tiny):
    path, _ = tiny
    alone = engine(path).generate([PROMPT], None, SEEDED)[0].token_ids
    assert len(set(alone)) > 3                       # it samples, not a constant
    prompts, params = others(63)
    batch = engine(path).generate(prompts[:31] + [PROMPT] + prompts[31:], None, params[:31] + [SEEDED] + params[31:])
    assert batch[31].token_ids == alone
    small = engine(path, num_blocks=24)              # the batch outgrows the pool: preemption and recompute
    outs = small.generate(prompts[:15] + [PROMPT], None, params[:15] + [SEEDED])
    assert small.engine.scheduler.num_preemptions > 0
    assert outs[-1].token_ids == alone
    other_seed = engine(path).generate([PROMPT], None, SamplingParams(**{**SEEDED.__dict__, "seed": 99}))[0]
    assert other_seed.token_ids != alone


def test_seeded_and_penalised_rows_equal_in_the_async_and_sync_loops():
    """The stub's logits are flat enough at temperature 30 that the draws are random; the async loop samples the
    next decode before this one's tokens are read, with the token counts kept on the device. (The stub's logits
    tie everywhere but one token, so no row truncates: which of tied tokens a top-k keeps is the sort's choice.)"""
    prompts, _ = requests(6, 4)
    sps = [SamplingParams(max_tokens=10, temperature=30.0, seed=i, ignore_eos=True, logprobs=i % 2,
                          presence_penalty=1.5 if i % 3 == 0 else 0.0) for i in range(len(prompts))]
    want = [o.token_ids for o in stub_llm(False).generate(prompts, None, sps)]
    llm = stub_llm(True)
    assert [o.token_ids for o in llm.generate(prompts, None, sps)] == want
    assert llm.engine.num_overlapped > 0
    alone = [stub_llm(True).generate([p], None, sp)[0].token_ids for p, sp in zip(prompts[:2], sps[:2])]
    assert alone == want[:2]


def test_a_seeded_request_resumed_from_its_tokens_continues_its_stream(tiny):
    """What the cluster front does when it moves a request: a new request of prompt + the tokens sent so far, with
    the same seed, draws the tokens the unmoved request drew next (repetition penalty and bias included: they
    see prompt and output alike)."""
    path, _ = tiny
    sp = SamplingParams(**{**SEEDED.__dict__, "presence_penalty": 0.0, "frequency_penalty": 0.0})
    llm = engine(path)
    whole = llm.generate([PROMPT], None, sp)[0].token_ids
    rest = SamplingParams(**{**sp.__dict__, "max_tokens": sp.max_tokens - 5})
    assert llm.generate([PROMPT + whole[:5]], None, rest)[0].token_ids == whole[5:]


def _reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_and_prompt_logprobs_equal_transformers(tiny):
    path, hf = tiny
    llm = engine(path, prefix_caching=True)
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=4, prompt_logprobs=2, ignore_eos=True,
                        presence_penalty=1.0, logit_bias={11: 5.0})
    for _ in range(2):                               # the second run's prompt is cached: still scored in full
        out = llm.generate([PROMPT], None, sp)[0]
        ref = _reference_logprobs(hf, PROMPT + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 6
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(PROMPT) - 1 + j]
            assert lp.token_id == tok and lp.logprob == pytest.approx(row[tok].item(), abs=1e-4)
            top = row.topk(4)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
        for p in range(1, len(PROMPT)):
            got, row = out.prompt_logprobs[p], ref[p - 1]
            assert got.token_id == PROMPT[p] and got.logprob == pytest.approx(row[PROMPT[p]].item(), abs=1e-4)
            assert [t for t, _ in got.top] == row.topk(2).indices.tolist()


def test_prompt_logprobs_across_prefill_chunks_and_without_logprobs(tiny):
    path, hf = tiny
    llm = engine(path, max_num_batched_tokens=4, max_num_seqs=4)   # the prompt is prefilled 4 tokens at a time
    out = llm.generate([PROMPT], None, SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    ref = _reference_logprobs(hf, PROMPT)
    assert out.logprobs is None and out.cumulative_logprob is None
    assert [lp.top for lp in out.prompt_logprobs[1:]] == [()] * (len(PROMPT) - 1)
    assert [lp.logprob for lp in out.prompt_logprobs[1:]] == pytest.approx(
        [ref[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))], abs=1e-4)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny):
    from vlora.engine.engine import RequestError

    path, _ = tiny
    llm = engine(path)
    with pytest.raises(RequestError, match="logit_bias") as e:
        llm.engine.add_request(PROMPT, None, SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.param == "logit_bias"
    assert not llm.engine.has_unfinished()
