"""Scheduling against the memory the pool really has: reviews of edge cases between the scheduler, the pool and
the adapters resident in it (tiny model, CPU)."""

from __future__ import annotations

import pytest

from tests.models.test_parity import build
from vlora import LLM, SamplingParams
from vlora.engine.engine import RequestError


def test_an_adapter_loaded_for_a_waiting_request_does_not_truncate_a_running_one(tmp_path):
    """A running request whose KV fits the pool is not finished "length" because an adapter loaded only for a
    request still waiting holds the pages it needs: that adapter leaves the pool instead, and the waiting
    request runs once there is room again. Both get the tokens of a roomy engine."""
    path, paths, _ = build(tmp_path)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    long_prompt, short_prompt = list(range(3, 83)), list(range(5, 9))      # 20 blocks of 4, and 1
    roomy = LLM(str(path), adapters={"a16": paths["a16"]}, num_blocks=256, block_size=4, max_model_len=128)
    want = [o.token_ids for o in roomy.generate([long_prompt, short_prompt], [None, "a16"], sp)]
    # kernel path, room for one adapter of rank 16: with it resident, the pool has fewer pages than the long
    # request needs; without it, plenty
    llm = LLM(str(path), adapters={"a16": paths["a16"]}, num_blocks=4, block_size=4, max_model_len=128,
              lora_kernel="triton", max_loras=1, max_lora_rank=16, max_num_seqs=2, max_num_batched_tokens=64)
    eng = llm.engine
    assert -(-(len(long_prompt) + 4) // 4) + eng.adapters.store.pages_needed(eng.adapters.get("a16")) \
        > eng.pool.num_pages >= -(-(len(long_prompt) + 4) // 4)
    eng.add_request(long_prompt, None, sp, request_id="long")
    eng.add_request(short_prompt, "a16", sp, request_id="short")
    got = {}
    for _ in range(50):
        for o in eng.step():
            if o.finished:
                got[o.request_id] = (o.finish_reason, o.token_ids)
        if not eng.has_unfinished():
            break
    assert got == {"long": ("length", want[0]), "short": ("length", want[1])}
    eng.pool.check()
    assert eng.pool.kv_pages == 0


def test_a_prompt_that_cannot_fit_beside_its_adapter_is_refused(tmp_path):
    """A prompt whose KV fits the pool but not beside its own adapter's pages could never run: it is refused
    when added (naming the adapter), not finished "length" with no token after part of its prefill."""
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters={"a16": paths["a16"]}, num_blocks=4, block_size=4, max_model_len=128,
              lora_kernel="triton", max_loras=1, max_lora_rank=16, max_num_batched_tokens=64)
    eng = llm.engine
    room = eng.pool.num_pages - eng.adapters.store.pages_needed(eng.adapters.get("a16"))
    too_long, longest = list(range(3, 3 + 4 * room)), list(range(3, 3 + 4 * room - 1))
    with pytest.raises(RequestError, match="beside adapter 'a16'"):
        eng.add_request(too_long, "a16", SamplingParams(max_tokens=2, ignore_eos=True))
    got = {}
    for prompt, adapter in ((too_long, None), (longest, "a16")):      # the base model has the whole pool
        eng.add_request(prompt, adapter, SamplingParams(max_tokens=2, ignore_eos=True), request_id=str(adapter))
        while eng.has_unfinished():
            got.update({o.request_id: (o.finish_reason, len(o.token_ids)) for o in eng.step() if o.finished})
    assert got == {"None": ("length", 2), "a16": ("length", 2)}
    eng.pool.check()
