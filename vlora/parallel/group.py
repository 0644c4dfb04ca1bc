"""Tensor parallelism: one worker process per extra rank, driven by the engine's process (rank 0).

The engine (scheduler, memory, sampling) runs only in rank 0. Each iteration
its runner builds the ``ForwardBatch``; :class:`TensorParallelModel` (the
engine's model) sends it to every worker as one pickled :class:`StepMessage`
over a pipe per worker, then runs rank 0's shard. Workers run theirs on the
same batch; the row-parallel projections' all-reduces keep the ranks in step.
Rank 0 alone computes logits (the LM head is replicated) and samples. No
worker re-derives anything: the message carries the tokens, positions, KV
slots and block tables, the LoRA segments by adapter name, and the adapters
new to the workers (each worker keeps its own slices, see ``partition.py``).
Every rank's pool has the same pages (the KV of its own heads), so page ids
mean the same on all of them.

Collectives run on ``torch.distributed``: NCCL on GPUs, gloo on the CPU. A
worker that dies closes its pipe and its sockets: rank 0 checks the workers
before every step and turns any failure in the group into
:class:`~vlora.engine.faults.EngineFatal` naming the rank and its reason; the
collectives' timeout bounds the wait for a worker that hangs. A worker whose
driver goes away sees its pipe close and exits.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from dataclasses import dataclass
from types import SimpleNamespace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from vlora.engine.modes import ModeSwitcher

from vlora.engine.faults import EngineFatal, describe
from vlora.lora.batch import LoRABatch, LoRASegment, PackedAdapter
from vlora.models.forward_batch import ForwardBatch
from vlora.parallel.partition import Shard, shard_adapter, shard_decoder

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # NVLink multicast stays off (the GPU hosts here run without it)
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")   # a failed or timed-out NCCL collective ends its
#                                                                 process instead of leaving it hung


@dataclass(frozen=True)
class WorkerSpec:
    """How a worker builds its copy of the model (the engine's model config, resolved)."""

    model: str | None           # a model directory, a random:<preset> spec, None: the embedded default
    dtype: torch.dtype
    device_type: str            # "cpu" or "cuda" (a worker of rank r takes cuda:r)
    max_model_len: int | None
    seed: int
    timeout_s: float            # collectives and start-up


@dataclass(frozen=True)
class StepMessage:
    """What a worker receives for one iteration."""

    batch: ForwardBatch                     # on the CPU, ``lora`` None
    lora: tuple[tuple[tuple[int, int, str, float], ...], ...]   # per LoRA pass: (first row, end row, adapter, scale)
    kv_shape: tuple[int, ...]               # rank 0's pages [P + 1, L, 2, block, Hkv_local, D]: the same here
    adapters: dict[str, PackedAdapter]      # adapters new to the workers (whole, on the CPU)
    dropped: tuple[str, ...] = ()           # adapters the engine no longer has
    merged: str | None = None               # the adapter folded into the base weights (each rank: its slices)


def _map(obj, fn):
    """``obj`` with every tensor inside (dataclasses, tuples, lists, dicts) replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _passes(lora: LoRABatch | None) -> list[LoRABatch]:
    out = []
    while lora is not None:
        out.append(lora)
        lora = lora.extra
    return out


def _lora(passes, part) -> LoRABatch | None:
    """The LoRA batch of segment passes ``[(start, end, adapter name, scale), ...]``, each adapter ``part(name)``
    (this rank's slices); passes after the first become ``extra``."""
    batch = None
    for segs in reversed(passes):
        batch = LoRABatch(tuple(LoRASegment(s, e, part(n), sc) for s, e, n, sc in segs), extra=batch)
    return batch


def _init(rank: int, world: int, store, spec: WorkerSpec) -> None:
    dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world, timeout=timedelta(seconds=spec.timeout_s))


def _store(port: int, world: int, master: bool, spec: WorkerSpec):
    return dist.TCPStore("127.0.0.1", port, world, is_master=master, timeout=timedelta(seconds=spec.timeout_s),
                         wait_for_workers=False)


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def build_model(spec: WorkerSpec, device: torch.device):
    from vlora.models.build import load_model

    # the same model as the driver's (its seed too, for random:<preset> weights); decoders only
    return load_model(spec.model, spec.dtype, device, spec.max_model_len, 1, 1, spec.seed).model


def _worker(rank: int, world: int, port: int, spec: WorkerSpec, conn) -> None:
    """A worker's life: join the group, build and cut its model, then run every step rank 0 sends."""
    try:
        torch.set_num_threads(1)
        device = torch.device(spec.device_type, rank) if spec.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = _store(port, world, False, spec)
        store.set(f"joined{rank}", "1")
        _init(rank, world, store, spec)
        model = build_model(spec, device)
        shard = Shard.of(model.cfg, rank, world)
        shard_decoder(model, shard, _all_reduce)
        kv, parts = None, {}
        modes = ModeSwitcher(SimpleNamespace(cfg=shard.local_config(model.cfg), stacked=model.stacked))
        with torch.inference_mode():
            while True:
                msg: StepMessage | None = pickle.loads(conn.recv_bytes())
                if msg is None:
                    os._exit(0)          # nothing to flush; leaving the group would wait on the others
                for name, a in msg.adapters.items():
                    parts[name] = shard_adapter(a, model.cfg, shard, device)
                if msg.merged is None:
                    modes.unmerge()
                elif modes.merged is None or modes.merged.name != msg.merged:
                    modes.merge(parts[msg.merged])
                for name in msg.dropped:
                    parts.pop(name, None)
                    modes.forget(name)
                if kv is None or tuple(kv.shape) != msg.kv_shape:
                    kv = torch.zeros(msg.kv_shape, dtype=spec.dtype, device=device)
                fb = _map(msg.batch, lambda t: t.to(device))
                model(dataclasses.replace(fb, lora=_lora(msg.lora, parts.__getitem__)), kv)
    except EOFError:                     # rank 0 went away
        return
    except BaseException as e:
        try:
            conn.send(f"rank {rank}: {describe(e)}")
        except Exception:
            pass
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class TensorParallelGroup:
    """Rank 0's handle on the workers: start them, send each step, stop them."""

    def __init__(self, world: int, spec: WorkerSpec):
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                               "engine per process")
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        store = _store(0, world, True, spec)               # port 0: the store picks a free one
        port = store.port
        self.world, self.spec = world, spec
        self.conns, self.procs = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, port, spec, child), daemon=True,
                               name=f"vlora-tp{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            deadline = time.monotonic() + spec.timeout_s
            while not store.check([f"joined{r}" for r in range(1, world)]):    # a worker that dies while starting
                self.check()                                                 # (spawn, import) is seen at once
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the workers did not join within {spec.timeout_s:g} s")
                time.sleep(0.05)
            _init(0, world, store, spec)
        except Exception as e:
            self.close()
            raise RuntimeError(f"tensor-parallel workers did not start: {describe(e)}{self.reasons()}") from e
        self.closed = False

    def check(self) -> None:
        """Raise EngineFatal if a worker has exited."""
        for rank, proc in enumerate(self.procs, 1):
            if not proc.is_alive():
                raise EngineFatal(f"tensor-parallel worker {rank} exited (code {proc.exitcode}){self.reasons()}")

    def send(self, msg: StepMessage) -> None:
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
            dist.destroy_process_group()


