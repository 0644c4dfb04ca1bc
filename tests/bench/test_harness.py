"""The real-time harness and ``vlora bench`` on a tiny random model: every request served and timed, modes and
switches recorded, multi-turn follow-ups sent after their answers, the report written with its plots."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vlora import SLO
from vlora.bench import workloads as W
from vlora.bench.harness import run_workload
from vlora.bench.sweep import SweepConfig, default_meta, make_workload, run_sweep, write_report
from vlora.cli import main
from vlora.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vlora.engine.engine import Engine


def tiny_engine(policy="unmerged"):
    return Engine(EngineConfig(model=ModelConfig("random:tiny-llama"), cache=CacheConfig(num_blocks=512),
                               scheduler=SchedulerConfig(max_num_seqs=16, policy=policy)))


def test_harness_times_every_request_and_follows_sessions(tmp_path):
    eng = tiny_engine()
    from vlora.bench.sweep import register_random_adapters

    register_random_adapters(eng, SweepConfig(num_adapters=3), tmp_path)
    specs = W.synthetic(3, rate=20.0, duration_s=0.5, input_range=(4, 32), output_range=(2, 8), seed=1)
    specs += W.multi_turn(sessions=2, turns=3, rate=10.0, num_adapters=3, think_s=(0.01, 0.02),
                          first_range=(8, 16), next_range=(2, 4), output_range=(2, 4))
    res = run_workload(eng, specs, seed=0)
    assert len(res.records) == len(specs)
    for r in res.records:
        assert r.finish_reason == "length" and r.tokens == r.spec.output_len
        assert r.arrival <= r.sent <= r.admitted <= r.first_token <= r.finish
        assert r.spec.turn > 0 or r.arrival == r.spec.arrival_s        # timed from the trace, not from the send
    turns = sorted((r for r in res.records if r.spec.session == 0), key=lambda r: r.spec.turn)
    for a, b in zip(turns, turns[1:]):
        assert b.arrival >= a.finish + b.spec.after_s - 1e-6          # sent after the previous answer
    m = res.metrics(ttft_slo_s=10.0)
    assert m["finished"] == len(specs) and m["unfinished"] == 0 and m["slo_attainment"] == 1.0
    assert m["avg_token_latency_s"] > 0 and m["mode_share"] == {"unmerged": 1.0}
    firsts = [r.ttft for r in res.records if r.spec.turn == 0]      # the synthetic requests are first turns too
    assert m["ttft_first_turn_mean_s"] == pytest.approx(sum(firsts) / len(firsts))
    assert m["ttft_later_turns_mean_s"] is not None and m["ttft_later_turns_p90_s"] is not None
    assert m["queued_mean_s"] == pytest.approx(sum(r.admitted - r.arrival for r in res.records) / len(specs))
    assert m["ttft_scheduled_mean_s"] == pytest.approx(sum(r.first_token - r.admitted for r in res.records)
                                                       / len(specs))
    assert m["queued_first_turn_p90_s"] is not None and m["queued_later_turns_mean_s"] is not None
    assert m["late_mean_s"] == pytest.approx(sum(r.sent - r.arrival for r in res.records) / len(specs))
    assert m["gc_collections"] == len(res.gc_pauses) and m["gc_pause_s"] >= 0
    assert eng.allocator.num_free == 512


def test_harness_times_the_wait_to_be_scheduled():
    """One sequence at a time: each request waits until the one before it has finished, and that wait is its
    queueing time, not the time its own prompt took."""
    eng = Engine(EngineConfig(model=ModelConfig("random:tiny-llama"), cache=CacheConfig(num_blocks=512),
                              scheduler=SchedulerConfig(max_num_seqs=1)))
    res = run_workload(eng, [W.RequestSpec(0.0, None, 16, 6) for _ in range(3)])
    recs = sorted(res.records, key=lambda r: r.admitted)
    assert recs[0].queued <= recs[0].ttft
    for a, b in zip(recs, recs[1:]):
        assert b.admitted >= a.finish and b.queued >= a.latency - 1e-9
    for r in recs:                                          # its first token came from steps it was scheduled in
        assert r.admitted < r.first_token
    m = res.metrics()
    assert m["queued_mean_s"] == pytest.approx(sum(r.queued for r in recs) / 3)


def test_harness_admission_is_the_first_chunk_not_the_last():
    """A prompt longer than the token budget is computed in chunks over several iterations: the request was
    admitted at the first of them, and its time to first token after admission spans them all."""
    eng = Engine(EngineConfig(model=ModelConfig("random:tiny-llama"), cache=CacheConfig(num_blocks=512),
                              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8)))
    res = run_workload(eng, [W.RequestSpec(0.0, None, 32, 2)])
    (rec,) = res.records
    chunks = [t for t, _, _ in res.iterations if rec.admitted < t <= rec.first_token]
    assert len(chunks) == 4                                 # 32 prompt tokens, 8 a step
    assert rec.admitted == rec.sent and rec.late >= 0.0    # sent at once, scheduled by the first step


def test_harness_reports_early_aborts(tmp_path):
    eng = tiny_engine()
    specs = [W.RequestSpec(0.0, None, 16, 4) for _ in range(6)]
    res = run_workload(eng, specs, slo=SLO(ttft_s=1e-9))
    m = res.metrics()
    assert m["rejected"] == 6 and m["finished"] == 0
    assert all("TTFT SLO" in r.error for r in res.records)


def test_sweep_report_with_policies_and_switches(tmp_path):
    eng = tiny_engine()
    cfg = SweepConfig(points=(0.5, 0.9), sweep="skewness", rate=30.0, duration_s=0.6, num_adapters=4,
                      input_range=(4, 24), output_range=(2, 6), policies=("vlora", "unmerged", "merged-only"))
    rows = run_sweep(eng, cfg, progress=False, log=lambda m: None)
    assert len(rows) == 6 and all(r["finished"] == r["requests"] > 0 for r in rows)
    merged_only = [r for r in rows if r["policy"] == "merged-only"]
    assert all(r["switches"] > 0 and r["mode_share"].get("merged", 0) > 0 for r in merged_only)
    path = write_report(rows, cfg, tmp_path / "rep", default_meta(eng))
    text = path.read_text()
    assert "| merged-only | 0.9 |" in text and "vs unmerged" in text and "latency.png" in text
    assert (tmp_path / "rep" / "latency.png").stat().st_size > 0 and (tmp_path / "rep" / "modes.png").is_file()
    data = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert len(data["runs"]) == 6


def test_vlora_bench_cli_on_a_trace(tmp_path):
    trace = tmp_path / "trace.csv"
    W.save_trace([W.RequestSpec(0.05 * i, f"a{i % 2}", 12, 3) for i in range(6)], trace)
    rc = main(["bench", "--model", "random:tiny-llama", "--num-blocks", "256", "--workload", "trace",
               "--trace", str(trace), "--points", "1", "--policies", "vlora,unmerged", "--num-adapters", "2",
               "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| vlora | 1 |" in text and "6/6" in text
    assert main(["bench", "--model", "random:tiny-llama", "--policies", "fastest"]) == 2


def test_sweep_repeats_rotate_the_policy_order_and_pool_the_gaps(tmp_path):
    eng = tiny_engine()
    cfg = SweepConfig(points=(0.9,), sweep="skewness", rate=30.0, duration_s=0.4, num_adapters=3,
                      input_range=(4, 16), output_range=(2, 4), policies=("vlora", "unmerged"), repeats=2,
                      warmup_requests=0)
    order = []
    rows = run_sweep(eng, cfg, progress=False, log=order.append)
    assert [(r["policy"], r["repeat"]) for r in rows] == [("vlora", 0), ("unmerged", 0), ("unmerged", 1),
                                                          ("vlora", 1)]
    assert make_workload(dataclasses.replace(cfg, seed=1), 0.9) != make_workload(cfg, 0.9)   # repeat 1's own
    assert all(r["tokens"] > 0 for r in rows)
    text = write_report(rows, cfg, tmp_path / "rep", default_meta(eng)).read_text()
    line = next(x for x in text.splitlines() if x.startswith("- skewness=0.9"))
    assert "vs unmerged" in line and line.count("%") == 3        # pooled gap, then each repeat's


def test_harness_samples_when_asked():
    """``sampling`` reaches every request (each with its own seed); without it every request is greedy."""
    eng = tiny_engine()
    sent = []
    add = eng.add_request
    eng.add_request = lambda prompt, adapter, sp, **kw: sent.append(sp) or add(prompt, adapter, sp, **kw)
    specs = [W.RequestSpec(0.0, None, 8, 3) for _ in range(3)]
    run_workload(eng, specs, sampling={"temperature": 0.8, "top_p": 0.95, "top_k": 50})
    assert [(sp.temperature, sp.top_p, sp.top_k) for sp in sent] == [(0.8, 0.95, 50)] * 3
    assert len({sp.seed for sp in sent}) == 3
    sent.clear()
    run_workload(eng, specs)
    assert [sp.temperature for sp in sent] == [0.0] * 3
