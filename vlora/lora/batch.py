"""Per-iteration LoRA batch information and the packed adapter weights it points to.

Projections are packed the way the decoder computes them: one ``qkv`` matmul,
one ``o``, one ``gate_up``, one ``down``. An adapter's weights for one layer and
one packed group are a :class:`GroupWeights`: the A matrices of the group's
slices concatenated along the rank (one shrink matmul) and one B per slice
(one expand per slice, written into that slice's columns of the output).
Each adapter keeps its own rank; nothing is padded to the largest rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlora.kernels.segments import SegmentMeta

# packed group -> the PEFT module names it holds, in output-column order
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class SliceB:
    index: int                        # position of the slice in its group (q=0, k=1, v=2)
    col_start: int                    # first output column of this slice in the packed output
    rank_start: int                   # first column of this slice's A inside GroupWeights.a
    b: torch.Tensor                   # [r, out_slice]


@dataclass(frozen=True)
class GroupWeights:
    a: torch.Tensor                   # [in, r * n_slices_present], A of each present slice side by side
    slices: tuple[SliceB, ...]        # present slices only (an adapter may target q and v but not k)


@dataclass(frozen=True)
class GroupOffsets:
    """Where one adapter's weights of one packed group sit in the flat device buffer (kernel path)."""

    a_off: torch.Tensor               # [L] int64: A of the present slices, stacked [R, in] (R = n_present * r)
    rtot: torch.Tensor                # [L] int32: R (0 = the adapter skips this group in this layer)
    b_off: torch.Tensor               # [L, NS] int64: B of slice j, [r, width_j]; -1 = slice absent
    vcol: torch.Tensor                # [L, NS] int32: first column of slice j's part of x @ A^T


@dataclass(eq=False)
class Placement:
    """Where an adapter sits in the unified pool now (kernel path); changes as it is loaded and evicted."""

    offsets: dict[str, GroupOffsets] | None = None   # None: not resident
    epoch: int = 0                                   # bumped at every load, so cached offsets can tell
    ready: object = None                             # CUDA event: its copy into the pool is done
    host: dict | None = None                         # the offsets as host lists: group -> (a_off, rtot, b_off, vcol)


@dataclass(frozen=True)
class PackedAdapter:
    """One adapter, laid out for the batched LoRA op."""

    slot: int                         # dense id used by kernels (0..num_adapters-1)
    name: str
    rank: int
    scaling: float
    layers: tuple[dict[str, GroupWeights], ...]  # [num_layers] group name -> weights (absent = untouched)
    placement: Placement = field(default_factory=Placement, compare=False)   # in the pool or not

    @property
    def offsets(self) -> dict[str, GroupOffsets] | None:
        return self.placement.offsets

    def num_bytes(self) -> int:
        total = 0
        for groups in self.layers:
            for gw in groups.values():
                total += gw.a.numel() * gw.a.element_size()
                total += sum(s.b.numel() * s.b.element_size() for s in gw.slices)
        return total


@dataclass(frozen=True)
class LoRASegment:
    start: int                        # first token row (inclusive)
    end: int                          # last token row (exclusive)
    adapter: PackedAdapter            # adapter applied to rows [start, end)
    scale: float                      # usually adapter.scaling; negative to subtract (deLoRA)
    pair: PackedAdapter | None = None     # a second adapter on the same rows, in the same launch (mixed mode:
    pair_scale: float = 0.0               # the merged adapter, with its negative scaling)


@dataclass(frozen=True)
class KernelGroupMeta:
    """One packed group's per-iteration kernel arguments: per-layer rows of segment offsets."""

    a_off: torch.Tensor               # [L, S] int64
    rtot: torch.Tensor                # [L, S] int32
    b_off: torch.Tensor               # [L, S, NS] int64
    vcol: torch.Tensor                # [L, S, NS] int32
    r_max: int                        # largest R over the segments
    widths: tuple[int, ...]           # output width of each slice
    shrink_cfg: object                # TileConfig chosen from the tuning table for this iteration
    expand_cfg: object
    pair: GroupOffsets | None = None  # the segments' second adapters: a_off/rtot [L, S], b_off/vcol [L, S, NS]
    #                                   (r_max then covers both: the second adapter's columns of v follow the first's)
    max_rank: int | None = None       # largest adapter rank of either adapter (None: r_max // slices)

    @property
    def rank_bound(self) -> int:
        return self.max_rank if self.max_rank is not None else self.r_max // len(self.widths)


@dataclass(frozen=True)
class LoRALaunch:
    """How the LoRA kernels are launched (``LoRAConfig.lora_overlap`` and ``lora_pdl``; see ``lora/layers.py``
    and ``kernels/atmm.py``): carried by every batch, so the engine's configuration is what runs."""

    overlap: str = "full"             # off, shrink or full
    pdl: bool = True                  # expand as a programmatic dependent of its shrink (where the GPU can)
    mixed: str = "one"                # mixed mode: "one" launch (segments paired with the merged adapter) or
    #                                   "two" (a second pass, LoRABatch.extra); the same sums, rounded apart


@dataclass(frozen=True)
class LoRABatch:
    """Which token rows use which adapter in this iteration.

    Rows not covered by any segment run on the base model only. Segments are
    disjoint, sorted by ``start``, and consecutive rows of one adapter form one
    segment (the runner orders sequences by adapter to make segments long).
    ``kernel`` carries the device metadata of the Triton path (None on CPU).
    """

    segments: tuple[LoRASegment, ...]
    meta: SegmentMeta | None = None
    kernel: dict[str, KernelGroupMeta] | None = None
    buffer: torch.Tensor | None = None   # the flat adapter weight buffer the offsets point into
    extra: "LoRABatch | None" = None     # a second pass over the same rows (mixed mode in two launches)
    launch: LoRALaunch = LoRALaunch()

    @staticmethod
    def segments_of(runs: list[tuple[int, int, PackedAdapter | None]],
                    scale: float | None = None) -> list[LoRASegment]:
        """From (start, end, adapter-or-None) row runs, merge neighbours and drop base-model runs.

        ``scale`` overrides every adapter's own scaling (e.g. its negative, to subtract it)."""
        segs: list[LoRASegment] = []
        for start, end, adapter in runs:
            if adapter is None or end <= start:
                continue
            _append(segs, LoRASegment(start, end, adapter, adapter.scaling if scale is None else scale))
        return segs

    @staticmethod
    def mixed_segments_of(runs: list[tuple[int, int, PackedAdapter | None]],
                          merged: PackedAdapter) -> list[LoRASegment]:
        """Segments of a mixed iteration in one launch: rows of ``merged`` get none; rows of another adapter X
        get (X, s_X) paired with (merged, -s_merged); base-model rows get (merged, -s_merged) alone."""
        segs: list[LoRASegment] = []
        minus = -merged.scaling
        for start, end, adapter in runs:
            if adapter is merged or end <= start:
                continue
            seg = (LoRASegment(start, end, merged, minus) if adapter is None
                   else LoRASegment(start, end, adapter, adapter.scaling, merged, minus))
            _append(segs, seg)
        return segs


def _append(segs: list[LoRASegment], seg: LoRASegment) -> None:
    """Add ``seg``, extending the last segment instead where it continues it (same adapters and scales)."""
    last = segs[-1] if segs else None
    if (last is not None and last.end == seg.start and last.adapter is seg.adapter and last.scale == seg.scale
            and last.pair is seg.pair and last.pair_scale == seg.pair_scale):
        segs[-1] = LoRASegment(last.start, seg.end, seg.adapter, seg.scale, seg.pair, seg.pair_scale)
    else:
        segs.append(seg)
