"""Adapters read, validated and packed in a process of their own while the engine serves.

Reading an adapter is host work: parse the safetensors file, check every matrix, convert it to the served
dtype, pack the matrices per group and lay out the copy the unified pool loads from. On a thread of the
serving process that work shares the interpreter lock, the allocator and the address space with the engine's
thread, whose steps it slows: by 20-86 ms over a rank-64 Llama-2-7B load on an H100 host, and on a CPU with
no spare core the forward loses one to it. So :class:`LoaderProcess` hands the reading to worker processes
(one per four cores, at most four; spawned once, shared by the engines of this process, scheduled only on idle
cores with one torch thread each: a core the forward wants goes to the forward). The worker writes each matrix,
converted, straight into the pool's layout in one shared-memory buffer, the packed matrices being views of it;
the buffer crosses to this process as a file descriptor, not as a copy. What is left here is the part that
needs this process: pinning the pool's copy (registered in place), moving a task head to the device, and the
registration on the engine's thread (:meth:`vlora.lora.registry.AdapterRegistry.finish`, ``add``).

    read(spec, name, path)            worker: read_stored -> packed_in_layout, into shared memory
        -> Shipped (1 buffer + the views' offsets)   crosses as a file descriptor
        -> landed(shipped) -> ReadAdapter (views of the buffer)      this process
        -> registry.finish -> PreparedAdapter -> registry.add (engine thread)

A worker that dies while reading (a file that crashes the parser, memory exhausted) refuses that adapter (and
any queued behind it on that worker) with :class:`~vlora.lora.adapter.AdapterError`; the next load there starts
a new worker.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace

import numpy as np
import torch

from vlora.lora.adapter import AdapterError, LoRAAdapter, ModelShape, StoredAdapter, all_finite, load_adapter, \
    read_stored, refuse_nonfinite
from vlora.lora.batch import GROUPS, GroupWeights, PackedAdapter, SliceB
from vlora.lora.device_store import HostAdapter, aligned
from vlora.lora.task_head import TaskHead, load_task_head


@dataclass(frozen=True)
class ReadSpec:
    """What reading an adapter needs to know of the served model (plain values: it crosses to the worker)."""

    shape: ModelShape
    max_rank: int
    dtype: torch.dtype
    check_base_model: bool
    host_layout: bool       # lay the matrices out for the unified pool (kernel path, whole adapters)


@dataclass(frozen=True)
class ReadAdapter:
    """An adapter read, validated and packed on the host; the registry finishes it (pinning, device moves)."""

    packed: PackedAdapter           # CPU matrices; its slot is given when it is added
    path: str
    head: TaskHead | None           # CPU
    host: HostAdapter | None        # the pool's layout, not pinned (``spec.host_layout``)


def pack(adapter: LoRAAdapter, slot: int, out_features: dict[str, int], device: torch.device) -> PackedAdapter:
    """Lay an adapter out per layer and packed group (qkv, o, gate_up, down)."""
    layers = []
    for per_module in adapter.weights:
        groups: dict[str, GroupWeights] = {}
        for group, modules in GROUPS.items():
            a_parts, slices, col = [], [], 0
            for j, module in enumerate(modules):
                if module in per_module:
                    a, b = per_module[module]
                    slices.append(SliceB(j, col, len(a_parts) * adapter.rank, b.to(device).contiguous()))
                    a_parts.append(a)
                col += out_features.get(module, 0)      # a module the model takes no LoRA on (MoE MLP)
            if a_parts:
                groups[group] = GroupWeights(torch.cat(a_parts, dim=1).to(device).contiguous(), tuple(slices))
        layers.append(groups)
    return PackedAdapter(slot, adapter.name, adapter.rank, adapter.scaling, tuple(layers))


def packed_in_layout(stored: StoredAdapter, out_features: dict[str, int], dtype: torch.dtype,
                     alloc=torch.zeros) -> tuple[PackedAdapter, HostAdapter]:
    """The adapter laid out for the pool (:func:`~vlora.lora.device_store.host_layout`'s layout, in one buffer
    from ``alloc``) and packed (:func:`pack`'s structure) as views of that buffer: each stored matrix is converted
    and written once, into its place (A^T as stored, B transposed), and the whole buffer is checked finite in one
    pass. Equal to ``host_layout(pack(load_adapter(...)))`` at a third of its passes over the adapter's bytes and
    half its host memory (docs/decisions.md, 'Adapters are read in a process of their own': its revision 'read into
    the pool's layout')."""
    rank = stored.rank
    plan = []                       # per layer: (group, [(index, module, col)]) of the groups it touches
    sizes = []
    for per_module in stored.stored:
        groups = []
        for group, modules in GROUPS.items():
            parts, col = [], 0
            for j, module in enumerate(modules):
                if module in per_module:
                    parts.append((j, module, col))
                col += out_features.get(module, 0)      # a module the model takes no LoRA on (MoE MLP)
            if parts:
                groups.append((group, parts))
                sizes.append(len(parts) * rank * per_module[parts[0][1]][0][1].shape[1])
                sizes.extend(rank * per_module[m][1][1].shape[0] for _, m, _ in parts)
        plan.append(groups)
    flat = alloc(sum(aligned(n) for n in sizes), dtype=dtype)
    pos = 0

    def place(n: int, shape: tuple[int, int]) -> torch.Tensor:
        nonlocal pos
        view = flat[pos:pos + n].view(shape)
        pos += aligned(n)
        return view

    layers = []
    for per_module, groups in zip(stored.stored, plan):
        packed_groups = {}
        for group, parts in groups:
            width = per_module[parts[0][1]][0][1].shape[1]
            a_t = place(len(parts) * rank * width, (len(parts) * rank, width))     # A^T: [R, in]
            slices = []
            for k, (j, module, col) in enumerate(parts):
                (_, a), (_, b) = per_module[module]
                a_t[k * rank:(k + 1) * rank].copy_(a)
                dst = place(rank * b.shape[0], (rank, b.shape[0]))
                copy_transposed(dst, b)
                slices.append(SliceB(j, col, k * rank, dst))
            packed_groups[group] = GroupWeights(a_t.t(), tuple(slices))
        layers.append(packed_groups)
    if flat.numel() and not all_finite(flat):
        for per_module in stored.stored:                # which tensor, and why: only on failure
            for pair in per_module.values():
                for key, t in pair:
                    if not all_finite(t.to(dtype)):
                        refuse_nonfinite(key, t, dtype)
        raise AdapterError(f"adapter {stored.name!r}: its laid-out weights are not finite")   # padding not zeroed
    packed = PackedAdapter(-1, stored.name, rank, stored.scaling, tuple(layers))
    return packed, HostAdapter(flat, sizes)


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_transposed(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` ([n, m], contiguous) = ``src.t()`` in ``dst``'s dtype. numpy's strided copy takes a tall thin
    matrix (a LoRA B, [out, r]) across faster than torch's on one core, so the bits go through numpy after any
    conversion (``benchmarks/bench_adapter_read.py`` times the whole read)."""
    src = src.to(dst.dtype)
    as_int = _SAME_SIZE_INT.get(dst.element_size())
    if as_int is None or not dst.is_contiguous():
        dst.copy_(src.t())
        return
    np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy().T)


