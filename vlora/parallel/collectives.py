"""The tensor-parallel group's process group and its all-reduce.

Every row-parallel projection (``o``, ``down``) ends in one all-reduce of its partial output: two per layer,
each a small message at decode (batch x hidden elements: 10 KiB at batch 1, 640 KiB at batch 64 on a 5120-wide
bf16 model). Three choices, by ``ModelConfig.all_reduce``:

* ``nccl``: ``torch.distributed.all_reduce`` (gloo on the CPU). Always available; the fallback of the others.
* ``symm_mem``: torch's symmetric-memory one-shot all-reduce (``torch.ops.symm_mem.one_shot_all_reduce_out``):
  every rank copies its partial output into a buffer that all ranks map over NVLink, and one kernel per rank
  reads the peers' buffers and sums them. It needs no NVLink multicast (``multimem``), and is one kernel
  launch with no proxy thread, which is what a small message's latency is made of. Messages larger than its
  buffer go to NCCL.
* ``auto``: per message size, whichever of the two was faster when the group started
  (:func:`calibrate`: both replayed from CUDA graphs, as decode runs them, at the decode messages of 1, 2, 4, ...
  rows up to the one-shot's buffer). The ranks take the slower rank's time of each, so they choose alike.
  On the CPU, or where the one-shot cannot run (float16, a torch without it), it is NCCL (gloo).

Both are captured in the decode CUDA graphs. NCCL's communicator is created by an eager all-reduce when the
group starts (a collective's first call sets it up, which a graph capture cannot do).
"""

from __future__ import annotations

import bisect
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# What every rank's process sets before its communicator starts (values already set win):
COMMUNICATION_ENV = {
    "NCCL_NVLS_ENABLE": "0",                     # NVLink multicast stays off (the GPU hosts here run without it)
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",     # likewise for torch's symmetric memory
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",      # a failed or timed-out NCCL collective ends its process instead
}                                                # of leaving it hung


def apply_communication_env() -> None:
    """Set :data:`COMMUNICATION_ENV` in this process (rank 0 before it starts its workers, which inherit it, and
    each rank before it joins the group)."""
    for key, value in COMMUNICATION_ENV.items():
        os.environ.setdefault(key, value)

ALL_REDUCES = ("auto", "nccl", "symm_mem")
SYMM_MEM_BYTES = 2 << 20          # the one-shot buffer: decode messages up to 2 MiB (batch 128 at hidden 8192, bf16)


def tcp_store(port: int, world: int, master: bool, timeout_s: float):
    return dist.TCPStore("127.0.0.1", port, world, is_master=master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_group(rank: int, world: int, store, device: torch.device, timeout_s: float) -> None:
    """Join the process group (NCCL on GPUs, gloo on the CPU) and create its communicator now."""
    apply_communication_env()
    cuda = device.type == "cuda"
    kw = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kw)
    dist.all_reduce(torch.zeros(1, device=device))
    if cuda:
        torch.cuda.synchronize(device)


