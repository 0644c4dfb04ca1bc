"""The offline tuner's choices, with the timings replaced by a cost model (the real ones need a GPU)."""

from __future__ import annotations

import pytest
import torch

from vlora.kernels import tuning
from vlora.kernels.atmm import TileConfig


def fake_tune(monkeypatch, plane_cost_us: float, reduce_cost_us: float, groups=None, timings=None,
              **kw) -> tuning.TilingTable:
    """Tune one packed group of one bucket where a shrink costs 10 µs / split (+ ``reduce_cost_us`` when it sums
    its planes) and an expand 5 µs + ``plane_cost_us`` per plane it reads. ``timings`` collects
    (op, planes read, config) of every timing."""
    def case(op, tokens, segments, dim, r, widths, dtype, dev, planes=1):
        return (op, planes)

    def timed(cases, cfg: TileConfig) -> float:
        op, planes = cases[0]
        if timings is not None:
            timings.append((op, planes, cfg))
        if op == "shrink":
            return (10.0 / cfg.split_k + (reduce_cost_us if cfg.reduce else 0.0)) * 1e-6
        return (5.0 + plane_cost_us * planes + cfg.block_m / 1000) * 1e-6

    monkeypatch.setattr(tuning, "_case", case)
    monkeypatch.setattr(tuning, "_time", timed)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake gpu")
    kw = {"token_buckets": (1024,), "segment_buckets": (1,), "ranks": (64,), "workers": 1} | kw
    return tuning.tune(groups or {"h": (4096, (4096,))}, progress=False, **kw)


@pytest.mark.parametrize("plane_cost_us, reduce_cost_us, planes", [(2.0, 1.0, 1), (0.1, 1.0, 8)])
def test_shrink_and_expand_are_chosen_as_a_pair(monkeypatch, plane_cost_us, reduce_cost_us, planes):
    """Summing the planes in the shrink costs it more; re-reading them costs the expand more: the tuner weighs
    the pair, not the shrink alone (alone, handing over 8 planes always wins)."""
    table = fake_tune(monkeypatch, plane_cost_us, reduce_cost_us)
    shrink = table.entries[tuning.shape_key("shrink", 1024, 1, 4096, 64)]
    assert shrink.split_k == 8 and shrink.planes == planes
    assert tuning.shape_key("expand", 1024, 1, 4096, 64) in table.entries


def test_a_shrink_whose_expand_another_group_chose_is_paired_with_that_expand(monkeypatch):
    """o (4096 -> 4096) and down (11008 -> 4096) share their expand key: down's shrink is chosen for the expand
    o's pair settled on (one plane), not as the fastest alone (eight planes)."""
    table = fake_tune(monkeypatch, 2.0, 1.0, groups={"o": (4096, (4096,)), "down": (11008, (4096,))})
    for k_in in (4096, 11008):
        assert table.entries[tuning.shape_key("shrink", 1024, 1, k_in, 64)].planes == 1


def test_split_k_configs_come_with_and_without_the_sum_in_the_shrink():
    space = tuning.search_space("shrink", 1024, 1, 64)
    assert {(c.split_k, c.reduce) for c in space} == {(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (8, 0), (8, 1)}
    assert all(c.planes == (c.split_k if not c.reduce else 1) for c in space)


def test_tables_of_nine_fields_keep_their_planes_read_by_the_expand():
    """Tables tuned before the shrink could sum its planes (9 fields) load with the expand summing them."""
    table = tuning.TilingTable({"shrink:T1024:S1:K4096:R64": [16, 64, 128, 4, 4, 3, 1, 1, 0]})
    cfg = table.get("shrink", 1024, 1, 4096, 64)
    assert cfg.reduce == 0 and cfg.planes == 4


def test_every_timed_candidate_is_built_ahead_by_the_workers(monkeypatch):
    """The compile workers get every variant the timing loop then launches: each shrink candidate, and each
    expand candidate with as many planes as the shrinks it is timed after hand over (several chunks, shared
    keys)."""
    from vlora.kernels import prebuild

    built: list[tuple] = []
    monkeypatch.setattr(prebuild, "prebuild_lora", lambda items, dtype, dev, workers: built.extend(items))
    timings: list[tuple] = []
    groups = {"o": (4096, (4096,)), "down": (11008, (4096,)), "qkv": (4096, (4096, 1024, 1024))}
    fake_tune(monkeypatch, 0.5, 1.0, groups=groups, timings=timings, token_buckets=(16, 1024),
              segment_buckets=(1, 4), ranks=(16, 128), workers=4, chunk=5)
    shrinks = {(it[4], it[2]) for it in built}
    expands = {(it[5], it[2].planes, it[3]) for it in built}
    assert timings and built
    assert {t[2] for t in timings if t[0] == "shrink"} <= {cfg for _, cfg in shrinks}
    assert {(t[1], t[2]) for t in timings if t[0] == "expand"} <= {(p, cfg) for _, p, cfg in expands}
    assert len(built) == len({(it[1], it[2], it[3], it[4], it[5]) for it in built})     # each variant once