def read(spec: ReadSpec, name: str, path: str, alloc=torch.zeros) -> ReadAdapter:
    """Read, validate and pack the PEFT adapter in ``path`` (raises AdapterError if it is refused); the pool's
    layout comes in a buffer from ``alloc(numel, dtype=)``, zero-filled, the packed matrices then being views of
    it."""
    if spec.host_layout:
        stored = read_stored(path, name, spec.shape, max_rank=spec.max_rank, check_base_model=spec.check_base_model)
        packed, host = packed_in_layout(stored, spec.shape.out_features, spec.dtype, alloc)
    else:
        loaded = load_adapter(path, name, spec.shape, max_rank=spec.max_rank, dtype=spec.dtype,
                              check_base_model=spec.check_base_model)
        packed, host = pack(loaded, -1, spec.shape.out_features, torch.device("cpu")), None
    head = load_task_head(path, spec.shape.in_features["q_proj"], spec.dtype, torch.device("cpu"))
    return ReadAdapter(packed, str(path), head, host)


# -- crossing between processes -----------------------------------------------------------------

@dataclass(frozen=True)
class Shipped:
    """A :class:`ReadAdapter` as it crosses: one shared buffer (``flat``), the adapter's structure with empty
    tensors in place of its packed matrices, and where each of them lies in ``flat`` (``views``: offset, shape,
    strides, in :func:`_matrices`' order). With the pool's layout (``host_sizes`` given) ``flat`` is that layout
    and the matrices are views of it, as :func:`packed_in_layout` made them; without, ``flat`` holds the matrices
    back to back."""

    skeleton: ReadAdapter
    flat: torch.Tensor
    views: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    host_sizes: list[int] | None = None


