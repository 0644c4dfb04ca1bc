"""Start-up kernel builds: the variants walked cover every config the runner can pick, and they launch."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlora.engine.warmup import lora_items, lora_variants
from vlora.kernels.atmm import expand_hoisted, fit_shared
from vlora.kernels.tuning import TilingTable
from vlora.lora.batch import GROUPS
from vlora.lora.merge import group_widths

SHAPES = {"qkv": 4096, "o": 4096, "gate_up": 4096, "down": 11008}
WIDTHS = group_widths(4096, 4096, 4096, 11008)
TABLES = {"shipped-h100": TilingTable.load("nvidia-h100-80gb-hbm3"), "empty": TilingTable()}


@functools.cache
def _variants(name: str, max_rank: int, max_tokens: int, max_seqs: int) -> dict:
    return lora_variants(TABLES[name], SHAPES, WIDTHS, max_rank, max_tokens, max_seqs, pairs=True)


@pytest.mark.parametrize("name", list(TABLES))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_config_the_runner_picks_is_built(name, data):
    """What device_store.build_kernel_batch picks for any batch within the limits is among the variants, also for
    mixed mode in one launch (segments of rank r paired with the merged adapter's rank r2)."""
    table = TABLES[name]
    max_tokens, max_seqs, max_rank = 2048, 64, 64
    variants = _variants(name, max_rank, max_tokens, max_seqs)
    t = data.draw(st.integers(1, max_tokens))
    s = data.draw(st.integers(1, min(t, max_seqs)))
    r = data.draw(st.integers(1, max_rank))
    r2 = data.draw(st.integers(1, max_rank))
    for g, modules in GROUPS.items():
        for total, rank, paired in ((r, r, False), (r + r2, max(r, r2), True)):
            shrink = table.get("shrink", t, s, SHAPES[g], len(modules) * total)
            expand = table.get("expand", t, s, sum(WIDTHS[g]), rank)
            assert (g, shrink, expand, expand_hoisted(fit_shared(expand, 4, 2), rank), paired) in variants


def test_variants_are_finite_and_shared_across_counts():
    """One variant per distinct config: far fewer than the (tokens, segments, rank) combinations."""
    items = lora_items(TABLES["shipped-h100"], SHAPES, WIDTHS, 64, 8192, 64, 2)
    assert 0 < len(items) < 8 * 4 * 64 * len(GROUPS)
    assert len({(i[0], i[2], i[3]) for i in items}) <= len(items)


def test_worker_builds_its_share(tmp_path):
    """The compile worker (a fresh interpreter) launches its share of the variants; on the CPU, in Triton's
    interpreter, on a small model shape."""
    shapes = {"qkv": 64, "o": 64, "gate_up": 64, "down": 128}
    widths = group_widths(64, 32, 64, 128)
    items = lora_items(TilingTable(), shapes, widths, 16, 64, 4, 4, pairs=True)
    assert any(i[-1] for i in items) and not all(i[-1] for i in items)
    rows = [[g, r, sh.as_list(), ex.as_list(), k, list(w), p] for g, r, sh, ex, k, w, p in items]
    path = tmp_path / "variants.json"
    path.write_text(json.dumps(rows))
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "vlora.kernels.prebuild", str(path), "0", "4", "float32", "cpu", "pdl"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_compile_counter_counts_hook_calls():
    from vlora.kernels import compiles

    compiles.install()
    from triton import knobs

    mark = compiles.snapshot()
    assert not knobs.runtime.jit_cache_hook(key="k", fn=None)        # falsy: the compile goes ahead
    knobs.runtime.jit_post_compile_hook(key="k", fn=None)
    got = compiles.since(mark)
    assert got["compiles"] == 1 and got["compile_s"] >= 0


def test_merge_build_launches_every_k_tile():
    """``build_merge`` runs the merge, the unmerge and a merge without a record once per variant (ranks up to 64:
    rank 1, then K tiles 16, 32, 64, each with ranks a multiple of 16 and not), each on a slice the tile divides
    and one it does not; on the CPU in Triton's interpreter."""
    from vlora.engine.warmup import build_merge

    assert build_merge(torch.float32, torch.device("cpu"), 64) == 42
    assert build_merge(torch.float32, torch.device("cpu"), 16) == 18


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_build_runs_the_finishing_kernels(monkeypatch, dtype):
    """The start-up merges leave exceptions past each row's first in every dtype, so the kernels that finish them
    are built at start-up too (with weights of 1e-30, float16 had none: they were built at the first real
    merge)."""
    from vlora.engine.warmup import build_merge
    from vlora.kernels import merge as kernels

    finished = []
    real = kernels._finish_rows

    def spy(*args, **kw):
        idx, bits = real(*args, **kw)
        finished.append(idx.numel())
        return idx, bits

    monkeypatch.setattr(kernels, "_finish_rows", spy)
    build_merge(dtype, torch.device("cpu"), 1)
    assert len(finished) == 2 and all(n > 0 for n in finished)


@pytest.mark.gpu
def test_gpu_merge_after_start_up_builds_nothing():
    """A merging policy's engine builds the merge kernels at start-up: merges (one reusing its record) and
    unmerges then build none."""
    import tempfile
    from pathlib import Path

    from vlora import LLM
    from vlora.kernels import compiles
    from vlora.lora.random_adapter import write_random_adapter

    llm = LLM("random:tiny-llama", device="cuda", kv_cache_memory_gb=1, max_num_seqs=8, max_lora_rank=64,
              policy="vlora")
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate((8, 64)):
            llm.register_adapter(f"a{i}", write_random_adapter(Path(tmp) / f"a{i}", llm.engine.adapters.shape, r,
                                                               seed=i))
    mark = compiles.snapshot()
    for name in ("a0", "a1", "a1"):                   # the second merge of a1 reuses its record
        llm.engine.merge_adapter(name)
        llm.engine.unmerge_adapter()
    torch.cuda.synchronize()
    assert llm.engine.runner.modes.num_reused == 1
    assert compiles.since(mark)["compiles"] == 0, compiles.since(mark)


@pytest.mark.gpu
def test_gpu_engine_builds_kernels_and_serves_without_new_builds():
    """On a GPU: start-up builds the variants; a mixed batch of prompt lengths and adapters then builds none."""
    from vlora import LLM
    from vlora.kernels import compiles
    from vlora.lora.random_adapter import write_random_adapter

    llm = LLM("random:tiny-llama", device="cuda", kv_cache_memory_gb=1, max_num_seqs=8, max_lora_rank=16,
              max_num_batched_tokens=512)
    assert llm.engine.kernel_build["launches"] > 0
    import tempfile
    from pathlib import Path

    from vlora.bench.harness import run_workload
    from vlora.bench.workloads import RequestSpec

    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate((8, 16)):
            llm.register_adapter(f"a{i}", write_random_adapter(Path(tmp) / f"a{i}", llm.engine.adapters.shape, r,
                                                               seed=i))
        llm.engine.runner.capture_graphs(mixed=True)        # decode graphs: the fixed kernels (norms, RoPE, ...)
        run_workload(llm.engine, [RequestSpec(0.0, None, 8, 2)])
        mark = compiles.snapshot()
        run_workload(llm.engine, [RequestSpec(0.01 * i, f"a{i % 2}", n, 4)
                                  for i, n in enumerate((3, 17, 40, 120, 1, 300, 64))])
    assert compiles.since(mark)["compiles"] == 0, compiles.since(mark)
    torch.cuda.synchronize()