def nccl_all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def all_gather_columns(t: torch.Tensor, world: int) -> torch.Tensor:
    """[n, v] on every rank -> [n, world * v] on every rank, rank r's columns at ``[r * v, (r + 1) * v)``
    (the vocab-parallel logits; captured in the decode graphs on CUDA)."""
    t = t.contiguous()
    if t.device.type == "cuda":
        out = torch.empty((world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t)
    else:                                         # gloo has no all_gather_into_tensor
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        out = torch.stack(parts)
    return out.permute(1, 0, 2).reshape(t.shape[0], world * t.shape[1])


class SymmMemAllReduce:
    """One-shot all-reduce through a symmetric-memory buffer (see the module doc); NCCL past its size."""

    @staticmethod
    def unsupported(dtype: torch.dtype, device: torch.device) -> str | None:
        """Why it cannot run here (the same answer on every rank: the device type, dtype and torch decide), or
        None."""
        if device.type != "cuda":
            return "all_reduce symm_mem needs CUDA devices"
        if dtype not in (torch.float32, torch.bfloat16):       # the dtypes its kernels are built for
            return f"all_reduce symm_mem runs float32 and bfloat16 models, not {dtype}"
        import torch.distributed._symmetric_memory  # noqa: F401    (registers the ops)

        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            return f"this torch ({torch.__version__}) has no symm_mem.one_shot_all_reduce_out"
        return None

    def __init__(self, dtype: torch.dtype, device: torch.device, nbytes: int = SYMM_MEM_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        reason = self.unsupported(dtype, device)
        if reason is not None:
            raise ValueError(reason)
        group = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)   # needed before torch 2.8, a no-op after
        if enable is not None:
            enable(group)
        self.group = group
        self.buffer = symm_mem.empty(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)
        self.op = torch.ops.symm_mem.one_shot_all_reduce_out

    @property
    def capacity(self) -> int:
        """The largest message it sends itself, in elements."""
        return self.buffer.numel()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        small = n <= self.buffer.numel() and (n * t.element_size()) % 16 == 0     # its kernel's alignment
        if not small or t.dtype != self.buffer.dtype or not t.is_contiguous():
            return nccl_all_reduce(t)
        staged = self.buffer[:n]
        staged.copy_(t.view(-1))
        self.op(staged, "sum", self.group, t.view(-1))
        return t


class SizedAllReduce:
    """``auto``: each message goes to the one-shot or to NCCL by its size, as :func:`calibrate` measured. Until
    then (and past the largest size measured) every message goes to NCCL."""

    def __init__(self, one_shot, nccl=nccl_all_reduce):
        self.one_shot, self.nccl = one_shot, nccl     # one_shot: a callable with ``capacity`` (elements)
        self.sizes: list[int] = []                    # the sizes measured (elements), ascending
        self.use_one_shot: list[bool] = []            # per size: the one-shot was faster
        self.timings: list[dict] = []                 # per size: both times (ms per call, the slower rank's)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        i = bisect.bisect_left(self.sizes, t.numel())     # the smallest size measured that holds the message
        if i < len(self.sizes) and self.use_one_shot[i]:
            return self.one_shot(t)
        return self.nccl(t)

    def parts(self) -> dict:
        """The kinds it chooses between, by name (benchmark probes reuse them instead of a second rendezvous)."""
        return {"nccl": self.nccl, "symm_mem": self.one_shot}

    def describe(self) -> str:
        if not self.sizes:
            return "auto: NCCL (not calibrated)"
        chosen = [f"{d['elements']}:{'one-shot' if d['one_shot'] else 'nccl'}" for d in self.timings]
        return "auto (elements: choice) " + ", ".join(chosen) + ", larger: nccl"


def calibrate(reduce: SizedAllReduce, row: int, dtype: torch.dtype, device: torch.device, reps: int = 100,
              timer=None) -> list[dict]:
    """Time NCCL and the one-shot at the decode messages of 1, 2, 4, ... rows of ``row`` elements (up to the
    one-shot's capacity), replayed from CUDA graphs, and set ``reduce``'s choice per size. Every rank calls it
    at the same point with the same arguments; the times are the slower rank's (a MAX all-reduce), so every
    rank makes the same choices and their collectives pair up. ``timer(fn, numel)`` (tests) replaces the
    measurement."""
    if timer is None:
        def timer(fn, numel):
            return min(time_all_reduce(fn, numel, dtype, device, reps, graphed=True) for _ in range(2))
    sizes, rows = [], 1
    while rows * row <= reduce.one_shot.capacity:
        sizes.append(rows * row)
        rows *= 2
    most = reduce.one_shot.capacity // row * row      # the most rows the buffer holds: measured too, so that
    if most and (not sizes or most > sizes[-1]):       # messages past the last power of two are not NCCL's alone
        sizes.append(most)
    times = torch.tensor([[timer(reduce.nccl, n), timer(reduce.one_shot, n)] for n in sizes],
                         dtype=torch.float64, device=device).reshape(len(sizes), 2)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu().tolist()
    reduce.sizes = sizes
    reduce.use_one_shot = [one < nccl for nccl, one in times]
    reduce.timings = [{"elements": n, "nccl_ms": nccl, "one_shot_ms": one, "one_shot": one < nccl}
                      for n, (nccl, one) in zip(sizes, times)]
    return reduce.timings


def make_reduce(kind: str, dtype: torch.dtype, device: torch.device):
    """The in-place sum over the ranks that follows every row-parallel projection (``auto``: a
    :class:`SizedAllReduce` still to be calibrated)."""
    if kind not in ALL_REDUCES:
        raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {kind!r}")
    if kind == "nccl" or device.type != "cuda":
        return nccl_all_reduce
    if kind == "symm_mem":
        return SymmMemAllReduce(dtype, device)
    # only what every rank answers alike sends auto to NCCL: a failure past these checks (the buffer's
    # allocation, its rendezvous) on one rank alone must not leave the ranks choosing differently, so it raises
    reason = SymmMemAllReduce.unsupported(dtype, device)
    if reason is not None:
        log.info("all_reduce auto: NCCL for every message (%s)", reason)
        return nccl_all_reduce
    return SizedAllReduce(SymmMemAllReduce(dtype, device))


def reduce_parts(kind: str, reduce) -> dict:
    """A rank's all-reduces by name: the model's own, and the parts of an ``auto`` one."""
    return {kind: reduce, **(reduce.parts() if isinstance(reduce, SizedAllReduce) else {})}


def time_all_reduce(reduce, numel: int, dtype: torch.dtype, device: torch.device, reps: int,
                    graphed: bool) -> float:
    """Milliseconds per call of ``reduce`` on ``numel`` elements, ``reps`` calls in a row, eagerly or replayed
    from one CUDA graph (as the decode graphs run them). Every rank runs it at the same time (benchmarks)."""
    import time

    x = torch.zeros(numel, dtype=dtype, device=device)
    if device.type != "cuda":
        for _ in range(3):
            reduce(x)
        t0 = time.perf_counter()
        for _ in range(reps):
            reduce(x)
        return (time.perf_counter() - t0) * 1e3 / reps

    def calls():
        for _ in range(reps):
            reduce(x)
    run = calls
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        calls()                                  # warm-up (and, for a graph, outside the capture)
    torch.cuda.current_stream(device).wait_stream(side)
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            calls()
        run = graph.replay
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
