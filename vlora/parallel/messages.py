"""What rank 0 sends its workers: one :class:`StepMessage` per forward, decode-graph replay or capture.

A message carries everything a worker needs and nothing it would re-derive: the forward's tensors (on the
CPU), the LoRA segments by adapter name (torch path) or the kernels' metadata (Triton path, offsets into the
pool, which are the same on every rank), the adapters new to the workers, where adapters were placed in the
pool or evicted since the last message, which adapter is merged, and the KV pages FastLibra's swapper copied
to or from host memory since the last message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vlora.lora.batch import LoRABatch, LoRALaunch, LoRASegment, PackedAdapter
from vlora.models.forward_batch import ForwardBatch

Segments = tuple[tuple[tuple[int, int, str, float], ...], ...]     # per LoRA pass: (first row, end row, name, scale)


@dataclass(frozen=True)
class Replay:
    """A decode iteration served from the decode graphs (the arguments of ``DecodeGraphs.run``)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    lens: list[int]
    segments: tuple[tuple[int, int, str, float], ...]
    minus: tuple[tuple[int, int, str, float], ...]
    # async scheduling: row i takes as its input token the src[i]-th token the iteration before sampled on rank 0
    # (src[i] >= 0), which rank 0 broadcasts (``prev_rows`` of them, int64) before the replay
    src: list[int] | None = None
    prev_rows: int = 0


@dataclass(frozen=True)
class GraphSetup:
    """Decode graphs to build (``DecodeGraphs``'s sizes), or, with ``capture``, to capture now (``capture_all``'s
    arguments): every rank captures the same graphs in the same order."""

    max_batch: int
    max_blocks: int
    scratch_slot: int
    columns: int
    launch: LoRALaunch
    with_lora: bool
    max_rank: int
    capture: tuple[bool, bool] | None = None      # (with_lora, mixed)


@dataclass(frozen=True)
class Probe:
    """Time an all-reduce (``collectives.time_all_reduce``'s arguments) on every rank at once (benchmarks): a
    message of its own, never part of a step's."""

    kind: str
    numel: int
    reps: int
    graphed: bool


@dataclass(frozen=True)
class Logits:
    """Rank 0 computes logits eagerly (the rows that sample, prompt logprobs): the workers receive its ``rows``
    hidden rows by broadcast and add their slices of the vocabulary to the gather (``fast``: the projection
    kernel, as rank 0 runs it)."""

    rows: int
    fast: bool


@dataclass(frozen=True)
class GapTrace:
    """Start recording the GPU time between this worker's graph replays (``path`` None), or stop and write what
    was recorded as JSON to ``path`` with ``{rank}`` replaced by the worker's rank (benchmarks): a message of its
    own, never part of a step's."""

    path: str | None


@dataclass(frozen=True)
class StepMessage:
    kv_shape: tuple[int, ...] | None          # rank 0's pages [P + 1, L, 2, block, Hkv_local, D]: the same here
    batch: ForwardBatch | None = None         # a forward (on the CPU, ``lora`` None)
    lora: Segments = ()                       # torch path: the LoRA passes by adapter name
    kernel_lora: LoRABatch | None = None      # Triton path: the kernels' metadata (no segments, no buffer)
    replay: Replay | None = None              # a decode iteration from the graphs
    graphs: GraphSetup | None = None          # build or capture decode graphs
    adapters: dict[str, PackedAdapter] = dataclasses.field(default_factory=dict)   # new to the workers (whole)
    placed: dict[str, tuple[int, int] | None] = dataclasses.field(default_factory=dict)   # name -> (epoch, first
    #                                           element in the pool) of each adapter loaded since; None: evicted
    dropped: tuple[str, ...] = ()             # adapters the engine no longer has
    merged: str | None = None                 # the adapter folded into the base weights (each rank: its slices)
    swaps: tuple[tuple[str, int, int], ...] = ()   # FastLibra's KV copies since the last message, in order:
    #                                           ("out", page, host slot) or ("in", page, host slot)
    host_slots: int = 0                       # the host slots the swaps address (each rank: its slices)


def tensors_to(obj, fn):
    """``obj`` with every tensor inside (dataclasses, tuples, lists, dicts) replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_to(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: tensors_to(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: tensors_to(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def passes(lora: LoRABatch | None) -> list[LoRABatch]:
    """The LoRA batch and its further passes (mixed mode), in order."""
    out = []
    while lora is not None:
        out.append(lora)
        lora = lora.extra
    return out


def by_name(segments) -> tuple[tuple[int, int, str, float], ...]:
    return tuple((s.start, s.end, s.adapter.name, s.scale) for s in segments)


def segments_of(named, part) -> tuple[LoRASegment, ...]:
    """Named segments with each adapter ``part(name)`` (this rank's slices)."""
    return tuple(LoRASegment(s, e, part(n), sc) for s, e, n, sc in named)


def lora_of(named_passes: Segments, part) -> LoRABatch | None:
    """The torch path's LoRA batch of named passes; passes after the first become ``extra``."""
    batch = None
    for segs in reversed(named_passes):
        batch = LoRABatch(segments_of(segs, part), extra=batch)
    return batch


def strip(lora: LoRABatch | None) -> LoRABatch | None:
    """A kernel batch without what the workers have their own of: the segments' adapters, the pool buffer."""
    if lora is None:
        return None
    return dataclasses.replace(lora, segments=(), buffer=None, extra=strip(lora.extra))


def with_buffer(lora: LoRABatch | None, buf: torch.Tensor) -> LoRABatch | None:
    if lora is None:
        return None
    return dataclasses.replace(lora, buffer=buf, extra=with_buffer(lora.extra, buf))
