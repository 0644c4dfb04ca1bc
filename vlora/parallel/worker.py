"""A tensor-parallel worker (ranks 1..N-1): its shard of the model, its pool, and the loop that runs every
message rank 0 sends (see ``group.py`` for the process side, ``messages.py`` for what a message holds).

A worker keeps its own slices of every adapter (``partition.shard_adapter``). On the Triton path it
places them in its pool at the offsets rank 0's store chose for rank 0's slices: the slices have the same
shapes on every rank, so the same offsets fit, and the kernels' metadata rank 0 builds is valid here as is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle

import torch
import torch.distributed as dist

from vlora.engine.cuda_graphs import DecodeGraphs
from vlora.engine.faults import describe
from vlora.engine.modes import ModeSwitcher, ShardWeights
from vlora.engine.runner import lora_groups
from vlora.lora.batch import PackedAdapter
from vlora.lora.device_store import aligned, matrices, group_offsets
from vlora.memory.pool import zeros
from vlora.memory.swapper import host_slot_buffer
from vlora.parallel.collectives import SizedAllReduce, calibrate, make_reduce, reduce_parts, time_all_reduce
from vlora.parallel.messages import (GapTrace, GraphSetup, Logits, Probe, Replay, StepMessage, lora_of,
                                     segments_of, tensors_to, with_buffer)
from vlora.parallel.partition import Shard, shard_adapter, shard_decoder


class WorkerGraphs(DecodeGraphs):
    """A worker's decode graphs: the forward, then this rank's slice of the logits into their gather (rank 0
    keeps the gathered logits; a worker's graph keeps only its hidden state as output)."""

    capture_error_mode = "thread_local"       # NCCL's watchdog thread queries its events while a capture runs
    eager_when_capture_fails = False          # rank 0 replays it too

    def _run_forward(self, b: int, kind: int, mixed: bool = False):
        fb, cap = self._forward_batch(b, kind, mixed)
        hidden = self.model(fb, self.kv_cache)
        if self.model.vocab_part is not None:
            self.model.project_logits(hidden.index_select(0, fb.logits_rows) if mixed else hidden, fast=True)
        return hidden, cap


class Worker:
    def __init__(self, model, shard: Shard, device: torch.device, dtype: torch.dtype, host_adapters: bool = False,
                 reduces: dict | None = None):
        self.model, self.shard, self.device, self.dtype = model, shard, device, dtype
        self.adapter_device = None if host_adapters else device     # None: where they arrive, on the host
        self.local = shard.local_config(model.cfg)
        self.parts: dict[str, PackedAdapter] = {}       # this rank's slices of every adapter rank 0 has sent
        self.buf = self.kv = None                       # the pool: adapters (Triton path) and KV
        self.host: torch.Tensor | None = None           # FastLibra's host slots of this rank's KV slices
        self.modes = ModeSwitcher(ShardWeights(self.local, model.stacked))
        self.graphs: WorkerGraphs | None = None
        # all-reduce kind -> its function; the model's own is reused by probes, as rank 0 does: a second
        # symmetric-memory rendezvous on this rank alone would wait forever for rank 0's
        self.reduces = dict(reduces or {})
        self.replay_events: list | None = None          # (rows, start, end) per replay while a GapTrace runs

    def handle(self, msg: StepMessage) -> None:
        for name, a in msg.adapters.items():
            self.parts[name] = shard_adapter(a, self.model.cfg, self.shard, self.adapter_device)
        if self.kv is None and msg.kv_shape is not None:
            numel = 1
            for d in msg.kv_shape:
                numel *= d
            self.buf = zeros(numel, self.dtype, self.device)
            self.kv = self.buf.view(msg.kv_shape)
        if self.host is None and msg.host_slots and self.kv is not None:
            self._host_slots(msg.host_slots)     # with the first message, at start-up: pinning takes seconds
        if msg.swaps:               # before the placements: a page swapped out may hold an adapter placed since
            self._swap(msg.swaps)
        for name, where in msg.placed.items():
            if where is None:
                self.parts[name].placement.offsets = None
            else:
                self._place(self.parts[name], *where)
        if msg.merged is None:
            self.modes.unmerge()
        elif self.modes.merged is not self.parts[msg.merged]:     # by identity: a name may be reloaded
            self.modes.merge(self.parts[msg.merged])
        for name in msg.dropped:
            self.parts.pop(name, None)
            self.modes.forget(name)
        if msg.graphs is not None:
            self._graphs(msg.graphs)
        if msg.replay is not None:
            self._replay(msg.replay)
        if msg.batch is not None:
            fb = tensors_to(msg.batch, lambda t: t.to(self.device))
            if msg.kernel_lora is not None:
                lora = with_buffer(tensors_to(msg.kernel_lora, lambda t: t.to(self.device)), self.buf)
            else:
                lora = lora_of(msg.lora, self.parts.__getitem__)
            self.model(dataclasses.replace(fb, lora=lora), self.kv)

    def _host_slots(self, slots: int) -> None:
        """FastLibra's host slots for this rank's slices of the pages (rank 0's count; pinned on CUDA)."""
        self.host = host_slot_buffer(slots, self.kv[0].numel(), self.dtype, self.device.type == "cuda")

    def _swap(self, swaps) -> None:
        """Rank 0's swapper copies, made here in its order with this rank's slices of the pages (on this rank's
        stream, before the message's forward: it may write a page just swapped out)."""
        for op, page, slot in swaps:
            if op == "out":
                self.host[slot].copy_(self.kv[page].view(-1))
            else:
                self.kv[page].view(-1).copy_(self.host[slot])

    def logits(self, m: Logits) -> None:
        """Rank 0's eager logits: its hidden rows by broadcast, this rank's slice into the gather."""
        h = torch.empty(m.rows, self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
        dist.broadcast(h, src=0)
        self.model.project_logits(h, m.fast)

    def probe(self, p: Probe) -> None:
        """Time an all-reduce together with rank 0 (benchmarks; nothing else runs meanwhile)."""
        if p.kind not in self.reduces:
            self.reduces[p.kind] = make_reduce(p.kind, self.dtype, self.device)
        time_all_reduce(self.reduces[p.kind], p.numel, self.dtype, self.device, p.reps, p.graphed)

    def gap_trace(self, t: GapTrace, rank: int) -> None:
        """Start recording an event pair around each graph replay, or stop and write, per pair of consecutive
        replays, the GPU time between them and the later one's rows (benchmarks)."""
        if t.path is None:
            self.replay_events = []
            return
        events, self.replay_events = self.replay_events or [], None
        if events:
            events[-1][2].synchronize()
        gaps = [{"rows": rows, "gap_ms": events[k - 1][2].elapsed_time(start)}
                for k, (rows, start, _) in enumerate(events) if k]
        with open(t.path.format(rank=rank), "w") as f:
            json.dump({"rank": rank, "replays": len(events), "gaps": gaps}, f)

    def _place(self, part: PackedAdapter, epoch: int, first: int) -> None:
        """Copy this rank's slices of an adapter into the pool from element ``first`` on, laid out as rank 0's
        store lays out its own (back to back, each matrix aligned)."""
        offs, pos = [], first
        for m in matrices(part):
            n = m.numel()
            self.buf[pos:pos + n].copy_(m.reshape(-1))
            self.buf[pos + n:pos + aligned(n)].zero_()
            offs.append(pos)
            pos += aligned(n)
        part.placement.offsets = group_offsets(part, iter(offs), self.device)
        part.placement.epoch = epoch

    def _graphs(self, setup: GraphSetup) -> None:
        if setup.capture is not None:
            self.graphs.capture_all(*setup.capture)
            return
        lora = None
        if setup.with_lora:
            from vlora.kernels.tuning import TilingTable

            widths, group_in = lora_groups(self.local)
            lora = (lambda: self.buf, widths, group_in, TilingTable.load(), setup.max_rank)
        self.graphs = WorkerGraphs(self.model, self.kv, setup.max_batch, setup.max_blocks, setup.scratch_slot, lora,
                                   setup.columns, setup.launch)

    def _replay(self, r: Replay) -> None:
        part = self.parts.__getitem__
        prev = None
        if r.src is not None:                    # queued behind the iteration before: its tokens, from rank 0
            prev = torch.empty(r.prev_rows, dtype=torch.int64, device=self.device)
            dist.broadcast(prev, src=0)
        timed = self.replay_events is not None and self.device.type == "cuda"
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        self.graphs.run(r.ids, r.positions, r.slots, r.lens, r.tables, [len(t) for t in r.tables],
                        list(segments_of(r.segments, part)), list(segments_of(r.minus, part)), r.src, prev)
        if timed:
            end.record()
            self.replay_events.append((len(r.ids), start, end))


def build_model(spec, device: torch.device, rank: int, world: int):
    """The same model as rank 0's (its seed too, for random:<preset> weights), cut to this rank's shard (while
    it is built, for random:<preset> models), language model only: an LMM's vision tower runs on rank 0 alone
    (see ``vlora/parallel/__init__.py``)."""
    from vlora.models.build import load_model

    loaded = load_model(spec.model, spec.dtype, device, spec.max_model_len, 1, 1, spec.seed,
                        cut=lambda m: shard_decoder(m, Shard.of(m.cfg, rank, world)), tokenizer=spec.tokenizer)
    model = loaded.model
    del loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def _exit_with_parent(parent: int) -> None:
    """Exit when rank 0's process is gone, even while blocked on the GPU (a graph-replayed collective waiting
    for rank 0 has no timeout)."""
    import time

    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def run_worker(rank: int, world: int, port: int, spec, conn) -> None:
    """A worker's life: join the group (rank 0's store at ``port``), build and cut its model, then handle every
    message rank 0 sends until it sends None or goes away."""
    import torch.distributed as dist

    from vlora.parallel.collectives import init_group, tcp_store

    import threading

    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="vlora-tp-parent", daemon=True).start()
    try:
        torch.set_num_threads(1)
        device = torch.device(spec.device_type, rank) if spec.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = tcp_store(port, world, False, spec.timeout_s)
        store.set(f"joined{rank}", "1")
        init_group(rank, world, store, device, spec.timeout_s)
        model = build_model(spec, device, rank, world)
        store.set(f"built{rank}", "1")
        shard = Shard.of(model.cfg, rank, world)
        reduce = make_reduce(spec.all_reduce, spec.dtype, device)
        shard_decoder(model, shard, reduce)
        if isinstance(reduce, SizedAllReduce):     # with rank 0, which calibrates its own at the same point
            calibrate(reduce, model.cfg.hidden_size, spec.dtype, device)
        worker = Worker(model, shard, device, spec.dtype, spec.host_adapters, reduce_parts(spec.all_reduce, reduce))
        with torch.inference_mode():
            while True:
                msg: StepMessage | Logits | Probe | GapTrace | None = pickle.loads(conn.recv_bytes())
                if msg is None:
                    os._exit(0)          # nothing to flush; leaving the group would wait on the others
                if isinstance(msg, Probe):
                    worker.probe(msg)
                elif isinstance(msg, Logits):
                    worker.logits(msg)
                elif isinstance(msg, GapTrace):
                    worker.gap_trace(msg, rank)
                else:
                    worker.handle(msg)
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
