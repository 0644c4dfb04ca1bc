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
        return (op, planes, dim, r, tuple(widths), tokens, segments)

    def timed(cases, cfg: TileConfig) -> float:
        op, planes = cases[0][:2]
        if timings is not None:
            timings.append(cases[0] + (cfg,))
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
    # a variant is its configs and the shapes they are compiled for: in features, slice widths, rank, planes
    shrinks = {(it[4], it[5], it[1], it[2]) for it in built if it[3] is None}
    expands = {(it[5], it[1], it[2].planes, it[3]) for it in built if it[3] is not None}
    assert timings and built
    timed_shrinks = {(dim, widths, r, cfg) for op, _, dim, r, widths, *_, cfg in timings if op == "shrink"}
    assert timed_shrinks <= {(k, w, r, cfg) for k, w, r, cfg in shrinks}
    timed_expands = {(widths, r, planes, cfg) for op, planes, _, r, widths, *_, cfg in timings if op == "expand"}
    assert timed_expands <= expands
    assert len(built) == len({(it[1], it[2], it[3], it[4], it[5]) for it in built})     # each variant once


def test_a_merge_keeps_the_keys_that_pairs_outside_the_run_read():
    """qkv at rank 64 (rank total 192) reads the shrink key of rank total 256, as o at rank 256 does: a run of
    ranks 128 and 256 must keep it; rank total 512 (qkv at 128, gate_up at 256) is the run's alone."""
    groups = tuning.PRESETS["llama-7b"]
    shared = tuning.shared_keys(groups, tuning.TOKEN_BUCKETS, tuning.SEGMENT_BUCKETS, (128, 256))
    assert tuning.shape_key("shrink", 64, 64, 4096, 192) in shared
    assert tuning.shape_key("shrink", 64, 64, 4096, 512) not in shared
    assert tuning.shape_key("expand", 64, 64, 4096, 256) not in shared       # o and down are both in the run
    # o shares its shrink keys with the kernel grid's 4096 -> 11008 group: a run of the model alone keeps them
    model = tuning.shared_keys(groups, tuning.TOKEN_BUCKETS, tuning.SEGMENT_BUCKETS, tuning.RANKS)
    assert tuning.shape_key("shrink", 64, 64, 4096, 16) in model
    every = {f"{name}{i}": g for i, preset in enumerate(tuning.PRESETS.values()) for name, g in preset.items()}
    assert not tuning.shared_keys(every, tuning.TOKEN_BUCKETS, tuning.SEGMENT_BUCKETS, tuning.RANKS)


def test_a_fixed_key_keeps_its_config_and_its_pair_is_tuned_around_it(monkeypatch):
    """o at rank 64 on a shrink key whose config a merge keeps (one that hands over 4 planes, though the cost
    model prefers summing them in the shrink): the shrink is timed with that config alone, the expand with its
    planes."""
    skey = tuning.shape_key("shrink", 1024, 1, 4096, 64)
    kept = TileConfig(16, 64, 128, 4, 4, 3)
    timings: list[tuple] = []
    table = fake_tune(monkeypatch, 2.0, 1.0, groups={"o": (4096, (4096,))}, timings=timings, fixed={skey: kept})
    assert table.entries[skey] == kept
    assert {t[-1] for t in timings if t[0] == "shrink"} == {kept}
    assert {t[1] for t in timings if t[0] == "expand"} == {4}


