"""benchmarks/bench_cluster.py's peak search, without a cluster: a run meets the target below a hidden peak."""
import asyncio
import importlib.util
import math
from pathlib import Path

import pytest


def bench_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cluster.py"
    spec = importlib.util.spec_from_file_location("bench_cluster", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Searcher:
    """Bench.peak on runs that meet the target at rates up to ``peak`` (no cluster, no time spent)."""

    def __init__(self, mod, peak, tmp_path, **kw):
        args = mod.parse_args(["--out", str(tmp_path), *[x for k, v in kw.items() for x in (f"--{k}", str(v))]])
        self.bench = mod.Bench(None, args, {}, tmp_path, {})
        self.bench.save = lambda: None
        self.rates = []

        async def run(popularity, replicas, policy, rate, seed):
            self.rates.append(rate)
            return dict(meets_slo=rate <= peak)
        self.bench.run = run

    def search(self, start):
        found = asyncio.run(self.bench.peak("zipf", 1, "round_robin", start))
        return found, self.bench.results["peaks"][-1]


@pytest.mark.parametrize("start,peak", [(8.0, 45.0), (8.0, 8.5), (100.0, 9.0), (8.0, 7.9)])
def test_peak_search_doubles_then_bisects_to_the_resolution(tmp_path, start, peak):
    s = Searcher(bench_module(), peak, tmp_path, resolution=0.1, **{"max-points": 20})
    found, row = s.search(start)
    assert found is not None and found <= peak and row["bounded"]
    assert row["lowest_miss_rps"] > peak and row["lowest_miss_rps"] <= found * 1.1     # within the resolution
    up = 0
    while up + 1 < len(s.rates) and s.rates[up + 1] == 2 * s.rates[up]:
        up += 1
    down = 0
    while down + 1 < len(s.rates) and s.rates[down + 1] == s.rates[down] / 2:
        down += 1
    assert max(up, down) >= 1 or len(s.rates) <= 2          # brackets by doubling (or halving) first
    # each bisection runs the geometric mean of the tightest bracket so far
    assert row["runs"] == len(s.rates) <= math.ceil(math.log2(max(start / peak, peak / start))) + 6


def test_peak_search_stops_at_max_points_with_a_lower_bound(tmp_path):
    s = Searcher(bench_module(), 1e9, tmp_path, **{"max-points": 3})
    found, row = s.search(8.0)
    assert s.rates == [8.0, 16.0, 32.0] and found == 32.0 and not row["bounded"]


def test_peak_search_skips_runs_past_the_budget(tmp_path):
    s = Searcher(bench_module(), 20.0, tmp_path, **{"budget-s": 1})
    found, row = s.search(8.0)
    assert s.rates == [] and found is None and s.bench.results["skipped"]
