"""Engine behaviour on a tiny random model: bad input is refused cleanly, aborts free memory."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import make_peft_adapter, make_tiny_model
from vlora import LLM, SamplingParams
from vlora.engine.engine import RequestError
from vlora.lora.adapter import AdapterError
from vlora.sampling_params import SamplingError

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    path, hf = make_tiny_model(root)
    a = make_peft_adapter(hf, root / "a", 8, seed=1)
    return path, {"a": a}, root


@pytest.fixture
def llm(tiny):
    path, adapters, _ = tiny
    return LLM(str(path), adapters=adapters, num_blocks=64, block_size=4, max_model_len=128)


def greedy(n=8, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def test_unknown_adapter_is_refused_and_others_are_undisturbed(llm):
    ok = llm.engine.add_request(PROMPT, "a", greedy())
    with pytest.raises(RequestError, match="unknown adapter 'nope'"):
        llm.engine.add_request(PROMPT, "nope", greedy())
    outs = {}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            outs[o.request_id] = o
    assert list(outs) == [ok] and outs[ok].token_ids == llm.generate([PROMPT], "a", greedy())[0].token_ids


@pytest.mark.parametrize("prompt,match", [
    ([], "empty"),
    ([1] * 128, "max_model_len"),
    ([1, 2, 100000], "outside the vocabulary"),
    ([1, -1], "outside the vocabulary"),
    ("text", "no tokenizer"),
    ([1.5, 2], "token ids"),
])
def test_bad_prompts_are_refused(llm, prompt, match):
    with pytest.raises(RequestError, match=match):
        llm.generate([prompt], None, greedy())
    assert not llm.engine.has_unfinished() and llm.engine.allocator.num_free == 64


def test_prompt_larger_than_the_kv_cache_is_refused(tiny):
    path, _, _ = tiny
    small = LLM(str(path), num_blocks=2, block_size=4, max_model_len=128)
    with pytest.raises(RequestError, match="does not fit the KV cache"):
        small.generate([list(range(1, 12))], None, greedy())


@pytest.mark.parametrize("kw,match", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -3}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"), ({"stop": ("",)}, "stop"), ({"stop_token_ids": (-5,)}, "stop_token_ids"),
])
def test_bad_sampling_params_are_refused(kw, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kw)


def test_max_tokens_and_stop_token_ids(llm):
    ref = llm.generate([PROMPT], None, greedy(10))[0]
    assert len(ref.token_ids) == 10 and ref.finish_reason == "length"
    stop_at = ref.token_ids[4]
    first = ref.token_ids.index(stop_at)
    out = llm.generate([PROMPT], None, greedy(10, stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == ref.token_ids[:first + 1] and out.finish_reason == "stop"


def test_abort_frees_memory_and_ends_the_stream(llm):
    eng = llm.engine
    stream = llm.stream(PROMPT, "a", greedy(50))
    first = next(stream)
    assert first.delta_token_ids and not first.finished
    stream.close()                                    # closing the iterator aborts the request
    assert not eng.scheduler.running and eng.allocator.num_free == 64
    rid = eng.add_request(PROMPT, None, greedy(50))
    eng.step()
    assert eng.abort(rid) and not eng.abort(rid)
    final = [o for o in eng.step() if o.request_id == rid]
    assert final and final[0].finished and final[0].finish_reason == "abort"
    assert eng.allocator.num_free == 64 and not eng.has_unfinished()


def test_stream_deltas_add_up_to_the_final_output(llm):
    outs = list(llm.stream(PROMPT, "a", greedy(12)))
    assert sum((o.delta_token_ids for o in outs), []) == outs[-1].token_ids
    assert outs[-1].token_ids == llm.generate([PROMPT], "a", greedy(12))[0].token_ids
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def test_output_stops_at_max_model_len(llm):
    out = llm.generate([list(range(1, 121))], None, greedy(50))[0]
    assert len(out.token_ids) == 128 - 120 and out.finish_reason == "length"


def test_refused_adapter_leaves_registered_adapters_untouched(llm, tiny, tmp_path):
    _, adapters, _ = tiny
    before = llm.generate([PROMPT], "a", greedy())[0].token_ids
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    tensors = load_file(str(adapters["a"] / "adapter_model.safetensors"))
    key = next(iter(tensors))
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="NaN|Inf|non-finite"):
        llm.register_adapter("b", bad)
    with pytest.raises(AdapterError, match="already registered"):
        llm.register_adapter("a", adapters["a"])
    cfg = json.loads((adapters["a"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4096}))
    with pytest.raises(AdapterError):
        llm.register_adapter("b", bad)
    assert llm.list_adapters() == ["a"]
    assert llm.generate([PROMPT], "a", greedy())[0].token_ids == before


def test_adapter_in_use_cannot_be_unregistered(llm):
    rid = llm.engine.add_request(PROMPT, "a", greedy(5))
    with pytest.raises(RequestError, match="in use"):
        llm.unregister_adapter("a")
    llm.engine.abort(rid)
    llm.unregister_adapter("a")
    assert llm.list_adapters() == []


def test_base_model_name_selects_the_base_model(llm):
    base = llm.generate([PROMPT], None, greedy())[0].token_ids
    assert llm.generate([PROMPT], llm.engine.model_name, greedy())[0].token_ids == base


def test_top_k_one_is_greedy(llm):
    base = llm.generate([PROMPT], "a", greedy(10))[0].token_ids
    out = llm.generate([PROMPT], "a", greedy(10, temperature=1.3, top_k=1, seed=7))[0].token_ids
    assert out == base


def test_a_sequence_outgrowing_the_whole_kv_cache_ends_with_length(tiny):
    path, _, _ = tiny
    small = LLM(str(path), num_blocks=4, block_size=4, max_model_len=128)
    outs = small.generate([list(range(1, 11)), [5, 6]], None, greedy(50))
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 16 - 10 + 1   # last one needs no KV
    assert outs[1].finish_reason == "length"
    assert small.engine.allocator.num_free == 4 and not small.engine.has_unfinished()


def test_prompts_beside_decodes_are_prefilled_in_chunks_of_their_bound(tiny):
    """While a request decodes, a new prompt is prefilled at most ``max_prefill_tokens_with_decodes`` tokens an
    iteration (a prompt with nothing decoding gets the whole token budget); the tokens are those of an engine
    without the bound."""
    path, adapters, _ = tiny
    prompt_b = list(range(3, 23))
    outs = {}
    for bound in (None, 4):
        llm = LLM(str(path), adapters=adapters, num_blocks=64, block_size=4, max_model_len=128,
                  max_num_batched_tokens=64, max_prefill_tokens_with_decodes=bound)
        eng = llm.engine
        a = eng.add_request(PROMPT, "a", greedy(12))
        done = {o.request_id: o for o in eng.step() if o.finished}
        assert eng.scheduler.prompt_tokens_computed == len(PROMPT)       # nothing decoded: all of it at once
        b = eng.add_request(prompt_b, None, greedy(4))
        chunks = []
        while eng.has_unfinished():
            before = eng.scheduler.prompt_tokens_computed
            done |= {o.request_id: o for o in eng.step() if o.finished}
            chunks.append(eng.scheduler.prompt_tokens_computed - before)
        outs[bound] = (done[a].token_ids, done[b].token_ids)
        if bound == 4:
            assert chunks[:5] == [4] * 5 and sum(chunks) == len(prompt_b)
        else:
            assert chunks[0] == len(prompt_b)
    assert outs[4] == outs[None]


def test_a_bound_on_prompt_tokens_beside_decodes_below_one_is_refused():
    from vlora.config import ConfigError, SchedulerConfig

    with pytest.raises(ConfigError, match="max_prefill_tokens_with_decodes must be >= 1"):
        SchedulerConfig(max_prefill_tokens_with_decodes=0)


def test_prompt_chunks_beside_decodes_are_bounded_in_number(tiny):
    """With a bound on prompt chunks beside decodes (the chunk slots of the mixed CUDA graphs), four short
    prompts arriving while a request decodes are admitted two an iteration; the tokens are those without it."""
    path, adapters, _ = tiny
    outs = {}
    for bound in (None, 2):
        llm = LLM(str(path), adapters=adapters, num_blocks=64, block_size=4, max_model_len=128,
                  max_num_batched_tokens=64)
        eng = llm.engine
        eng.scheduler.max_chunks_with_decodes = bound
        first = eng.add_request(PROMPT, "a", greedy(10))
        done = {o.request_id: o for o in eng.step() if o.finished}
        ids = [eng.add_request([3 + i, 5, 7], None, greedy(3)) for i in range(4)]
        joined = []
        while eng.has_unfinished():
            waiting = len(eng.scheduler.waiting)
            done |= {o.request_id: o for o in eng.step() if o.finished}
            if waiting:
                joined.append(waiting - len(eng.scheduler.waiting))
        outs[bound] = [done[r].token_ids for r in [first] + ids]
        assert joined == ([2, 2] if bound else [4])
    assert outs[2] == outs[None]
