"""benchmarks/policy_pairs.py: the vlora / unmerged tok/s of each GPU, sampling setting and workload from the
result files of bench_e2e and bench_serve, a run cut before its file named, and the report written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import policy_pairs  # noqa: E402


def write(out: Path, name: str, sampling: dict) -> None:
    (out / name).mkdir()
    (out / name / "result.json").write_text(json.dumps({"sampling": sampling}))


def test_e2e_pairs_per_gpu_and_a_cut_run_named(tmp_path):
    write(tmp_path, "e2e-unmerged-gpu0", {"greedy": {"adapters": 100.0, "base": 200.0}})
    write(tmp_path, "e2e-vlora-gpu0", {"greedy": {"adapters": 110.0, "base": 190.0}})
    write(tmp_path, "e2e-unmerged-gpu1", {"greedy": {"adapters": 100.0, "base": 200.0}})
    (tmp_path / "e2e-vlora-gpu1").mkdir()                      # cut before it wrote its file
    runs = policy_pairs.collect(tmp_path, "e2e")
    rows = policy_pairs.pairs(runs, "e2e")
    assert [(r["gpu"], r["workload"], round(r["ratio"], 3)) for r in rows] == [(0, "adapters", 1.1), (0, "base", 0.95)]
    text = policy_pairs.report(rows, "e2e", runs)
    assert "GPU 1: vlora" in text and "mean 1.025" in text


def test_serve_pairs_read_the_http_figures(tmp_path):
    http = lambda a, b: {"http": {"adapters": {"tok_s": a}, "base": {"tok_s": b}}}    # noqa: E731
    write(tmp_path, "serve-unmerged-gpu0", {"sampled": http(50.0, 80.0)})
    write(tmp_path, "serve-vlora-gpu0", {"sampled": http(45.0, 80.0)})
    write(tmp_path, "e2e-vlora-gpu0", {"sampled": {"adapters": 1.0, "base": 1.0}})      # another part's
    rows = policy_pairs.pairs(policy_pairs.collect(tmp_path, "serve"), "serve")
    assert [(r["setting"], r["workload"], r["ratio"]) for r in rows] == [("sampled", "adapters", 0.9),
                                                                         ("sampled", "base", 1.0)]


def test_pairs_summarised_per_setting_with_an_interval(tmp_path):
    for gpu, (a, b) in enumerate(((100.0, 104.0), (100.0, 96.0), (100.0, 100.0))):
        write(tmp_path, f"e2e-unmerged-gpu{gpu}", {"greedy": {"adapters": a, "base": 50.0}})
        write(tmp_path, f"e2e-vlora-gpu{gpu}", {"greedy": {"adapters": b, "base": 50.0}})
    runs = policy_pairs.collect(tmp_path, "e2e")
    rows = policy_pairs.pairs(runs, "e2e")
    assert policy_pairs.summary(rows) == {("greedy", "adapters"): [1.04, 0.96, 1.0], ("greedy", "base"): [1.0] * 3}
    text = policy_pairs.report(rows, "e2e", runs)
    assert "| greedy | adapters | 3 | 1.000 [0.901, 1.099] |" in text       # t(2) = 4.303, sd 0.04
    assert "| greedy | base | 3 | 1.000 [1.000, 1.000] |" in text
