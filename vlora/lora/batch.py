"""Per-iteration LoRA batch information and the packed adapter weights it points to.

Projections are packed the way the decoder computes them: one ``qkv`` matmul,
one ``o``, one ``gate_up``, one ``down``. An adapter's weights for one layer and
one packed group are a :class:`GroupWeights`: the A matrices of the group's
slices concatenated along the rank (one shrink matmul) and one B per slice
(one expand per slice, written into that slice's columns of the output).
Each adapter keeps its own rank; nothing is padded to the largest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# packed group -> the PEFT module names it holds, in output-column order
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class SliceB:
    col_start: int                    # first output column of this slice in the packed output
    rank_start: int                   # first column of this slice's A inside GroupWeights.a
    b: torch.Tensor                   # [r, out_slice]


@dataclass(frozen=True)
class GroupWeights:
    a: torch.Tensor                   # [in, r * n_slices_present], A of each present slice side by side
    slices: tuple[SliceB, ...]        # present slices only (an adapter may target q and v but not k)


@dataclass(frozen=True)
class PackedAdapter:
    """One adapter, laid out for the batched LoRA op."""

    slot: int                         # dense id used by kernels (0..num_adapters-1)
    name: str
    rank: int
    scaling: float
    layers: tuple[dict[str, GroupWeights], ...]  # [num_layers] group name -> weights (absent = untouched)

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


@dataclass(frozen=True)
class LoRABatch:
    """Which token rows use which adapter in this iteration.

    Rows not covered by any segment run on the base model only. Segments are
    disjoint, sorted by ``start``, and consecutive rows of one adapter form one
    segment (the runner orders sequences by adapter to make segments long).
    """

    segments: tuple[LoRASegment, ...]
    seg_starts: torch.Tensor          # [S] int32 on the compute device: first row of each segment
    seg_ends: torch.Tensor            # [S] int32: end row (exclusive); rows between segments are base-only
    seg_slots: torch.Tensor           # [S] int32: adapter slot of each segment
    seg_ranks: torch.Tensor           # [S] int32
    seg_scalings: torch.Tensor        # [S] float32

    @staticmethod
    def build(runs: list[tuple[int, int, PackedAdapter | None]], device: torch.device) -> "LoRABatch | None":
        """From (start, end, adapter-or-None) row runs, merge neighbours and drop base-model runs."""
        segs: list[LoRASegment] = []
        for start, end, adapter in runs:
            if adapter is None or end <= start:
                continue
            if segs and segs[-1].adapter is adapter and segs[-1].end == start:
                segs[-1] = LoRASegment(segs[-1].start, end, adapter)
            else:
                segs.append(LoRASegment(start, end, adapter))
        if not segs:
            return None
        return LoRABatch(
            segments=tuple(segs),
            seg_starts=torch.tensor([s.start for s in segs], dtype=torch.int32, device=device),
            seg_ends=torch.tensor([s.end for s in segs], dtype=torch.int32, device=device),
            seg_slots=torch.tensor([s.adapter.slot for s in segs], dtype=torch.int32, device=device),
            seg_ranks=torch.tensor([s.adapter.rank for s in segs], dtype=torch.int32, device=device),
            seg_scalings=torch.tensor([s.adapter.scaling for s in segs], dtype=torch.float32, device=device),
        )