def _matrices(packed: PackedAdapter) -> list[torch.Tensor]:
    """The packed adapter's tensors in a fixed order: per layer and group, A then each slice's B."""
    out = []
    for groups in packed.layers:
        for gw in groups.values():
            out.append(gw.a)
            out.extend(sl.b for sl in gw.slices)
    return out


def _with_matrices(packed: PackedAdapter, mats) -> PackedAdapter:
    """``packed`` with its tensors replaced, in :func:`_matrices`' order, by those ``mats`` yields."""
    it = iter(mats)

    def group(gw: GroupWeights) -> GroupWeights:
        a = next(it)
        return GroupWeights(a, tuple(replace(sl, b=next(it)) for sl in gw.slices))
    return replace(packed, layers=tuple({g: group(gw) for g, gw in groups.items()} for groups in packed.layers))


def shared_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor in shared memory (a fresh shared mapping is zero): one that crosses to another
    process as a file descriptor."""
    storage = torch.UntypedStorage._new_shared(max(numel, 1) * dtype.itemsize)
    return torch.tensor([], dtype=torch.uint8).set_(storage).view(dtype)[:numel]


def ship(r: ReadAdapter) -> Shipped:
    """``r`` made ready to cross as one descriptor: with a pool layout (in shared memory, its packed matrices views
    of it: :func:`packed_in_layout`) the matrices cross as offsets into it; without, they are copied into one
    shared buffer back to back."""
    mats = _matrices(r.packed)
    dtype = mats[0].dtype if mats else torch.float32
    skeleton = replace(r, packed=_with_matrices(r.packed, [torch.empty(0, dtype=dtype)] * len(mats)), host=None)
    if r.host is not None:
        layout = r.host.flat.untyped_storage().data_ptr()
        if any(m.untyped_storage().data_ptr() != layout for m in mats):
            raise ValueError("the packed matrices of an adapter with a pool layout must be views of it")
        base = r.host.flat.storage_offset()
        views = [(m.storage_offset() - base, tuple(m.shape), m.stride()) for m in mats]
        return Shipped(skeleton, r.host.flat, views, list(r.host.sizes))
    flat = shared_zeros(sum(m.numel() for m in mats), dtype)
    views, pos = [], 0
    for m in mats:
        dst = flat[pos:pos + m.numel()].view(m.shape)
        dst.copy_(m)
        views.append((pos, tuple(m.shape), dst.stride()))
        pos += m.numel()
    return Shipped(skeleton, flat, views)


def landed(s: Shipped) -> ReadAdapter:
    """The :class:`ReadAdapter` that crossed as ``s``: its matrices are views of the shared buffer."""
    base = s.flat.storage_offset()
    views = [s.flat.as_strided(shape, stride, base + off) for off, shape, stride in s.views]
    r = replace(s.skeleton, packed=_with_matrices(s.skeleton.packed, views))
    return r if s.host_sizes is None else replace(r, host=HostAdapter(s.flat, s.host_sizes))


# -- the worker -----------------------------------------------------------------------------------

PARENT_CHECK_S = 1.0
"""How often the worker looks whether its parent is still there."""


def _worker_start() -> None:
    """The worker runs when a core is idle (SCHED_IDLE): beside an engine whose forward keeps every core busy (a
    CPU server) a worker at any normal priority takes a share of one core, and the forward's threads wait for the
    one that lost it; between steps, and on a GPU host with cores to spare, it runs at full speed. It ends when
    its parent does, however the parent ends (:func:`_end_with`)."""
    # the pid that started this process, not os.getppid(): for a parent gone before this runs, that is already
    # the pid of whichever process adopted this one
    parent = multiprocessing.parent_process()
    threading.Thread(target=_end_with, args=(os.getppid() if parent is None else parent.pid,),
                     name="vlora-loader-parent", daemon=True).start()
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):   # not on Linux: the lowest normal priority
        try:
            os.nice(19)
        except OSError:
            pass
    torch.set_num_threads(1)


def _end_with(parent: int, every: float = PARENT_CHECK_S) -> None:
    """Exit once ``parent`` is gone (this process is handed to another parent then). A parent killed, or one
    whose exit skips the pool's shutdown, would otherwise leave the worker waiting on its queue for good."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(0)