class TensorParallelModel(nn.Module):
    """Rank 0's model: sends each forward's batch to the workers, then runs rank 0's shard. ``cfg`` is the whole
    model's (adapters, vocabulary, sliding window); the layers hold the local one."""

    def __init__(self, inner, group: TensorParallelGroup):
        super().__init__()
        self.inner = inner
        self.cfg = inner.cfg
        self.group = group
        self.shard = Shard.of(inner.cfg, 0, group.world)
        self.kv_heads_per_rank = len(self.shard.kv_heads)
        shard_decoder(inner, self.shard, _all_reduce)
        self.stacked = getattr(inner, "stacked", None)
        self.registry = None                     # the engine's adapters: those it forgets are dropped everywhere
        self.modes: ShardModes | None = None     # rank 0's merges (the workers follow them)
        self._parts: dict[str, tuple[PackedAdapter, PackedAdapter]] = {}   # name -> (whole, rank 0's slices)
        self._sent: dict[str, PackedAdapter] = {}                          # name -> the whole adapter workers have
        self._failed: str | None = None

    @property
    def layers(self):
        return self.inner.layers

    def whole(self, name: str) -> PackedAdapter:
        return self._parts[name][0]

    def _part(self, adapter: PackedAdapter) -> PackedAdapter:
        have = self._parts.get(adapter.name)
        if have is None or have[0] is not adapter:
            have = self._parts[adapter.name] = (adapter, shard_adapter(adapter, self.cfg, self.shard))
        return have[1]

    def forward(self, fb: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        if self._failed is not None:
            raise EngineFatal(self._failed)
        try:
            passes = _passes(fb.lora)
            used = {s.adapter.name: s.adapter for p in passes for s in p.segments}
            merged = None if self.modes is None else self.modes.merged
            if merged is not None:               # the workers merge their slices of it
                used[merged.name] = merged
            new = {n: a for n, a in used.items() if self._sent.get(n) is not a}
            dropped = ()
            if self.registry is not None:
                dropped = tuple(n for n in self._sent if n not in self.registry and n not in used)
                for n in dropped:
                    del self._sent[n]
                    self._parts.pop(n, None)
            parts = {n: self._part(a) for n, a in used.items()}
            segs = tuple(tuple((s.start, s.end, s.adapter.name, s.scale) for s in p.segments) for p in passes)
            cpu = lambda t: t.cpu()              # noqa: E731
            self.group.send(StepMessage(_map(dataclasses.replace(fb, lora=None), cpu), segs, tuple(kv_cache.shape),
                                        {n: _map(a, cpu) for n, a in new.items()}, dropped,
                                        None if merged is None else merged.name))
            self._sent.update(new)
            return self.inner(dataclasses.replace(fb, lora=_lora(segs, parts.__getitem__)), kv_cache)
        except Exception as e:
            reason = e.args[0] if isinstance(e, EngineFatal) else \
                f"the tensor-parallel group failed: {describe(e)}{self.group.reasons()}"
            self._failed = reason
            raise EngineFatal(reason) from e

    def compute_logits(self, hidden: torch.Tensor, fast: bool = False) -> torch.Tensor:
        return self.inner.compute_logits(hidden, fast)

    def close(self) -> None:
        self.group.close()


class ShardModes(ModeSwitcher):
    """Rank 0's mode switcher: merges fold rank 0's slices of an adapter into its shard (exact, per shard, as
    on one GPU); the next step's message tells the workers to do the same with theirs. It speaks whole adapters
    to the engine (``merged``, ``merge``), as the one-process switcher does."""

    def __init__(self, model: TensorParallelModel):
        super().__init__(SimpleNamespace(cfg=model.shard.local_config(model.cfg), stacked=model.stacked))
        self.model = model
        model.modes = self

    @property
    def merged(self) -> PackedAdapter | None:
        return None if self.record is None else self.model.whole(self.record.adapter.name)

    def merge(self, adapter: PackedAdapter) -> float:
        if self.merged is adapter:
            return 0.0
        return super().merge(self.model._part(adapter))


def tensor_parallel(model, world: int, spec: WorkerSpec) -> TensorParallelModel:
    """Start ``world - 1`` workers and cut ``model`` to rank 0's shard; returns the engine's model."""
    Shard.of(model.cfg, 0, world)                # refuse a shape that does not split before starting anyone
    group = TensorParallelGroup(world, spec)
    try:
        return TensorParallelModel(model, group)
    except Exception:
        group.close()
        raise

