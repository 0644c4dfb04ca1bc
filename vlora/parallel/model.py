"""Rank 0's side of tensor parallelism: the engine's model, its mode switcher and its decode graphs, each of
which tells the workers (``worker.py``) to do the same with their shards.

The engine speaks whole adapters (the registry's); rank 0 computes with its slices of them. On the Triton
path the adapter store keeps rank 0's slices (``AdapterStore.view``) and places them in rank 0's pool; every
message says which adapters were placed where (or evicted) since the last one, and the workers place their
slices at the same offsets.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from vlora.engine.cuda_graphs import BASE, LORA, MIXED, DecodeGraphs
from vlora.engine.faults import EngineFatal, describe
from vlora.engine.modes import ModeSwitcher, ShardWeights
from vlora.lora.batch import PackedAdapter
from vlora.models.forward_batch import ForwardBatch
from vlora.parallel.collectives import (SizedAllReduce, calibrate, make_reduce, nccl_all_reduce, reduce_parts,
                                        time_all_reduce)
from vlora.parallel.group import TensorParallelGroup, WorkerSpec
from vlora.parallel.messages import (GapTrace, GraphSetup, Logits, Probe, Replay, StepMessage, by_name, lora_of,
                                     passes, strip, tensors_to)
from vlora.parallel.partition import Shard, shard_adapter, shard_decoder

log = logging.getLogger(__name__)


def _cpu(obj):
    return tensors_to(obj, lambda t: t.cpu())


class TensorParallelModel(nn.Module):
    """Rank 0's model: sends each forward's batch to the workers, then runs rank 0's shard. ``cfg`` is the whole
    model's (adapters, vocabulary, sliding window); ``local_cfg`` and the layers' configs are rank 0's."""

    def __init__(self, inner, group: TensorParallelGroup, device: torch.device):
        super().__init__()
        self.inner = inner
        self.cfg = inner.cfg
        self.group = group
        self.shard = Shard.of(inner.cfg, 0, group.world)
        self.local_cfg = self.shard.local_config(inner.cfg)
        self.kv_heads_per_rank = len(self.shard.kv_heads)
        self.device = device
        kind = group.spec.all_reduce
        reduce = make_reduce(kind, group.spec.dtype, device)
        self.reduces = reduce_parts(kind, reduce)      # by name: benchmark probes reuse them
        shard_decoder(inner, self.shard, reduce)
        if isinstance(reduce, SizedAllReduce):         # the workers calibrate theirs at the same point
            calibrate(reduce, inner.cfg.hidden_size, group.spec.dtype, device)
        self.all_reduce = reduce.describe() if isinstance(reduce, SizedAllReduce) else \
            "nccl" if reduce is nccl_all_reduce else kind          # auto on the CPU, or without the one-shot
        self.all_reduce_timings = getattr(reduce, "timings", [])
        log.info("tensor parallelism (TP=%d): all-reduce %s", group.world, self.all_reduce)
        self.stacked = getattr(inner, "stacked", None)
        self.registry = None                     # the engine's adapters: those it forgets are dropped everywhere
        self.modes: ShardModes | None = None     # rank 0's merges (the workers follow them)
        self._parts: dict[str, tuple[PackedAdapter, PackedAdapter]] = {}   # name -> (whole, rank 0's slices)
        self._sent: dict[str, PackedAdapter] = {}                          # name -> the whole adapter workers have
        self._placed: dict[str, tuple[PackedAdapter, int]] = {}   # name -> (adapter, epoch) the workers placed
        self._failed: str | None = None
        self.graphs: ShardGraphs | None = None   # rank 0's decode graphs, released before the group goes
        self.host_slots = 0                      # FastLibra's host slots for KV (each rank: its own)
        self._swaps: list[tuple[str, int, int]] = []   # the swapper's copies the workers have yet to make

    @property
    def layers(self):
        return self.inner.layers

    @property
    def graph_safe(self) -> bool:
        """Whether decode iterations may be captured as graphs: as the model cut (not a mixture of experts)."""
        return getattr(self.inner, "graph_safe", True)

    def whole(self, name: str) -> PackedAdapter:
        return self._parts[name][0]

    def part(self, adapter: PackedAdapter) -> PackedAdapter:
        """Rank 0's slices of ``adapter`` (where the adapter is: on the host for the store's copies)."""
        have = self._parts.get(adapter.name)
        if have is None or have[0] is not adapter:
            have = self._parts[adapter.name] = (adapter, shard_adapter(adapter, self.cfg, self.shard))
        return have[1]

    # -- messages ------------------------------------------------------------------------------------
    def _send(self, used: dict[str, PackedAdapter], kv_shape, **step) -> None:
        """Send one message: ``step``'s fields plus the adapters new to the workers, those the engine forgot,
        the pool placements and the swapper's KV copies since the last message, and the merged adapter."""
        merged = None if self.modes is None else self.modes.merged
        if merged is not None:                   # the workers merge their slices of it
            used = {**used, merged.name: merged}
        new = {n: a for n, a in used.items() if self._sent.get(n) is not a}
        dropped = ()
        if self.registry is not None:
            dropped = tuple(n for n in self._sent if n not in self.registry and n not in used)
            for n in dropped:
                del self._sent[n]
                self._parts.pop(n, None)
        placed = self._placements(new)
        shape = None if kv_shape is None else tuple(kv_shape)
        swaps, self._swaps = tuple(self._swaps), []
        self.group.send(StepMessage(shape, adapters={n: _cpu(a) for n, a in new.items()}, placed=placed,
                                    dropped=dropped, merged=None if merged is None else merged.name,
                                    swaps=swaps, host_slots=self.host_slots, **step))
        self._sent.update(new)

    def queue_swap(self, op: str, page: int, slot: int) -> None:
        """A KV copy the swapper made on rank 0 (``op`` "out": page to host slot, "in": back): the workers make
        theirs with the next message."""
        self._swaps.append((op, page, slot))

    def _placements(self, new: dict[str, PackedAdapter]) -> dict[str, tuple[int, int] | None]:
        """Adapters the store placed in the pool (epoch, first element) or evicted since the last message.
        An adapter is placed only once the workers have it (``new`` goes with this message)."""
        store = None if self.registry is None else self.registry.store
        if store is None:
            return {}
        out: dict[str, tuple[int, int] | None] = {}
        pool = store.pool
        for name, a in store.resident.items():
            have = self._placed.get(name)
            if have is None or have[0] is not a or have[1] != a.placement.epoch:
                if self._sent.get(name) is not a and name not in new:
                    new[name] = a
                out[name] = (a.placement.epoch, pool.adapter_pages[name][0] * pool.page_elems)
                self._placed[name] = (a, a.placement.epoch)
        for name in [n for n in self._placed if n not in store.resident]:
            del self._placed[name]
            if name in self._sent or name in new:
                out[name] = None
        return out

    def _guard(self, fn):
        if self._failed is not None:
            raise EngineFatal(self._failed)
        try:
            return fn()
        except Exception as e:
            reason = e.args[0] if isinstance(e, EngineFatal) else \
                f"the tensor-parallel group failed: {describe(e)}{self.group.reasons()}"
            self._failed = reason
            self.group.noticed = True
            raise EngineFatal(reason) from e

    # -- forward -------------------------------------------------------------------------------------
    def forward(self, fb: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        return self._guard(lambda: self._forward(fb, kv_cache))

    def _forward(self, fb: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        ps = passes(fb.lora)
        used = {s.adapter.name: s.adapter for p in ps for s in p.segments}
        segs = tuple(by_name(p.segments) for p in ps)
        kernel = fb.lora is not None and fb.lora.kernel is not None
        self._send(used, kv_cache.shape, batch=_cpu(dataclasses.replace(fb, lora=None)),
                   lora=() if kernel else segs, kernel_lora=_cpu(strip(fb.lora)) if kernel else None)
        if kernel:                               # the kernels read rank 0's slices where the store put them
            return self.inner(fb, kv_cache)
        parts = {n: self.part(a) for n, a in used.items()}
        return self.inner(dataclasses.replace(fb, lora=lora_of(segs, parts.__getitem__)), kv_cache)

    def compute_logits(self, hidden: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """Logits of ``hidden``'s rows, eagerly: the workers get the rows by broadcast and add their slices of the
        vocabulary to the gather (the decode graphs gather theirs inside the replay)."""
        if self.inner.vocab_part is None:
            return self.inner.compute_logits(hidden, fast)

        def run():
            h = hidden.contiguous()
            self.group.send(Logits(h.shape[0], fast))
            dist.broadcast(h, src=0)
            return self.inner.compute_logits(h, fast)
        return self._guard(run)

    def decode_graphs(self, model, kv_cache, max_batch, max_blocks, scratch_slot, lora_setup=None, columns=512,
                      launch=None):
        """The runner's decode graphs: rank 0's, and, through a message, the workers' (same sizes)."""
        kw = {} if launch is None else {"launch": launch}
        self.graphs = ShardGraphs(self, kv_cache, max_batch, max_blocks, scratch_slot, lora_setup, columns, **kw)
        return self.graphs

    def time_all_reduce(self, kind: str, numel: int, reps: int = 100, graphed: bool = True) -> float:
        """Milliseconds per all-reduce of ``numel`` elements of the model's dtype, by ``kind`` (nccl or
        symm_mem), run on every rank at once, eagerly or from a CUDA graph (benchmarks; nothing else runs)."""
        def probe():
            dtype = self.group.spec.dtype
            self.group.send(Probe(kind, numel, reps, graphed))
            if kind not in self.reduces:
                self.reduces[kind] = make_reduce(kind, dtype, self.device)
            return time_all_reduce(self.reduces[kind], numel, dtype, self.device, reps, graphed)
        return self._guard(probe)

    def gap_trace(self, path: str | None) -> None:
        """Tell the workers to start recording the GPU time between their graph replays (``path`` None), or to
        stop and write it, one JSON file per worker: ``path`` with ``{rank}`` replaced (benchmarks)."""
        self._guard(lambda: self.group.send(GapTrace(path)))

    def close(self) -> None:
        """Release rank 0's graphs before the group goes: its NCCL communicators are torn down only once no
        graph that captured their collectives is left (``group._leave_group``)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self.group.close()


class ShardModes(ModeSwitcher):
    """Rank 0's mode switcher: merges fold rank 0's slices of an adapter into its shard (exact, per shard, as
    on one GPU); the next message tells the workers to do the same with theirs. It speaks whole adapters
    to the engine (``merged``, ``merge``), as the one-process switcher does."""

    def __init__(self, model: TensorParallelModel):
        super().__init__(ShardWeights(model.local_cfg, model.stacked))
        self.model = model
        model.modes = self

    @property
    def merged(self) -> PackedAdapter | None:
        return None if self.record is None else self.model.whole(self.record.adapter.name)

    def merge(self, adapter: PackedAdapter) -> float:
        if self.merged is adapter:
            return 0.0
        return super().merge(self.model.part(adapter))


class ShardGraphs(DecodeGraphs):
    """Rank 0's decode graphs over its shard. Every capture and replay is announced to the workers first, so
    every rank captures the same graphs in the same order (their all-reduces pair up) and replays them
    together. Every rank's graphs compute its slice of the logits and gather them; rank 0's keep them."""

    capture_error_mode = "thread_local"       # NCCL's watchdog thread queries its events while a capture runs
    eager_when_capture_fails = False          # the workers capture and replay it too

    def __init__(self, tp: TensorParallelModel, kv_cache, max_batch, max_blocks, scratch_slot, lora_setup, columns,
                 launch=None):
        kw = {} if launch is None else {"launch": launch}
        super().__init__(tp.inner, kv_cache, max_batch, max_blocks, scratch_slot, lora_setup, columns, **kw)
        self.tp = tp
        self._setup = GraphSetup(self.max_batch, max_blocks, scratch_slot, columns, self.launch,
                                 lora_setup is not None, 0 if lora_setup is None else lora_setup[4])
        tp._guard(lambda: tp._send({}, kv_cache.shape, graphs=self._setup))

    def capture_all(self, with_lora: bool = True, mixed: bool = False) -> None:
        setup = dataclasses.replace(self._setup, capture=(with_lora, mixed))
        self.tp._guard(lambda: (self.tp._send({}, self.kv_cache.shape, graphs=setup),
                                super(ShardGraphs, self).capture_all(with_lora, mixed)))

    def run(self, ids, positions, slots, lens, tables, counts, segments, minus=(), src=None, prev_tokens=None):
        kind = MIXED if minus else LORA if segments else BASE
        if self.bucket(len(ids)) is None or (kind and self.lora_setup is None):
            return None

        def replay():
            used = {s.adapter.name: s.adapter for s in list(segments) + list(minus)}
            queued = src is not None and prev_tokens is not None
            prev = prev_tokens.to(torch.int64) if queued else None
            self.tp._send(used, self.kv_cache.shape, replay=Replay(
                list(ids), list(positions), list(slots), [t[:c] for t, c in zip(tables, counts)], list(lens),
                by_name(segments), by_name(minus), list(src) if queued else None, len(prev) if queued else 0))
            if queued:      # the workers' rows read the tokens this rank sampled, still on the device
                dist.broadcast(prev, src=0)
            return super(ShardGraphs, self).run(ids, positions, slots, lens, tables, counts, segments, minus, src,
                                                prev)
        return self.tp._guard(replay)


def tensor_parallel(model, world: int, spec: WorkerSpec, device: torch.device) -> TensorParallelModel:
    """Start ``world - 1`` workers and cut ``model`` to rank 0's shard; returns the engine's model."""
    Shard.of(model.cfg, 0, world)                # refuse a shape that does not split before starting anyone
    group = TensorParallelGroup(world, spec)
    group.wait_built()
    try:
        return TensorParallelModel(model, group, device)
    except Exception:
        group.close()
        raise
