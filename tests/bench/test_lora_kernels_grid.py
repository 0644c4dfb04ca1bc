"""The kernel benchmark's grid (benchmarks/bench_lora_kernels.py): every case is what its label says."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_lora_kernels  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return bench_lora_kernels


@pytest.mark.parametrize("mode", ["full", "quick", "cpu-smoke"])
def test_labels_are_unique_and_name_the_ranks(bench, mode):
    specs = bench.build_grid(mode)
    labels = [s.label for s in specs]
    assert len(labels) == len(set(labels))
    for s in specs:
        ranks = {s.ranks[a] for a in s.active}
        named = re.search(r"-(?:distinct-)?r(\d+) |x(\d+) ", s.name + " ")
        if named:                                   # dec-distinct-r<k>, dec-zipf-r<k>, pf-<n>x<k>
            assert ranks == {int(named.group(1) or named.group(2))}, s.label
        assert s.size == len(s.token_adapter)


def test_the_full_grid_keeps_its_38_cases_of_ranks_up_to_64_and_adds_ranks_128_and_256(bench):
    specs = bench.build_grid("full")
    assert sum(s.r_max <= 64 for s in specs) == 38
    high = [s for s in specs if s.r_max > 64]
    assert {s.r_max for s in high} == {128, 256}
    assert {s.kind for s in high} == {"prefill", "decode"}
