"""benchmarks/bench_traffic.py and its workload (vlora.bench.traffic): the trace's laws on a large draw, its
determinism, the gap and percentile rules, the options' errors, and one small sweep against `vlora serve` on the
CPU that must write its three files with every request finished. No timings are checked."""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_traffic  # noqa: E402

from vlora.bench.traffic import chunk_gaps, lognormal_sigma, percentile, traffic_trace, zipf_shares  # noqa: E402

NAMES = [f"a{i}" for i in range(20)]


def trace(seed=0, rate=50.0, duration=200.0, **kw):
    kw = {"max_model_len": 4096, "vocab_size": 32000, **kw}
    return traffic_trace(rate, duration, NAMES, seed, **kw)


def test_the_trace_is_a_function_of_the_seed():
    a, b = trace(seed=7, duration=5), trace(seed=7, duration=5)
    assert a == b and len(a) > 100
    assert trace(seed=8, duration=5) != a
    assert traffic_trace(51.0, 5, NAMES, 7, max_model_len=4096, vocab_size=32000) != a   # each rate its own


def test_the_trace_follows_its_laws():
    reqs = trace()                                    # ~10,000 requests
    n = len(reqs)
    assert abs(n - 50 * 200) < 5 * math.sqrt(50 * 200)          # Poisson count
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 200
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.1)        # exponential: sd = mean
    base = sum(r.adapter is None for r in reqs)
    assert 0.08 < base / n < 0.12
    counts = Counter(r.adapter for r in reqs if r.adapter is not None)
    assert counts.most_common(1)[0][0] == "a0"
    shares = zipf_shares(len(NAMES))
    assert shares[0] / shares[1] == pytest.approx(2.0)
    for i in (0, 1, 4):                               # Zipf-1.0: a_i's share of the adapter requests ~ 1/(i+1)
        assert counts[f"a{i}"] / (n - base) == pytest.approx(shares[i], rel=0.15)
    prompts = [len(r.prompt) for r in reqs]
    outputs = [r.output_len for r in reqs]
    assert statistics.median(prompts) == pytest.approx(256, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(128, rel=0.1)
    assert percentile(prompts, 99) == pytest.approx(2048, rel=0.25)
    assert percentile(outputs, 99) == pytest.approx(1024, rel=0.25)
    assert all(1 <= p and 1 <= o and p + o <= 4096 for p, o in zip(prompts, outputs))
    assert all(3 <= t < 32000 for r in reqs[:50] for t in r.prompt)


def test_lengths_are_clipped_to_the_context():
    reqs = trace(duration=20, max_model_len=300, vocab_size=256)
    assert max(len(r.prompt) for r in reqs) == 299                   # clipped, not redrawn
    assert all(len(r.prompt) + r.output_len <= 300 and r.output_len >= 1 for r in reqs)
    assert all(t < 256 for r in reqs for t in r.prompt)
    tiny = trace(duration=20, prompt_median=1, prompt_p99=4, output_median=1, output_p99=2)
    assert min(len(r.prompt) for r in tiny) == 1 and min(r.output_len for r in tiny) == 1


def test_sigma_gaps_and_percentiles():
    assert lognormal_sigma(256, 2048) == pytest.approx(math.log(8) / 2.326)
    with pytest.raises(ValueError):
        lognormal_sigma(10, 5)
    assert chunk_gaps([1.0, 1.5, 1.75], [1, 3, 1]) == [0.5, 0.0, 0.0, 0.25]
    assert chunk_gaps([2.0], [3]) == [0.0, 0.0]
    assert percentile([], 99) is None
    assert percentile(list(range(1, 101)), 99) == 99 and percentile([5, 1, 3], 50) == 3


def test_the_slo_rate_is_held_by_every_rate_below_it():
    def sweep(*met):
        return [{"rate": r, "meets_slo": m} for r, m in zip((4, 8, 12, 16), met)]

    assert bench_traffic.slo_rate(sweep(True, True, False, True)) == 8      # 16 held by its draw: not promised
    assert bench_traffic.slo_rate(sweep(True, True, True, True)) == 16
    assert bench_traffic.slo_rate(sweep(False, True, True, True)) is None
    assert bench_traffic.slo_rate(list(reversed(sweep(True, False, True, True)))) == 4


@pytest.mark.parametrize("bad", [["--rates", "2,x"], ["--rates", "0"], ["--duration", "-1"],
                                 ["--prompt-median", "300", "--prompt-p99", "200"], ["--base-share", "1.5"],
                                 ["--model", "llama"], ["--adapters", "0"]])
def test_bad_options_are_argparse_errors(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bench_traffic.parse_args(["--out", "/tmp/x", *bad])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_small_sweep_on_the_cpu(tmp_path):
    res = bench_traffic.main(["--model", "random:tiny-llama", "--device", "cpu", "--adapters", "3", "--rates", "2,4",
                              "--duration", "1.5", "--prompt-median", "8", "--prompt-p99", "32", "--output-median",
                              "4", "--output-p99", "16", "--warmup", "2", "--seed", "3", "--out", str(tmp_path)])
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"traffic-cpu.{ext}").stat().st_size > 0
    saved = json.loads((tmp_path / "traffic-cpu.json").read_text())
    assert saved["slo_rate"] == res["slo_rate"] and "slo_rate" in saved
    assert [r["rate"] for r in saved["rates"]] == [2.0, 4.0] and saved["args"]["seed"] == 3
    for r in saved["rates"]:
        assert r["sent"] > 0 and r["finished"] == r["sent"] and r["errors"] == r["cancelled"] == 0, r
        assert r["ttft_p99_ms"] is not None and r["output_tokens"] > 0
        # the server's counts over the rate, from /metrics: on the CPU every forward runs eagerly
        s = r["server"]
        assert s["iterations_eager"] > 0 and s["iterations_decode_graph"] == s["iterations_mixed_graph"] == 0, s
        assert s["adapter_loads"] == 0                      # all given at start
    assert "| 4 |" in (tmp_path / "traffic-cpu.md").read_text()


def test_adapters_beyond_the_distinct_ones_link_to_their_files(tmp_path):
    args = bench_traffic.parse_args(["--model", "random:tiny-llama", "--adapters", "5", "--distinct", "2",
                                     "--ranks", "4,8", "--out", str(tmp_path)])
    dirs = bench_traffic.write_traffic_adapters(args, tmp_path / "a")
    assert list(dirs) == [f"a{j}" for j in range(5)]
    for j in range(5):
        files = sorted(p.name for p in Path(dirs[f"a{j}"]).iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
        linked = (Path(dirs[f"a{j}"]) / "adapter_model.safetensors").is_symlink()
        assert linked == (j >= 2)
        if linked:
            assert (Path(dirs[f"a{j}"]) / "adapter_model.safetensors").resolve() == \
                (Path(dirs[f"a{j % 2}"]) / "adapter_model.safetensors").resolve()
    with pytest.raises(SystemExit):
        bench_traffic.parse_args(["--max-loaded-adapters", "2", "--out", str(tmp_path)])   # needs --on-demand


def test_a_small_sweep_loading_adapters_on_demand(tmp_path):
    """Six adapters over two weight sets, none given at start, at most six kept loaded (never all busy: no 429 under a loaded CI): every request finishes."""
    bench_traffic.main(["--model", "random:tiny-llama", "--device", "cpu", "--adapters", "6", "--distinct", "2",
                        "--on-demand", "--max-loaded-adapters", "6", "--zipf", "0.5", "--rates", "4",
                        "--duration", "1.5", "--prompt-median", "8", "--prompt-p99", "32", "--output-median", "4",
                        "--output-p99", "16", "--warmup", "2", "--seed", "5", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "traffic-cpu.json").read_text())
    r = saved["rates"][0]
    assert r["sent"] > 0 and r["finished"] == r["sent"] and r["errors"] == r["cancelled"] == 0, r
    # every adapter the rate's trace names is loaded once, but a0 (loaded by the warm-up request) and none evicted
    trace = traffic_trace(4.0, 1.5, [f"a{j}" for j in range(6)], 5, max_model_len=saved["max_model_len"],
                          vocab_size=256, prompt_median=8, prompt_p99=32, output_median=4, output_p99=16, alpha=0.5)
    named = {q.adapter for q in trace} - {None, "a0"}
    assert r["server"]["adapter_loads"] == len(named) and r["server"]["adapter_evictions"] == 0, r["server"]
    assert "loaded on first request (at most 6 kept)" in (tmp_path / "traffic-cpu.md").read_text()
