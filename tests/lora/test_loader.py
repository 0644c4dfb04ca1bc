"""Adapters read in a process of their own (vlora/lora/loader.py): the same adapter as one read here, refusals
with their messages, and a worker that dies refusing only the adapter it was reading."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.lora.test_adapter import SHAPE, make_tensors, write_adapter
from vlora.lora.adapter import AdapterError
from vlora.lora.adapter import load_adapter, read_stored
from vlora.lora.device_store import host_layout
from vlora.lora.loader import LoaderProcess, ReadAdapter, landed, pack, packed_in_layout, ship, shared_zeros
from vlora.lora.registry import AdapterRegistry
from vlora.memory.pool import UnifiedPool

@pytest.fixture(scope="module")
def loader():
    lp = LoaderProcess()
    yield lp
    lp.shutdown()


def registry(kernel: bool) -> AdapterRegistry:
    if not kernel:
        return AdapterRegistry(SHAPE, 16, torch.bfloat16, torch.device("cpu"), check_base_model=False)
    pool = UnifiedPool(256, 2, 2, 4, 16, torch.bfloat16, torch.device("cpu"))
    return AdapterRegistry(SHAPE, 16, torch.bfloat16, torch.device("cpu"), check_base_model=False, kernel="triton",
                           pool=pool)


def adapter_dir(tmp_path, r: int = 4, **config) -> str:
    tensors = make_tensors(r=r, modules=("q_proj", "v_proj", "down_proj"), layers=(0, 1), dtype=torch.float32)
    return write_adapter(tmp_path, tensors, r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "down_proj"],
                         **config)


def same_adapter(a, b) -> None:
    assert (a.packed.name, a.packed.rank, a.packed.scaling) == (b.packed.name, b.packed.rank, b.packed.scaling)
    assert len(a.packed.layers) == len(b.packed.layers)
    for ga, gb in zip(a.packed.layers, b.packed.layers):
        assert ga.keys() == gb.keys()
        for g in ga:
            assert torch.equal(ga[g].a, gb[g].a)
            assert [(s.index, s.col_start, s.rank_start) for s in ga[g].slices] == \
                   [(s.index, s.col_start, s.rank_start) for s in gb[g].slices]
            assert all(torch.equal(x.b, y.b) for x, y in zip(ga[g].slices, gb[g].slices))
    assert (a.host is None) == (b.host is None)
    if a.host is not None:
        assert a.host.sizes == b.host.sizes and torch.equal(a.host.flat, b.host.flat)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-path", "pool-layout"])
def test_an_adapter_read_in_the_worker_is_the_one_read_here(loader, tmp_path, kernel):
    reg = registry(kernel)
    path = adapter_dir(tmp_path)
    here = reg.prepare("a", path)
    there = reg.finish(asyncio.run(loader.read(reg.spec, "a", path)))
    same_adapter(here, there)
    assert there.packed.layers[0]["qkv"].a.is_shared()              # crossed as shared memory, not as a copy
    assert (there.host is not None) == kernel
    reg.add(there)
    assert reg.names() == ["a"]


def test_ship_and_land_keep_every_matrix_and_its_place(tmp_path):
    reg = registry(kernel=True)
    read = reg.prepare("a", adapter_dir(tmp_path))
    r = ReadAdapter(read.packed, read.path, read.head, read.host)
    back = landed(ship(r))
    same_adapter(r, back)
    views = [gw.a for groups in back.packed.layers for gw in groups.values()]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1     # one buffer for all of them


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_adapter_read_into_its_pool_layout_equals_one_packed_then_laid_out(tmp_path, dtype):
    """Written straight into the pool's layout (the loader's path) the adapter is, bit for bit, the one converted,
    packed and then laid out; its packed matrices are views of that layout (one copy in host memory). Modules
    missing from a group (k), a layer left untouched, and fp32 weights served in another dtype included."""
    tensors = make_tensors(r=4, modules=("q_proj", "v_proj", "gate_proj", "down_proj"), layers=(1,))
    path = write_adapter(tmp_path, tensors, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    ref = pack(load_adapter(path, "a", SHAPE, max_rank=16, dtype=dtype, check_base_model=False), -1,
               SHAPE.out_features, torch.device("cpu"))
    packed, host = packed_in_layout(read_stored(path, "a", SHAPE, max_rank=16, check_base_model=False),
                                    SHAPE.out_features, dtype)
    same_adapter(ReadAdapter(ref, path, None, host_layout(ref)), ReadAdapter(packed, path, None, host))
    assert packed.layers[0] == {} and set(packed.layers[1]) == {"qkv", "gate_up", "down"}
    views = [t for g in packed.layers[1].values() for t in (g.a, *(s.b for s in g.slices))]
    assert {t.untyped_storage().data_ptr() for t in views} == {host.flat.untyped_storage().data_ptr()}


@pytest.mark.parametrize("value, served, message", [
    (float("nan"), torch.bfloat16, "contains NaN or Inf"),
    (1e6, torch.float16, "overflows when converted to torch.float16"),
])
def test_a_value_not_finite_in_the_pool_layout_is_refused_by_name(tmp_path, value, served, message):
    tensors = make_tensors(r=4, modules=("q_proj", "v_proj"), layers=(0, 1))
    key = next(k for k in tensors if "layers.1" in k and "v_proj.lora_B" in k)
    tensors[key][3, 2] = value
    path = write_adapter(tmp_path, tensors, target_modules=["q_proj", "v_proj"])
    stored = read_stored(path, "a", SHAPE, max_rank=16, check_base_model=False)
    with pytest.raises(AdapterError, match=re.escape(f"{key!r} {message}")):
        packed_in_layout(stored, SHAPE.out_features, served)


def test_shared_zeros_are_zero_and_shared():
    t = shared_zeros(1000, torch.bfloat16)
    assert t.is_shared() and t.shape == (1000,) and t.dtype == torch.bfloat16 and not t.any()


def test_a_refusal_in_the_worker_carries_its_message(loader, tmp_path):
    reg = registry(kernel=True)
    with pytest.raises(AdapterError, match="exceeds max_rank=16"):
        asyncio.run(loader.read(reg.spec, "big", adapter_dir(tmp_path, r=32)))
    with pytest.raises(AdapterError, match="is not a directory"):
        asyncio.run(loader.read(reg.spec, "none", str(tmp_path / "missing")))
    path = adapter_dir(tmp_path / "ok")                               # the worker serves on
    assert asyncio.run(loader.read(reg.spec, "ok", path)).packed.name == "ok"


def test_a_worker_that_dies_refuses_only_its_adapter(tmp_path):
    """The worker killed while a read waits for it: that read is refused as an AdapterError, and the next read
    starts a new worker."""
    lp = LoaderProcess(workers=1)
    reg = registry(kernel=True)
    path = adapter_dir(tmp_path)

    async def scenario():
        pool = lp._executor()
        pid = await asyncio.wrap_future(pool.submit(os.getpid))
        pool.submit(time.sleep, 30)                                     # the worker is busy when it dies
        reading = asyncio.ensure_future(lp.read(reg.spec, "a", path))
        await asyncio.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(AdapterError, match="died"):
            await reading
        return await lp.read(reg.spec, "a", path)
    try:
        assert asyncio.run(scenario()).packed.name == "a"
    finally:
        lp.shutdown()


def test_reads_go_to_the_least_busy_worker_and_a_death_fails_only_its_own(tmp_path):
    """Two workers: with the first one busy, a read waits on it and the next one goes to the second, which reads
    it; the first killed, only the read it held is refused, and the next read there starts a new worker."""
    lp = LoaderProcess(workers=2)
    reg = registry(kernel=True)
    path = adapter_dir(tmp_path)

    async def scenario():
        first = lp._executor(0)
        pid = await asyncio.wrap_future(first.submit(os.getpid))
        first.submit(time.sleep, 30)                                    # worker 0 busy, unknown to the counts
        held = asyncio.ensure_future(lp.read(reg.spec, "a", path))      # worker 0: the fewest queued (both 0)
        while lp._queued[0] == 0:                                       # submitted (from a thread)
            await asyncio.sleep(0.01)
        other = await lp.read(reg.spec, "b", path)                      # worker 1: worker 0 has one queued
        assert other.packed.name == "b" and not held.done()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(AdapterError, match="died"):
            await held
        return await lp.read(reg.spec, "c", path)
    try:
        assert asyncio.run(scenario()).packed.name == "c"
        assert lp._queued == [0, 0]
    finally:
        lp.shutdown()


def test_worker_counts():
    from vlora.lora.loader import default_workers

    assert [default_workers(c) for c in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    with pytest.raises(ValueError, match="workers must be >= 1"):
        LoaderProcess(workers=0)


@pytest.mark.gpu
def test_a_worker_read_adapter_is_pinned_in_place_and_loads_into_the_pool(loader, tmp_path):
    """On CUDA the pool's copy that crossed from the worker is page-locked where it is (no copy here), and the
    store loads it into the pool as it loads one prepared here."""
    pool = UnifiedPool(256, 2, 2, 4, 16, torch.bfloat16, torch.device("cuda"))
    reg = AdapterRegistry(SHAPE, 16, torch.bfloat16, torch.device("cuda"), check_base_model=False, kernel="triton",
                          pool=pool)
    path = adapter_dir(tmp_path)
    here = reg.prepare("here", path)
    read = asyncio.run(loader.read(reg.spec, "there", path))
    there = reg.finish(read)
    assert there.host.flat.is_pinned() and there.host.flat.data_ptr() == read.host.flat.data_ptr()
    assert torch.equal(there.host.flat, here.host.flat)
    for prepared in (here, there):
        packed = reg.add(prepared)
        assert reg.store.load(packed)
        torch.cuda.synchronize()
        start = packed.placement.host["qkv"][0][0]               # a_off of layer 0's qkv group
        flat = prepared.host.flat
        assert torch.equal(pool.buf[start:start + flat.numel()].cpu(), flat)


def test_the_worker_ends_when_its_parent_does(tmp_path):
    """A serving process that ends without shutting the loader down (killed, or os._exit) leaves no worker."""
    script = ("import os\nfrom pathlib import Path\nfrom vlora.lora.loader import LoaderProcess\n"
              "pid = LoaderProcess()._executor().submit(os.getpid).result(120)\n"
              "print(pid, Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19], flush=True)\n"
              "os._exit(0)\n")
    with open(tmp_path / "out", "w") as out:        # a file: the worker would hold a pipe open
        subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.DEVNULL, timeout=180,
                       cwd=Path(__file__).resolve().parents[2], check=True)
    pid, started = (tmp_path / "out").read_text().split()[-2:]
    deadline = time.monotonic() + 60
    while alive(int(pid), started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(int(pid), started)


def alive(pid: int, started: str) -> bool:
    """Whether process ``pid``, started at ``started`` (clock ticks after boot: a pid may be reused), runs (a
    zombie waiting for its new parent to reap it does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[19] == started and fields[0] not in ("Z", "X")
