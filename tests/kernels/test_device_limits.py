"""Tile choices fit the GPU they run on: configs of the tables and the fallback, under mocked A100, L40S and
RTX 4090 properties, never ask for more shared memory than the device has; the fallback sizes split-K by the
device's SM count; caps through the environment."""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
from triton.runtime.errors import OutOfResources

from vlora.kernels import atmm, limits, tuning
from vlora.kernels.atmm import TileConfig
from vlora.kernels.attention import prefill_shared, prefill_tiles
from vlora.kernels.merge import TILE, UNMERGE_WALK, k_tile, unmerge_shared, unmerge_stages

# name -> (opt-in shared memory per block, SMs), as the CUDA driver reports them
GPUS = {"NVIDIA A100-SXM4-80GB": (166912, 108), "NVIDIA L40S": (101376, 142),
        "NVIDIA GeForce RTX 4090": (101376, 128)}
H100 = ("NVIDIA H100 80GB HBM3", 232448, 132)


@pytest.fixture
def gpu(monkeypatch):
    """Make torch report one CUDA device with the given properties (Triton's driver reports none on CPU)."""
    def use(name: str, smem: int, sms: int) -> limits.DeviceLimits:
        props = SimpleNamespace(name=name, shared_memory_per_block_optin=smem, multi_processor_count=sms)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
        monkeypatch.setattr(limits, "_triton_shared", lambda index: None)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        limits._limits.cache_clear()
        return limits.device_limits()

    yield use
    limits._limits.cache_clear()


def grid_shapes():
    """(op, tokens, segments, dim, rank) of every key the tables and the tuner cover, for the presets' groups."""
    groups = {g for preset in tuning.PRESETS.values() for g in preset.values()}
    for (k_in, widths), t, s, r in itertools.product(groups, tuning.TOKEN_BUCKETS, tuning.SEGMENT_BUCKETS,
                                                     tuning.RANKS):
        if s <= t:
            yield "shrink", t, s, k_in, len(widths) * r
            yield "expand", t, s, sum(widths), r


@pytest.mark.parametrize("name", GPUS)
def test_limits_are_read_from_the_device(gpu, name):
    smem, sms = GPUS[name]
    assert gpu(name, smem, sms) == limits.DeviceLimits(name, smem, sms)


@pytest.mark.parametrize("name", GPUS)
@pytest.mark.parametrize("table_of", [None, "nvidia-h100-80gb-hbm3", "nvidia-h200"])
def test_every_atmm_config_fits_the_device(gpu, name, table_of):
    """The fallback (no table for this GPU) and, at worst, a Hopper table copied onto it: each config as the
    launchers fit it, in 16-bit and 32-bit data, within the device's shared memory."""
    lim = gpu(name, *GPUS[name])
    table = tuning.TilingTable.load(table_of) if table_of else tuning.TilingTable.load()
    assert table.limits == lim and (table.entries or table_of is None)
    for (op, t, s, dim, r), elem in itertools.product(grid_shapes(), (2, 4)):
        a, b = (elem, elem) if op == "shrink" else (4, elem)
        cfg = atmm.fit_shared(table.get(op, t, s, dim, r), a, b)
        assert atmm.shared_need(cfg, a, b) <= lim.shared_bytes, (op, t, s, dim, r, elem, cfg)


