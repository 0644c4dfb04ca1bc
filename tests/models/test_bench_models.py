"""benchmarks/bench_models.py's CPU dry run: tiny configs through parity with transformers + PEFT and the timed
cases, results written as JSON and markdown."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_models.py"


def test_dry_run_checks_parity_and_writes_both_reports(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--dry-run", "--models", "qwen3-vl-2b", "--batches", "1", "--parity-tokens", "2",
                     "--out", str(tmp_path)])
    res = json.loads((tmp_path / "models.json").read_text())
    assert rc == 0 and res["parity"]["qwen3-vl-2b"]["tokens_equal"]
    assert res["parity"]["qwen3-vl-2b"]["max_rel_logit_diff"] < 1e-4
    assert {(r["prompt"], r["adapters"]) for r in res["speed"]} == {("text", 0), ("text", 2), ("image", 0),
                                                                     ("image", 2)}
    assert all(r["prefill_tok_s"] > 0 for r in res["speed"])
    assert "| qwen3-vl-2b | 3 | yes |" in (tmp_path / "models.md").read_text()


def test_unknown_model_names_are_refused(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--models", "llama-9", "--out", str(tmp_path)])
