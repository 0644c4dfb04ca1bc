"""The ``--sampling`` option of benchmarks/bench_e2e.py and bench_serve.py: every setting's SamplingParams and
OpenAI body, the option's parsing, the checks that void a run, the table and its ratios to greedy, and the
loop over the settings on one tiny engine (CPU) with a failing setting recorded, not raised. No timings are
checked."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_e2e  # noqa: E402
import bench_serve  # noqa: E402

from vlora import SamplingParams  # noqa: E402
from vlora.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from vlora.engine.engine import Engine  # noqa: E402


def test_every_setting_does_the_same_work_with_its_own_fields():
    by = {s: bench_e2e.sampling_params(s, 8, 3) for s in bench_e2e.SAMPLING}
    for s, sps in by.items():
        assert len(sps) == 3 and all(sp.max_tokens == 8 and sp.ignore_eos for sp in sps), s
    assert all(sp.greedy for sp in by["greedy"] + by["min_tokens"])
    assert all(sp.min_tokens == 8 for sp in by["min_tokens"])
    for s in ("sampled", "seeded", "penalties", "logprobs"):
        assert all((sp.temperature, sp.top_p, sp.top_k) == (0.8, 0.95, 50) for sp in by[s]), s
    assert [sp.seed for sp in by["seeded"]] == [0, 1, 2] and all(sp.seed is None for sp in by["sampled"])
    pen = by["penalties"][0]
    assert (pen.presence_penalty, pen.frequency_penalty, pen.repetition_penalty) == (0.5, 0.5, 0.5) and pen.penalized
    assert pen.logit_bias == tuple((t, 1.0) for t in range(100, 110))
    assert by["logprobs"][0].logprobs == 5 and by["sampled"][0].logprobs is None
    with pytest.raises(ValueError, match="unknown sampling setting"):
        bench_e2e.sampling_fields("beam", 8, 0)


def test_the_option_puts_greedy_first_once():
    assert bench_e2e.parse_sampling("sampled,greedy,sampled") == ["greedy", "sampled"]
    assert bench_e2e.parse_sampling("logprobs") == ["greedy", "logprobs"]
    assert bench_e2e.parse_sampling(",".join(bench_e2e.SAMPLING)) == list(bench_e2e.SAMPLING)
    with pytest.raises(argparse.ArgumentTypeError, match="beam"):
        bench_e2e.parse_sampling("greedy,beam")


def test_openai_body_fields():
    assert bench_serve.openai_fields("greedy", 8, 0) == {"temperature": 0.0}
    assert bench_serve.openai_fields("seeded", 8, 5)["seed"] == 5
    assert bench_serve.openai_fields("min_tokens", 8, 0) == {"temperature": 0.0, "min_tokens": 8}
    body = bench_serve.openai_fields("penalties", 8, 0)
    assert body["logit_bias"] == {str(t): 1.0 for t in range(100, 110)}
    assert {k: body[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")} == \
        dict.fromkeys(("presence_penalty", "frequency_penalty", "repetition_penalty"), 0.5)
    assert bench_serve.openai_fields("logprobs", 8, 0)["logprobs"] == 5
    # every field but logit_bias's keys is SamplingParams' own: the body asks for what the offline run does
    for s in bench_e2e.SAMPLING:
        fields = dict(bench_serve.openai_fields(s, 8, 3))
        fields["logit_bias"] = {int(t): b for t, b in fields.get("logit_bias", {}).items()}
        assert SamplingParams(max_tokens=8, ignore_eos=True, **fields) == bench_e2e.sampling_params(s, 8, 4)[3]


def test_a_run_that_did_not_do_the_work_does_not_count():
    ok = {"errors": [], "tokens": [4, 4], "logprobs": [4, 4]}
    assert bench_e2e.output_check("sampled", ok, 4) is None
    assert "expected 4" in bench_e2e.output_check("sampled", dict(ok, tokens=[4, 2]), 4)
    assert "failed" in bench_e2e.output_check("sampled", dict(ok, errors=["r1: error: nan"]), 4)
    assert bench_e2e.output_check("sampled", dict(ok, logprobs=[0, 0]), 4) is None
    assert "logprobs" in bench_e2e.output_check("logprobs", dict(ok, logprobs=[0, 0]), 4)


def test_table_ratios_to_greedy_and_failures():
    res = dict(requests=4, input_len=16, output_len=4, sampling={
        "greedy": {"adapters": 100.0, "base": 200.0, "ttft_mean_s": {"adapters": 0.1, "base": 0.05}},
        "sampled": {"base": 150.0, "ttft_mean_s": {"base": 0.05}, "error": {"adapters": "boom"}}})
    lines = bench_e2e.sampling_table(res)
    assert res["sampling"]["greedy"]["ratio_to_greedy"] == {"adapters": 1.0, "base": 1.0}
    assert res["sampling"]["sampled"]["ratio_to_greedy"] == {"base": 0.75}
    assert list(res["sampling"]["greedy"])[:3] == ["adapters", "base", "ratio_to_greedy"]
    assert any("0.75x" in line and "FAILED" in line for line in lines)
    assert lines[-1] == "  sampled (adapters) failed: boom"
    assert bench_e2e.sampling_table({"sampling": {}}) == []


def test_settings_loop_on_one_engine_records_a_failure_and_goes_on(monkeypatch):
    """Greedy and sampled on the tiny engine, between them a setting whose second request the engine refuses:
    its error is recorded, its first request aborted, the setting after it still runs (not fooled by the
    aborted request's output), and nothing is left in the engine."""
    eng = Engine(EngineConfig(model=ModelConfig("random:tiny-llama"), cache=CacheConfig(num_blocks=256)))
    real_fields, real_add = bench_e2e.sampling_fields, eng.add_request
    refused = 12345                              # the failing setting's seed

    def fields(setting, max_tokens, i):
        return dict(temperature=0.0, seed=refused) if setting == "penalties" else real_fields(setting, max_tokens, i)

    added = []

    def add_request(prompt, adapter=None, params=None, **kw):
        if params is not None and params.seed == refused and added and added[-1][1] == refused:
            raise RuntimeError("refused")
        rid = real_add(prompt, adapter, params, **kw)
        added.append((rid, None if params is None else params.seed))
        return rid

    monkeypatch.setattr(bench_e2e, "sampling_fields", fields)
    monkeypatch.setattr(eng, "add_request", add_request)
    args = argparse.Namespace(sampling=["greedy", "penalties", "sampled"], output_len=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    sampling = {s: {} for s in args.sampling}
    bench_e2e.run_sampling(args, eng, eng.device, prompts, None, "base", sampling, warm_up=True)
    assert sampling["greedy"]["base"] > 0 and sampling["sampled"]["base"] > 0
    assert set(sampling["greedy"]["ttft_mean_s"]) == {"base"} and "error" not in sampling["sampled"]
    assert sampling["penalties"] == {"error": {"base": "RuntimeError: refused"}}
    assert [seed for _, seed in added].count(refused) == 1      # the warm-up's first request, then refused
    while eng.has_unfinished():                                 # the aborted request's output, if still pending
        assert all(out.finish_reason == "abort" for out in eng.step())
    assert eng.scheduler.num_unfinished == 0