@pytest.mark.parametrize("name", [*GPUS, H100[0]])
def test_the_fallback_splits_k_for_the_devices_sm_count(gpu, name):
    smem, sms = GPUS.get(name, H100[1:])
    table = tuning.TilingTable(limits=gpu(name, smem, sms))
    for t, r, k in itertools.product((1, 4, 16), (8, 16, 64), (4096, 11008)):
        cfg = table.get("shrink", t, 1, k, r)
        programs = -(-t // cfg.block_m) * -(-r // cfg.block_n)
        assert programs * cfg.split_k >= 2 * sms or cfg.split_k == 8 or k // (cfg.split_k * 2) < 256
        assert cfg.split_k == 1 or programs * cfg.split_k // 2 < 2 * sms       # the smallest split that does


@pytest.mark.parametrize("name", GPUS)
def test_attention_and_merge_tiles_fit_the_device(gpu, name):
    lim = gpu(name, *GPUS[name])
    for head_dim, elem in itertools.product((64, 128, 256), (2, 4)):
        bm, bn = prefill_tiles(head_dim, elem, lim.shared_bytes)
        assert prefill_shared(bm, bn, head_dim, elem) <= lim.shared_bytes
    bm, bn, _ = TILE
    for rank, w_bytes, f_bytes in itertools.product((1, 8, 16, 64, 128), (2, 4), (2, 4)):
        bk = k_tile(rank)
        stages = unmerge_stages(bm, bn, bk, w_bytes, f_bytes, UNMERGE_WALK[1], lim.shared_bytes)
        assert stages >= 1 and unmerge_shared(bm, bn, bk, w_bytes, f_bytes, stages) <= lim.shared_bytes


def test_hopper_keeps_its_tuned_configs(gpu):
    """The limits come from the device, and on the GPU the tables were tuned on nothing is cut."""
    lim = gpu(*H100)
    table = tuning.TilingTable.load("nvidia-h100-80gb-hbm3")
    for key, cfg in table.entries.items():          # tuned in bfloat16: the shrink reads 16-bit x, the expand fp32 v
        assert atmm.fit_shared(cfg, *((2, 2) if key.startswith("shrink") else (4, 2))) == cfg
    assert prefill_tiles(128, 2, lim.shared_bytes) == (64, 32)
    assert unmerge_stages(*TILE[:2], 64, 2, 2, UNMERGE_WALK[1], lim.shared_bytes) == UNMERGE_WALK[1]


def test_environment_caps_the_limits(gpu, monkeypatch):
    monkeypatch.setenv("VLORA_MAX_SHARED_MEM", "101376")
    monkeypatch.setenv("VLORA_MAX_SMS", "142")
    monkeypatch.setattr(limits, "_enforce_cap_in_triton", lambda: None)
    assert gpu(*H100) == limits.DeviceLimits(H100[0], 101376, 132)
    monkeypatch.setenv("VLORA_MAX_SMS", "many")
    limits._limits.cache_clear()
    with pytest.raises(ValueError, match="VLORA_MAX_SMS"):
        limits.device_limits()


def test_no_table_for_the_gpu_suggests_vlora_tune(gpu, caplog):
    gpu("NVIDIA L40S", *GPUS["NVIDIA L40S"])
    with caplog.at_level(logging.WARNING, logger="vlora.kernels.tuning"):
        assert not tuning.TilingTable.load().entries
    assert "vlora tune" in caplog.text


def test_a_config_triton_refuses_steps_down_once_and_is_remembered(monkeypatch):
    monkeypatch.setattr(atmm, "_refitted", {})
    tried = []

    def launch(cfg):
        tried.append(cfg)
        if atmm.shared_need(cfg, 2, 2) > 40_000:
            raise OutOfResources(atmm.shared_need(cfg, 2, 2), 40_000, "shared memory")

    big = atmm.TileConfig(64, 64, 128, num_stages=3)
    atmm._launch_fitting("shrink", big, (2, 2), torch.device("cpu"), launch)
    assert atmm.shared_need(tried[-1], 2, 2) <= 40_000 and len(tried) > 2
    tried.clear()
    atmm._launch_fitting("shrink", big, (2, 2), torch.device("cpu"), launch)
    assert len(tried) == 1                        # the config that ran is used straight away


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernels_fitted_to_a_small_device_give_the_reference_results(device, monkeypatch):
    """A config too large for the device is cut down at launch, and the cut-down kernels compute the same."""
    from tests.kernels.test_atmm import make_case, run_both

    small = limits.DeviceLimits("small", 12 * 1024, 8)
    monkeypatch.setattr(limits, "_limits", lambda dev: small)
    big_s, big_e = TileConfig(32, 32, 128, num_stages=3), TileConfig(32, 64, 64, num_stages=3)
    assert atmm.shared_need(big_s, 4, 4) > small.shared_bytes and atmm.shared_need(big_e, 4, 4) > small.shared_bytes
    launched = []
    real = atmm._launch_fitting
    monkeypatch.setattr(atmm, "_launch_fitting", lambda k, cfg, sizes, dev, launch: (
        launched.append((cfg, sizes)), real(k, cfg, sizes, dev, launch)))
    w, x, segs = make_case("uniform", 5, [1, 7, 33, 2], ranks=[8, 16], dtype=torch.float32, device=device)
    v, v_ref, y, y_ref, *_ = run_both(segs, w, x, big_s, big_e, device)
    torch.testing.assert_close(v.double().cpu(), v_ref.cpu(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.double().cpu(), y_ref.double().cpu(), rtol=1e-4, atol=1e-4)
    assert len(launched) == 2 and all(atmm.shared_need(c, *s) <= small.shared_bytes for c, s in launched)
