"""The tensor-parallel group's process group and its all-reduce.

Every row-parallel projection (``o``, ``down``) ends in one all-reduce of its partial output: two per layer,
each a small message at decode (batch x hidden elements: 10 KiB at batch 1, 640 KiB at batch 64 on a 5120-wide
bf16 model). Two implementations, chosen by ``ModelConfig.all_reduce``:

* ``nccl``: ``torch.distributed.all_reduce`` (gloo on the CPU). Always available; the fallback of the other.
* ``symm_mem``: torch's symmetric-memory one-shot all-reduce (``torch.ops.symm_mem.one_shot_all_reduce_out``):
  every rank copies its partial output into a buffer that all ranks map over NVLink, and one kernel per rank
  reads the peers' buffers and sums them. It needs no NVLink multicast (``multimem``), and is one kernel
  launch with no proxy thread, which is what a small message's latency is made of. Messages larger than its
  buffer go to NCCL.

Both are captured in the decode CUDA graphs. NCCL's communicator is created by an eager all-reduce when the
group starts (a collective's first call sets it up, which a graph capture cannot do).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

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

ALL_REDUCES = ("nccl", "symm_mem")
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


def _nccl(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


class SymmMemAllReduce:
    """One-shot all-reduce through a symmetric-memory buffer (see the module doc); NCCL past its size."""

    def __init__(self, dtype: torch.dtype, device: torch.device, nbytes: int = SYMM_MEM_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        if device.type != "cuda":
            raise ValueError("all_reduce symm_mem needs CUDA devices")
        if dtype not in (torch.float32, torch.bfloat16):       # the dtypes its kernels are built for
            raise ValueError(f"all_reduce symm_mem runs float32 and bfloat16 models, not {dtype}")
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            raise RuntimeError(f"this torch ({torch.__version__}) has no symm_mem.one_shot_all_reduce_out")
        group = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)   # needed before torch 2.8, a no-op after
        if enable is not None:
            enable(group)
        self.group = group
        self.buffer = symm_mem.empty(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)
        self.op = torch.ops.symm_mem.one_shot_all_reduce_out

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        small = n <= self.buffer.numel() and (n * t.element_size()) % 16 == 0     # its kernel's alignment
        if not small or t.dtype != self.buffer.dtype or not t.is_contiguous():
            return _nccl(t)
        staged = self.buffer[:n]
        staged.copy_(t.view(-1))
        self.op(staged, "sum", self.group, t.view(-1))
        return t


def make_reduce(kind: str, dtype: torch.dtype, device: torch.device):
    """The in-place sum over the ranks that follows every row-parallel projection."""
    if kind == "nccl" or device.type != "cuda":
        return _nccl
    if kind == "symm_mem":
        return SymmMemAllReduce(dtype, device)
    raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {kind!r}")


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
