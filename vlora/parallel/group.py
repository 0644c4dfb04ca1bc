"""Tensor parallelism: one worker process per extra rank, driven by the engine's process (rank 0).

The engine (scheduler, memory, sampling) runs only in rank 0. Each iteration
its runner builds the ``ForwardBatch``; :class:`~vlora.parallel.model.TensorParallelModel`
(the engine's model) sends it to every worker as one pickled
:class:`~vlora.parallel.messages.StepMessage` over a pipe per worker, then runs
rank 0's shard. Workers run theirs on the same batch; the row-parallel
projections' all-reduces keep the ranks in step. The LM head is vocab-parallel:
every rank computes its slice of the logits of the rows that sample, rank 0
gathers them and alone samples. No worker re-derives anything.
Every rank's pool has the same pages (the KV of its own heads, and its slices
of the resident adapters), so page ids and pool offsets mean the same on all of them.

Collectives run on ``torch.distributed``: NCCL on GPUs, gloo on the CPU. A
worker that dies closes its pipe and its sockets: rank 0 checks the workers
before every step and turns any failure in the group into
:class:`~vlora.engine.faults.EngineFatal` naming the rank and its reason; the
collectives' timeout bounds the wait for a worker that hangs. A worker whose
driver goes away sees its pipe close and exits.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlora.engine.faults import EngineFatal, describe
from vlora.parallel.collectives import apply_communication_env, init_group, tcp_store
from vlora.parallel.messages import GapTrace, Logits, Probe, StepMessage
from vlora.parallel.worker import run_worker


@dataclass(frozen=True)
class WorkerSpec:
    """How a worker builds its copy of the model (the engine's model config, resolved)."""

    model: str | None           # a model directory, a random:<preset> spec, None: the embedded default
    dtype: torch.dtype
    device_type: str            # "cpu" or "cuda" (a worker of rank r takes cuda:r)
    max_model_len: int | None
    seed: int
    timeout_s: float            # collectives and start-up
    all_reduce: str = "nccl"    # see collectives.py
    host_adapters: bool = False  # the LoRA kernels read adapters from the pool: their slices stay on the host
    build_timeout_s: float = 1800.0   # a worker's load of its model
    tokenizer: str | None = None  # the model config's: a random decoder's vocabulary grows to it


class TensorParallelGroup:
    """Rank 0's handle on the workers: start them, send each step, stop them."""

    def __init__(self, world: int, spec: WorkerSpec):
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                               "engine per process")
        apply_communication_env()
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        store = tcp_store(0, world, True, spec.timeout_s)   # port 0: the store picks a free one
        port = store.port
        self.world, self.spec = world, spec
        self.conns, self.procs = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_worker, args=(rank, world, port, spec, child), daemon=True,
                               name=f"vlora-tp{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.store = store
        try:
            self._wait("joined", spec.timeout_s)
            device = torch.device("cuda", 0) if spec.device_type == "cuda" else torch.device("cpu")
            init_group(0, world, store, device, spec.timeout_s)
        except Exception as e:
            self.close()
            raise RuntimeError(f"tensor-parallel workers did not start: {describe(e)}{self.reasons()}") from e
        self.closed = False
        self.noticed = False             # rank 0 has raised the group's failure (EngineFatal)
        if spec.device_type == "cuda":
            threading.Thread(target=self._watch, name="vlora-tp-watch", daemon=True).start()

    def _wait(self, key: str, timeout_s: float) -> None:
        """Until every worker has set ``key{rank}`` in the store; a worker that dies meanwhile is seen at once."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([f"{key}{r}" for r in range(1, self.world)]):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not reach '{key}' within {timeout_s:g} s")
            time.sleep(0.05)

    def wait_built(self) -> None:
        """Until every worker has built its shard (loading a large checkpoint may take minutes: the first
        collective waits here, not on its timeout)."""
        try:
            self._wait("built", self.spec.build_timeout_s)
        except Exception as e:
            self.close()
            raise RuntimeError(f"tensor-parallel workers did not start: {describe(e)}{self.reasons()}") from e

    def _watch(self, grace_s: float = 10.0) -> None:
        """A collective replayed from a CUDA graph has no timeout (NCCL's watchdog does not track it): a worker
        that dies then leaves rank 0 blocked on the GPU for good. Once a worker has been gone ``grace_s``
        seconds without rank 0 raising it, the process exits non-zero with the reason."""
        since = None
        while not self.closed and not self.noticed:
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
            if dead and since is None:
                since = time.monotonic()
            if since is not None and time.monotonic() - since > grace_s and not self.closed and not self.noticed:
                sys.stderr.write(f"vlora: tensor-parallel worker {dead[0][0]} exited (code {dead[0][1]}) and rank 0 "
                                 f"is blocked on a collective; exiting\n")
                sys.stderr.flush()
                os._exit(70)
            time.sleep(0.5)

    def check(self) -> None:
        """Raise EngineFatal if a worker has exited."""
        for rank, proc in enumerate(self.procs, 1):
            if not proc.is_alive():
                self.noticed = True
                raise EngineFatal(f"tensor-parallel worker {rank} exited (code {proc.exitcode}){self.reasons()}")

    def send(self, msg: StepMessage | Logits | Probe | GapTrace) -> None:
        self.check()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def reasons(self) -> str:
        """What failed workers reported, if anything (they send one line before exiting)."""
        got = []
        for conn in self.conns:
            try:
                while conn.poll(0.2):
                    got.append(str(conn.recv()))
            except (EOFError, OSError, pickle.UnpicklingError):
                pass
        return ": " + "; ".join(got) if got else ""

    def close(self) -> None:
        """Stop the workers (they finish their step first) and leave the process group."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if dist.is_initialized():
            _leave_group()


def _leave_group(timeout_s: float = 30.0) -> None:
    """Rank 0 leaves the process group once the workers have exited, which they do without leaving it (leaving
    waits on the others). NCCL's communicators are aborted rather than destroyed: ``destroy_process_group``
    waits on the peers in ``ncclCommDestroy`` (pytorch/pytorch#115388). Either waits until every CUDA graph that
    captured one of their collectives is gone, so the graphs are released first (``TensorParallelModel.close``)
    and garbage is collected here; the abort runs in a daemon thread, so a graph still held elsewhere leaves
    the group behind with a warning rather than hanging the process. Gloo's group is destroyed."""
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    import gc

    gc.collect()
    torch.cuda.synchronize()
    done = threading.Event()

    def abort():
        dist.distributed_c10d._abort_process_group()
        done.set()

    threading.Thread(target=abort, name="vlora-tp-leave", daemon=True).start()
    if not done.wait(timeout_s):
        sys.stderr.write(f"vlora: the tensor-parallel process group did not close within {timeout_s:g} s (a CUDA "
                         f"graph holding its collectives is still alive); leaving it behind\n")
