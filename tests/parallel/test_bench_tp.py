"""benchmarks/bench_tp.py's dry run: one TP=2 configuration on a tiny model (gloo), in this process, and the
summary it feeds."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tp  # noqa: E402


def test_dry_run_phase_and_summary(tmp_path):
    args = argparse.Namespace(device="cpu", dtype="float32", requests=2, input_len=6, output_len=2, adapters=2,
                              ranks=[8, 16], all_reduce="auto", max_batched_tokens=None, reduce_reps=3,
                              sampling="greedy,sampled", async_scheduling="on")
    dirs = bench_tp.write_adapters("random:tiny-llama", 2, [8, 16], tmp_path, torch.float32)
    bench_tp.run_phase(args, "random:tiny-llama", 2, dirs, tmp_path / "phase.json")
    res = json.loads((tmp_path / "phase.json").read_text())       # written as each measurement finishes
    assert res["adapters_tok_s"] > 0 and res["base_tok_s"] > 0
    assert res["adapters_step_ms_b2"] > 0 and res["base_step_ms_b1"] > 0
    assert res["base_step_ms_b1_sampled"] > 0 and res["adapters_step_ms_b1_sampled"] > 0
    assert res["adapters_tok_s_sampled"] > 0 and res["base_tok_s_sampled"] > 0 and res["async_scheduling"] == "on"
    assert "overlapped_iterations" in res
    assert res["floor_ms_b1"] > 0 and res["floor_ms_b2"] > res["floor_ms_b1"]        # the KV adds at batch 2
    assert res["weight_bytes_per_gpu"] > 0 and res["base_step_vs_floor_b1"] > 0
    assert res["all_reduce_chosen"] == "nccl" and res["all_reduce_timings"] == []     # gloo: no calibration
    for b in (1, 2):        # on the CPU no GPU gaps; the worker's trace arrives (an empty one)
        assert set(res[f"gaps_b{b}"]) == {"rank0_gpu_gap_us", "rank0_host_us", "rank0_step_us", "rank1_gpu_gap_us"}
        assert res[f"gaps_b{b}"]["rank0_step_us"] > 0
    ar = res["all_reduce_ms"]
    assert set(ar) == {"nccl_eager_b1", "nccl_eager_b2"} and ar["nccl_eager_b2"]["bytes"] == 2 * 64 * 4
    assert ar["nccl_eager_b1"]["per_step_ms"] == ar["nccl_eager_b1"]["per_call_ms"] * 2 * 2
    summary = dict(date="d", device="cpu", dtype="float32", input_len=6, output_len=2, adapters=2, ranks=[8, 16],
                   all_reduce="nccl", **{"13b_tp1": res, "13b_tp2": res, "34b_tp2": {"error": "exit code 1"},
                                         "70b_tp4": dict(res, tp=4), "70b_tokens_equal": False, "70b_tokens_tp": 4})
    text = "\n".join(bench_tp.summarize(summary, 2))
    assert "| e2e output tok/s, 2 adapters |" in text and "| batch 2 (512 B) |" in text
    assert "| e2e output tok/s, 2 adapters, sampled |" in text
    assert "34b_tp2 failed: exit code 1" in text
    assert "Llama-2-70B shape at TP=4, 2 adapters:" in text and "| decode step floor on one GPU, batch 1 (ms) |" in text
    assert "greedy tokens of 8 requests at TP=4 and TP=1: DIFFERENT" in text
    assert "| GPU time between decode replays, batch 2, adapters, per rank (us) | - / - | - / - | |" in text


def test_token_check_phase_writes_the_greedy_tokens(tmp_path):
    """``70b-tokens``'s phase (here the tiny preset at TP=1): the greedy tokens of its requests, with and without
    adapters, as JSON."""
    args = argparse.Namespace(device="cpu", dtype="float32", ranks=[8, 16], all_reduce="auto")
    dirs = bench_tp.write_adapters("random:tiny-llama", 2, [8, 16], tmp_path / "a", torch.float32)
    bench_tp.run_tokens(args, "random:tiny-llama", 1, dirs, tmp_path / "tokens.json")
    got = json.loads((tmp_path / "tokens.json").read_text())
    assert got["tp"] == 1 and len(got["tokens"]) == bench_tp.TOKEN_PROMPTS
    assert all(len(t) == 16 for t in got["tokens"])