def _read_shipped(spec: ReadSpec, name: str, path: str) -> Shipped:
    """The worker's task: :func:`read` into shared memory."""
    return ship(read(spec, name, path, alloc=shared_zeros))


def default_workers(cpus: int | None = None) -> int:
    """Reading processes for a host of ``cpus`` cores: one per four cores, at most four, at least one. Reads of
    adapters that arrive together then overlap (a rank-64 Llama-2-7B adapter takes its worker 1.4-1.8 s on an
    H200 host), while most cores stay the forward's and the server's."""
    if cpus is None:                    # the cores this process may run on (a container's share, an affinity)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus // 4))


class LoaderProcess:
    """Worker processes that read adapters (:func:`read`) for every engine of this process, each one adapter at
    a time: a read goes to the worker with the fewest reads queued. Each worker is a pool of its own, so one
    that dies fails only the reads it held; the next read on its place starts another. Started on first use (or
    :meth:`start`)."""

    def __init__(self, workers: int | None = None):
        """``workers``: how many reading processes (default: :func:`default_workers` of this host)."""
        self.workers = default_workers() if workers is None else workers
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self._lock = threading.Lock()
        self._pools: list[ProcessPoolExecutor | None] = [None] * self.workers
        self._queued = [0] * self.workers           # reads submitted to each worker and not done

    def start(self) -> None:
        """Start the workers now (each takes a few seconds to import torch), so the first loads do not wait."""
        for i in range(self.workers):
            self._executor(i).submit(os.getpid)

    def _executor(self, i: int = 0) -> ProcessPoolExecutor:
        with self._lock:
            if self._pools[i] is None:
                # spawn: a fork of a serving process would copy its CUDA state and its threads' locks
                self._pools[i] = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                     initializer=_worker_start)
            return self._pools[i]

    def _broken(self, i: int, pool: ProcessPoolExecutor) -> None:
        """Forget ``pool`` (its worker died): the next read on its place starts another."""
        with self._lock:
            if self._pools[i] is pool:
                self._pools[i] = None
        pool.shutdown(wait=False)

    async def read(self, spec: ReadSpec, name: str, path: str) -> ReadAdapter:
        """Read the adapter in ``path`` in a worker; raises AdapterError if it is refused or the worker died
        reading it."""
        # submitted off the event loop: a submission may start a worker (a process spawned)
        i, pool, future = await asyncio.to_thread(self._submit, spec, name, str(path))
        try:
            return landed(await asyncio.wrap_future(future))
        except BrokenProcessPool:
            self._broken(i, pool)
            raise AdapterError(f"adapter {name!r}: the process reading {path} died (a file that crashes the "
                               f"reader, or memory exhausted)") from None

    def _submit(self, spec: ReadSpec, name: str, path: str) -> tuple[int, ProcessPoolExecutor, Future]:
        """(the worker's place, its pool, the future of the :class:`Shipped` adapter), on the worker with the
        fewest reads queued; a pool whose worker died since its last read is replaced first."""
        with self._lock:
            i = min(range(self.workers), key=self._queued.__getitem__)
            self._queued[i] += 1
        try:
            pool = self._executor(i)
            try:
                future = pool.submit(_read_shipped, spec, name, path)
            except BrokenProcessPool:
                self._broken(i, pool)
                pool = self._executor(i)
                future = pool.submit(_read_shipped, spec, name, path)
        except BaseException:
            self._done(i)
            raise
        future.add_done_callback(lambda _: self._done(i))
        return i, pool, future

    def _done(self, i: int) -> None:
        with self._lock:
            self._queued[i] -= 1

    def shutdown(self) -> None:
        with self._lock:
            pools, self._pools = self._pools, [None] * self.workers
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


LOADER = LoaderProcess()
"""The workers every engine of this process reads adapters with."""
