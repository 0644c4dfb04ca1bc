"""The paired policy comparison: its statistics, and the benchmark's CPU dry run (common traces, rotated order,
spread diagnostics, report files)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from vlora.bench.paired import Setting, TraceShape, make_trace, paired_table, rotation, t_interval, trace_digest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_policies_paired.py"


def test_t_interval_and_rotation():
    mean, lo, hi = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and hi - mean == pytest.approx(2.776 * 1.5811388 / 5 ** 0.5, rel=1e-4) and lo == 6.0 - hi
    assert t_interval([1.0]) is None
    assert [rotation(("a", "b", "c"), k) for k in range(4)] == [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"),
                                                                 ("a", "b", "c")]


def _row(setting, policy, seed, lat):
    return {"setting": setting, "policy": policy, "seed": seed, "avg_token_latency_s": lat, "mode_share": {},
            "switches": 1, "switch_times": [(0.5, 0.01)], "duration_s": 2.0}


def test_paired_table_decides_only_beyond_the_interval():
    """Seed-by-seed differences: a consistent 10% loss is resolved even though the seeds' latencies differ 3x; a
    difference whose sign changes with the seed is not."""
    rows = []
    for seed, base in enumerate((0.01, 0.02, 0.03, 0.015)):
        rows += [_row("s", "vlora", seed, base * (1.10 + 0.001 * seed)), _row("s", "unmerged", seed, base),
                 _row("s", "dlora", seed, base * (1.2 if seed % 2 else 0.8))]
    (entry,) = paired_table(rows, ("vlora", "unmerged", "dlora"))
    assert entry["vs"]["unmerged"]["verdict"] == "vlora worse"
    assert entry["vs"]["unmerged"]["ci"][0] == pytest.approx(0.1015, abs=1e-3)
    assert entry["vs"]["dlora"]["verdict"] == "no difference resolved"
    assert entry["best_fixed"] == "unmerged" and entry["seeds"] == 4
    assert entry["vlora_switch_share"] == pytest.approx(0.005) and entry["vlora_switch_ms"] == (10.0, 10.0)


def test_traces_are_seeded_per_setting():
    shape = TraceShape(duration_s=2.0)
    a = make_trace(Setting("skew0.7", 8), 1, shape)
    assert trace_digest(a) == trace_digest(make_trace(Setting("skew0.7", 8), 1, shape))
    assert trace_digest(a) != trace_digest(make_trace(Setting("skew0.7", 8), 2, shape))
    top = sum(s.adapter == "a0" for s in a) / len(a)
    assert 0.4 < top < 1.0
    with pytest.raises(ValueError, match="unknown setting"):
        make_trace(Setting("zipf", 8), 0, shape)


def test_dry_run_replays_one_trace_per_seed_for_every_policy(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main(["--dry-run", "--out", str(tmp_path), "--policies", "vlora,unmerged", "--spread-before"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"]["sampling"] == "chat" and res["meta"]["merged_copy"] is False
    runs = res["runs"]
    assert len(runs) == 4 and {(r["seed"], r["policy"]) for r in runs} == {(s, p) for s in (0, 1)
                                                                          for p in ("vlora", "unmerged")}
    for seed in (0, 1):
        mine = [r for r in runs if r["seed"] == seed]
        assert len({r["trace"] for r in mine}) == 1 and len({r["requests"] for r in mine}) == 1   # common trace
        assert [r["policy"] for r in mine] == list(rotation(("vlora", "unmerged"), seed))           # interleaved
        assert all(r["finished"] == r["requests"] for r in mine)
    before, now = res["spread"]                         # as runs were made before, then as now
    assert before["legacy"] and not now["legacy"]
    for check in (before, now):
        assert len(check["runs"]) == 2 and len({r["trace"] for r in check["runs"]}) == 1
        for key in ("gc_pause_s", "late_p99_s", "compiles", "preemptions", "avg_token_latency_s",
                    "avg_token_latency_from_send_s"):
            assert all(key in r for r in check["runs"])
        assert {"cv", "cv_from_send"} <= set(check["spread"])
    (entry,) = res["paired"]
    assert entry["setting"] == "skew0.9/4" and entry["vs"]["unmerged"]["ci"] is not None
    report = (tmp_path / "report.md").read_text()
    assert "vs unmerged" in report and report.count("Spread of one policy") == 2
    assert (tmp_path / "paired.png").stat().st_size > 0


def test_mixed_launch_costs_time_both_launch_kinds_and_restore_the_graphs_launch():
    from types import SimpleNamespace

    from tests.engine.test_mode_costs import FakeGraphs, adapter
    from vlora.bench.paired import mixed_launch_costs

    graphs = FakeGraphs("one")
    graphs.buckets = [1, 4, 8]
    launch = graphs.launch
    pool = {a.name: a for a in (adapter(0, 64), adapter(1, 16), adapter(2, 8))}
    engine = SimpleNamespace(
        runner=SimpleNamespace(graphs=graphs),
        adapters=SimpleNamespace(store=SimpleNamespace(ensure=lambda adapters, keep: adapters),
                                 names=lambda: list(pool), get=pool.get),
        config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=4)))
    costs = mixed_launch_costs(engine, reps=1)
    assert set(costs) == {"merged", "unmerged", "mixed-one", "mixed-two"}
    assert all(set(t) == {1, 4} for t in costs.values())
    assert graphs.launch is launch
    paired = [c for c in graphs.calls if any(s.pair is not None for s in c[2])]
    second = [c for c in graphs.calls if c[3]]
    assert paired and second and all(s.pair.name == "a0" for c in paired for s in c[2] if s.pair)   # largest rank


def test_merge_joins_invocations_that_split_the_settings(tmp_path):
    """Two invocations of one configuration, each with its own settings, make one report with both settings (the
    one that stopped early named); a merged report merges again with its parts kept; invocations that compared
    other policies are refused."""
    from vlora.bench.paired import write_report

    main = runpy.run_path(str(SCRIPT))["main"]
    meta = {"date": "d", "model": "m", "device": "cpu", "policies": ["vlora", "unmerged"], "commit": "abc",
            "sampling": "chat", "merged_copy": False, "shape": {"duration_s": 1.0}}
    for part, setting in (("a", "skew0.9/4"), ("b", "retrieval/4")):
        rows = [_row(setting, p, seed, 0.01 * (1 + seed) * (1.1 if p == "vlora" else 1.0))
                for seed in range(3) for p in ("vlora", "unmerged")]
        spread = [{"policy": "unmerged", "setting": setting, "runs": [], "spread": {}}] if part == "a" else []
        stopped = dict(stopped="after 3 seeds", argv=["--out", "out/b", "--settings", "retrieval"])
        write_report(tmp_path / part, dict(meta, **stopped) if part == "b" else meta, spread, rows,
                     ("vlora", "unmerged"))
    assert main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "ab")]) == 0
    res = json.loads((tmp_path / "ab" / "results.json").read_text())
    assert [e["setting"] for e in res["paired"]] == ["skew0.9/4", "retrieval/4"]
    assert all(e["seeds"] == 3 and e["vs"]["unmerged"]["verdict"] == "vlora worse" for e in res["paired"])
    assert len(res["runs"]) == 12 and len(res["spread"]) == 1 and len(res["meta"]["parts"]) == 2
    report = (tmp_path / "ab" / "report.md").read_text()
    assert "2 invocations merged" in report and "Commit abc" in report
    assert "Stopped early: out/b (retrieval): after 3 seeds." in report
    assert main(["--merge", str(tmp_path / "ab"), str(tmp_path / "a"), "--out", str(tmp_path / "aba")]) == 0
    again = json.loads((tmp_path / "aba" / "results.json").read_text())
    assert len(again["meta"]["parts"]) == 3 and next(e for e in again["paired"] if e["setting"] == "skew0.9/4")[
        "seeds"] == 3                  # the same seeds twice count once
    c = tmp_path / "c"
    c.mkdir()
    (c / "results.json").write_text(json.dumps(dict(res, meta=dict(res["meta"], policies=["vlora", "dlora"]))))
    with pytest.raises(SystemExit, match="different policies"):
        main(["--merge", str(tmp_path / "a"), str(c), "--out", str(tmp_path / "x")])