def test_vlora_tune_merges_around_the_shared_keys_and_keeps_the_earlier_runs(monkeypatch, tmp_path):
    """`vlora tune --merge` of ranks 128/256: the merged table's key that qkv at rank 64 reads is handed to the
    tuner as fixed, the table is saved after each chunk and at the end, and the earlier runs' records are kept
    (the timings replaced: no GPU)."""
    import json

    from vlora import cli
    from vlora.kernels.limits import _limits

    shared = tuning.shape_key("shrink", 64, 64, 4096, 192)
    own = tuning.shape_key("shrink", 64, 64, 4096, 512)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"gpu": "g", "date": "2026-11-25", "merged_into": {"date": "2026-11-21"},
                                "entries": {shared: [16, 128, 128, 2, 4, 3, 1, 1, 0, 0],
                                            own: [16, 128, 128, 8, 4, 3, 1, 1, 0, 0]}}))
    seen = {}

    def fake(groups, **kw):
        seen.update(kw)
        table = tuning.TilingTable(meta={"gpu": "g", "date": "2026-11-29"})
        table.entries[own] = TileConfig(32, 128, 256, 4, 4, 3)
        kw["on_chunk"](table)
        seen["after_chunk"] = json.loads(path.read_text())
        return table

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _limits.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuning, "tune", fake)
    assert cli.main(["tune", "--preset", "llama-7b", "--ranks", "128,256", "--output", str(path)]) == 0
    _limits.cache_clear()
    assert seen["fixed"] == {shared: TileConfig(16, 128, 128, 2, 4, 3)}
    saved = json.loads(path.read_text())
    assert seen["after_chunk"]["entries"][own] == saved["entries"][own] == [32, 128, 256, 4, 4, 3, 1, 1, 0, 0]
    assert saved["entries"][shared] == [16, 128, 128, 2, 4, 3, 1, 1, 0, 0]
    assert saved["date"] == "2026-11-29"
    assert [e["date"] for e in saved["earlier"]] == ["2026-11-25", "2026-11-21"]


def test_a_fixed_expand_key_is_timed_with_its_config_alone(monkeypatch):
    ekey = tuning.shape_key("expand", 1024, 1, 4096, 64)
    kept = TileConfig(64, 128, 32, 1, 4, 2, 1, 1)
    timings: list[tuple] = []
    table = fake_tune(monkeypatch, 2.0, 1.0, groups={"o": (4096, (4096,))}, timings=timings, fixed={ekey: kept})
    assert table.entries[ekey] == kept
    assert {t[-1] for t in timings if t[0] == "expand"} == {kept}


def test_tune_takes_the_per_rank_shapes_of_a_tensor_parallel_model(monkeypatch, tmp_path):
    """`vlora tune --model random:llama-2-13b --tensor-parallel-size 1,2` tunes the groups one rank launches at
    each size: column-parallel outputs and row-parallel inputs halved at TP=2."""
    from vlora import cli

    seen = {}

    def fake(groups, **kw):
        seen.update(groups)
        return tuning.TilingTable(meta={"gpu": "g"})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuning, "tune", fake)
    argv = ["tune", "--model", "random:llama-2-13b", "--tensor-parallel-size", "1,2", "--output",
            str(tmp_path / "t.json")]
    assert cli.main(argv) == 0
    assert seen == {"qkv": (5120, (5120, 5120, 5120)), "o": (5120, (5120,)), "gate_up": (5120, (13824, 13824)),
                    "down": (13824, (5120,)), "qkv@tp2": (5120, (2560, 2560, 2560)), "o@tp2": (2560, (5120,)),
                    "gate_up@tp2": (5120, (6912, 6912)), "down@tp2": (6912, (5120,))}
    assert cli.main(["tune", "--preset", "llama-7b", "--tensor-parallel-size", "2"]) == 2     # a preset is TP=1
    assert cli.main(["tune", "--model", "random:llama-2-13b", "--tensor-parallel-size", "3"]) == 2   # 40 heads


def test_tune_takes_only_the_attention_groups_of_a_mixture_of_experts(tmp_path):
    """A mixture of experts launches LoRA kernels on attention only: its MLP groups are not tuned."""
    import transformers

    from vlora.cli import tp_groups

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, vocab_size=256)
    cfg.save_pretrained(tmp_path)
    assert set(tp_groups(str(tmp_path), [1, 2])) == {"qkv", "o", "qkv@tp2", "o@tp2"}
