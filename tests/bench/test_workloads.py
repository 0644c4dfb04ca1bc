"""Workload generators: the statistics they promise, and trace files round trip."""

from __future__ import annotations

import math
import statistics

import pytest

from vlora.bench import workloads as W


def test_gamma_arrivals_rate_and_cv():
    import random

    for cv in (0.5, 1.0, 2.0):
        ts = W.gamma_arrivals(random.Random(1), rate=50.0, cv=cv, duration_s=200.0)
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        assert len(ts) / 200.0 == pytest.approx(50.0, rel=0.1)
        assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.15)


def test_synthetic_power_law_popularity():
    specs = W.synthetic(num_adapters=10, alpha=1.0, rate=40.0, duration_s=100.0, seed=3)
    counts = [sum(s.adapter == f"a{i}" for s in specs) for i in range(10)]
    want = W.power_law_rates(10, 1.0, 1.0)
    for c, w in zip(counts, want):
        assert c / len(specs) == pytest.approx(w, abs=0.03)
    assert all(8 <= s.input_len <= 512 and 8 <= s.output_len <= 512 for s in specs)
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)


@pytest.mark.parametrize("skew", [0.3, 0.5, 0.9])
def test_skewness_is_the_top_adapter_share(skew):
    specs = W.synthetic(num_adapters=8, rate=50.0, duration_s=60.0, shares=W.skewed_shares(8, skew), seed=1)
    top = sum(s.adapter == "a0" for s in specs) / len(specs)
    assert top == pytest.approx(skew, abs=0.05)
    retrieval = W.visual_retrieval(rate=30.0, duration_s=60.0, num_adapters=8, skewness=skew)
    assert sum(s.adapter == "a0" for s in retrieval) / len(retrieval) == pytest.approx(skew, abs=0.06)


def test_popularity_distributions():
    assert W.popularity_shares(4, "identical") == [1.0, 0.0, 0.0, 0.0]
    assert W.popularity_shares(4, "uniform") == [0.25] * 4
    z = W.popularity_shares(4, "skewed")
    assert sum(z) == pytest.approx(1.0) and z == sorted(z, reverse=True)
    with pytest.raises(ValueError):
        W.popularity_shares(4, "weird")


def test_application_profiles():
    r = W.visual_retrieval(rate=5.0, duration_s=20.0)
    assert all(256 <= s.image_tokens <= 576 and s.input_len > s.image_tokens and 200 <= s.output_len <= 256
               for s in r)
    v = W.video_analytics(streams=3, duration_s=10.0, num_adapters=2)
    assert len(v) == 30 and all(s.image_tokens == 6 * 256 and 5 <= s.output_len <= 10 for s in v)
    per_stream = sorted(s.arrival_s for s in v if s.adapter == "a1")     # stream 1: one chunk a second
    assert all(b - a == pytest.approx(1.0) for a, b in zip(per_stream, per_stream[1:]))


def test_dynamic_popularity_shifts_the_hot_set():
    specs = W.dynamic_popularity([(30.0, 3), (30.0, 12)], num_adapters=16, rate=20.0, seed=2)
    early = {s.adapter for s in specs if s.arrival_s < 30}
    late = {s.adapter for s in specs if s.arrival_s >= 30}
    assert len(early) <= 3 and len(late) > 3


def test_multi_turn_sessions_grow_their_history():
    specs = W.multi_turn(sessions=4, turns=3, rate=2.0)
    for sid in range(4):
        turns = sorted((s for s in specs if s.session == sid), key=lambda s: s.turn)
        assert [t.turn for t in turns] == [0, 1, 2]
        assert math.isfinite(turns[0].arrival_s) and all(math.isinf(t.arrival_s) for t in turns[1:])
        for a, b in zip(turns, turns[1:]):
            assert b.input_len > a.input_len + a.output_len and b.after_s > 0
            assert b.adapter == a.adapter


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_trace_round_trip(tmp_path, suffix):
    specs = W.multi_turn(sessions=2, turns=2, rate=1.0) + W.synthetic(4, rate=3.0, duration_s=5.0)
    specs = sorted(specs, key=lambda r: (r.arrival_s, r.session or 0, r.turn))
    path = tmp_path / f"t{suffix}"
    W.save_trace(specs, path)
    got = W.load_trace(path)
    t0 = min(s.arrival_s for s in specs)
    assert len(got) == len(specs)
    for a, b in zip(sorted(specs, key=lambda s: (s.arrival_s, s.session or 0, s.turn)), got):
        assert (a.adapter, a.input_len, a.output_len, a.session, a.turn) == \
            (b.adapter, b.input_len, b.output_len, b.session, b.turn)
        assert (math.isinf(a.arrival_s) and math.isinf(b.arrival_s)) or b.arrival_s == pytest.approx(a.arrival_s - t0)


def test_bad_trace_rows_are_refused(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,adapter,input_len,output_len\n0.5,a0,ten,4\n")
    with pytest.raises(ValueError, match="row 1"):
        W.load_trace(bad)
    zero = tmp_path / "zero.csv"
    zero.write_text("timestamp,adapter,input_len,output_len\n0.5,,0,4\n")
    with pytest.raises(ValueError, match="below 1"):
        W.load_trace(zero)


def test_dynamic_multi_turn_sessions_follow_the_shifting_hot_set():
    specs = W.dynamic_multi_turn([(20.0, 3), (20.0, 3)], num_adapters=50, session_rate=1.0, turns=3, seed=4)
    firsts = [s for s in specs if s.turn == 0]
    assert firsts and all(0 <= s.arrival_s < 40 for s in firsts)
    early = {s.adapter for s in firsts if s.arrival_s < 20}
    late = {s.adapter for s in firsts if s.arrival_s >= 20}
    assert len(early) <= 3 and len(late) <= 3 and early != late          # a new hot set per phase
    by_session = {}
    for s in specs:
        by_session.setdefault(s.session, []).append(s)
    for turns in by_session.values():
        turns.sort(key=lambda s: s.turn)
        assert [t.turn for t in turns] == [0, 1, 2] and len({t.adapter for t in turns}) == 1
        assert all(b.input_len > a.input_len + a.output_len for a, b in zip(turns, turns[1:]))
        assert all(t.arrival_s == float("inf") and t.after_s > 0 for t in turns[1:])
