"""Latency targets and S-LoRA-style early abort: unit tests of the estimate, and through the engine."""

from __future__ import annotations

import time

import pytest

from tests.models.test_parity import build
from vlora import LLM, SLO, SamplingParams
from vlora.engine.admission import Admission, ServiceEstimator, SLOError
from vlora.engine.engine import RequestError
from vlora.engine.sequence import Sequence


def seq(rid, n_prompt, max_tokens=8, waited=0.0, slo=None, adapter=None):
    s = Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), adapter, 0, slo=slo)
    s.arrival_time = 100.0 - waited
    return s


def estimator(prefill_token_s=0.0, decode_step_s=0.0):
    est = ServiceEstimator()
    est.prefill_token_s, est.decode_step_s = prefill_token_s, decode_step_s
    return est


def test_slo_values_are_validated():
    with pytest.raises(SLOError):
        SLO(ttft_s=0)
    with pytest.raises(SLOError):
        SLO(latency_s=float("inf"))
    assert SLO(ttft_s=0.5).latency_s is None


def test_ttft_rejection_counts_the_queue_ahead():
    adm = Admission()
    est = estimator(prefill_token_s=0.01)
    a = seq("a", 10, slo=SLO(ttft_s=0.5))                  # 0.1 s of prefill: fits
    b = seq("b", 10, slo=SLO(ttft_s=0.5), waited=0.35)     # 0.35 + (10 + 10) * 0.01 = 0.55 > 0.5
    c = seq("c", 10, slo=SLO(ttft_s=0.5), waited=0.25)     # b is rejected, so c is second: 0.25 + 0.2 fits
    got = adm.reject([a, b, c], 100.0, est)
    assert [s.request_id for s, _ in got] == ["b"]
    assert "TTFT SLO of 0.5 s" in got[0][1] and "waited 0.350 s" in got[0][1]


def test_latency_rejection_uses_max_tokens_and_decode_time():
    adm = Admission()
    est = estimator(prefill_token_s=0.001, decode_step_s=0.02)
    ok = seq("ok", 10, max_tokens=10, slo=SLO(latency_s=1.0))        # 0.01 + 0.2
    late = seq("late", 10, max_tokens=100, slo=SLO(latency_s=1.0))   # 0.02 + 2.0
    assert [s.request_id for s, r in adm.reject([ok, late], 100.0, est)] == ["late"]


def decoding(rid="d"):
    s = seq(rid, 4)
    s.num_computed = s.num_tokens - 1            # its prompt done: one token per iteration
    return s


def test_prompts_chunked_beside_decodes_count_a_decode_step_per_chunk():
    """With a bound of 1,024 prompt tokens beside decodes, a 3,000-token prompt takes three iterations, each
    also a decode step (0.3 s + 3 x 0.03 s = 0.39 s): over a 0.35 s TTFT target only where decodes run."""
    est = estimator(prefill_token_s=1e-4, decode_step_s=0.03)
    long = seq("long", 3000, slo=SLO(ttft_s=0.35))
    assert Admission().reject([long], 100.0, est, [], 1024, 16384) == []             # nothing decodes: one pass
    assert Admission().reject([long], 100.0, est, [decoding()], None, 16384) == []   # no bound
    got = Admission().reject([long], 100.0, est, [decoding()], 1024, 16384)
    assert [s.request_id for s, _ in got] == ["long"] and "about 0.390 s more to prefill" in got[0][1]
    # nothing decodes until the first prompt in line ends: a 20,000-token prompt takes two whole passes of
    # 16,384 (2.0 s, no decode step); one behind a 2,000-token prompt goes beside its decodes (20 chunks)
    big = seq("big", 20000, slo=SLO(ttft_s=2.05))
    assert Admission().reject([big], 100.0, est, [], 1024, 16384) == []
    got = Admission().reject([seq("short", 2000), big], 100.0, est, [], 1024, 2048)
    assert [s.request_id for s, _ in got] == ["big"] and "about 2.800 s more to prefill" in got[0][1]


def test_running_prompts_go_first_and_prompts_per_iteration_are_bounded():
    est = estimator(prefill_token_s=1e-4, decode_step_s=0.03)
    half = seq("half", 3000)
    half.num_computed = 1000                      # 2,000 of its prompt tokens left, prefilled before any waiting
    late = seq("late", 100, slo=SLO(ttft_s=0.25))
    got = Admission().reject([late], 100.0, est, [half, decoding()], 1024, 16384)
    assert "about 0.300 s more to prefill" in got[0][1]          # 2,100 tokens, 3 chunks
    assert Admission().reject([late], 100.0, est, [decoding()], 1024, 16384) == []
    # twenty short prompts, at most 8 per iteration: the last waits three iterations, not one
    short = [seq(f"s{i}", 10, slo=SLO(ttft_s=0.1)) for i in range(20)]
    got = Admission().reject(short, 100.0, est, [decoding()], 1024, 16384, per_iteration=8)
    assert [s.request_id for s, _ in got] == [f"s{i}" for i in range(16, 20)]     # 17th on: 3 x 0.03 + tokens


def test_no_measurement_only_waiting_counts_and_served_requests_are_kept():
    adm = Admission()
    adm.set_slo("x", SLO(ttft_s=0.1))
    fresh = seq("fresh", 1000, slo=SLO(ttft_s=0.1))
    started = seq("started", 5, waited=5.0, slo=SLO(ttft_s=0.1))
    started.output_token_ids = [3]                                       # preempted after its first token
    assert adm.reject([fresh, started], 100.0, ServiceEstimator()) == []
    old = seq("old", 5, waited=0.2, slo=SLO(ttft_s=0.1))
    assert [s.request_id for s, _ in adm.reject([old], 100.0, ServiceEstimator())] == ["old"]


def test_adapter_slo_and_request_override(tmp_path):
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=64, block_size=4)
    eng = llm.engine
    with pytest.raises(RequestError):
        llm.set_slo("missing", SLO(ttft_s=1.0))
    llm.set_slo("a4", SLO(ttft_s=1e-9))                      # impossible: every a4 request waits longer
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    r_a4 = eng.add_request([1, 2, 3], "a4", sp)
    r_own = eng.add_request([1, 2, 3], "a4", sp, slo=SLO(ttft_s=60.0))   # its own target overrides
    r_base = eng.add_request([1, 2, 3], None, sp)
    time.sleep(0.01)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs[r_a4].finish_reason == "rejected" and outs[r_a4].token_ids == []
    assert "TTFT SLO" in outs[r_a4].error
    assert outs[r_own].finish_reason == "length" and len(outs[r_own].token_ids) == 4
    assert outs[r_base].finish_reason == "length"
    assert eng.allocator.num_free == 64 and eng.admission.num_rejected == 1


def test_preempted_requests_are_not_rejected_and_slo_types_are_checked(tmp_path):
    adm = Admission()
    s = seq("p", 10, waited=5.0, slo=SLO(ttft_s=0.1))
    s.num_preemptions = 1                      # served once already (preempted mid-prefill)
    assert adm.reject([s], 100.0, ServiceEstimator()) == []
    path, paths, _ = build(tmp_path)
    llm = LLM(str(path), adapters=paths, num_blocks=16, block_size=4)
    with pytest.raises(RequestError):
        llm.set_slo("a4", {"ttft_s": 1.0})
    llm.set_slo("a4", SLO(ttft_s=1.0))
    llm.unregister_adapter("a4")               # its targets go with it
    assert "a4" not in llm.engine.admission.adapter_slos
