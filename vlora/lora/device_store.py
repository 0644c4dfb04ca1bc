"""Adapters in one flat device buffer, addressed by offsets (the kernel path of the LoRA op).

Every registered adapter is written once into ``AdapterBuffer.buf``; the ATMM
kernels read each adapter where it sits, so an iteration never copies adapter
weights. The unified memory pool takes over this buffer's role later (pages
instead of first-fit ranges); the offsets interface stays.
"""

from __future__ import annotations

import torch

from vlora.lora.batch import (GROUPS, GroupOffsets, KernelGroupMeta, LoRABatch, LoRASegment, PackedAdapter,
                              SegmentMeta)


ALIGN = 16        # elements: every A and B starts on a 16-element boundary (vectorised kernel loads)


def _padded(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    pad = -flat.numel() % ALIGN
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


class AdapterBuffer:
    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 1 << 20):
        self.buf = torch.zeros(capacity, dtype=dtype, device=device)
        self._free: list[tuple[int, int]] = [(0, capacity)]       # (offset, size), sorted by offset
        self._owned: dict[str, tuple[int, int]] = {}

    def _alloc(self, n: int) -> int:
        n = -(-n // ALIGN) * ALIGN
        for i, (off, size) in enumerate(self._free):
            if size >= n:
                self._free[i:i + 1] = [(off + n, size - n)] if size > n else []
                return off
        old = self.buf.numel()                                     # grow: offsets stay valid
        new = max(2 * old, old + n)
        grown = torch.zeros(new, dtype=self.buf.dtype, device=self.buf.device)
        grown[:old] = self.buf
        self.buf = grown
        tail = self._free.pop() if self._free and sum(self._free[-1]) == old else (old, 0)
        self._free.append((tail[0], tail[1] + new - old))
        return self._alloc(n)

    def free(self, name: str) -> None:
        off, n = self._owned.pop(name)
        self._free.append((off, n))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self._free:
            if merged and sum(merged[-1]) == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._free = merged

    def write(self, adapter: PackedAdapter) -> dict[str, GroupOffsets]:
        """Copy the adapter into the buffer; returns its per-group offsets."""
        parts: list[torch.Tensor] = []
        for groups in adapter.layers:
            for name in GROUPS:
                gw = groups.get(name)
                if gw is not None:
                    parts.append(_padded(gw.a.T))
                    parts.extend(_padded(s.b) for s in gw.slices)
        total = sum(p.numel() for p in parts)
        base = self._alloc(max(total, 1))
        self._owned[adapter.name] = (base, -(-max(total, 1) // ALIGN) * ALIGN)
        if total:
            self.buf[base:base + total] = torch.cat(parts).to(self.buf)
        offsets: dict[str, list] = {g: ([], [], [], []) for g in GROUPS}
        pos = base
        r = adapter.rank
        for groups in adapter.layers:
            for name, modules in GROUPS.items():
                a_off, rtot, b_off, vcol = offsets[name]
                gw = groups.get(name)
                if gw is None:
                    a_off.append(0), rtot.append(0)
                    b_off.append([-1] * len(modules)), vcol.append([0] * len(modules))
                    continue
                a_off.append(pos), rtot.append(gw.a.shape[1])
                pos += -(-gw.a.numel() // ALIGN) * ALIGN
                row_b, row_v = [-1] * len(modules), [0] * len(modules)
                for sl in gw.slices:
                    row_b[sl.index], row_v[sl.index] = pos, sl.rank_start
                    pos += -(-sl.b.numel() // ALIGN) * ALIGN
                b_off.append(row_b), vcol.append(row_v)
        dev = self.buf.device
        return {g: GroupOffsets(torch.tensor(a, dtype=torch.int64, device=dev),
                                torch.tensor(rt, dtype=torch.int32, device=dev),
                                torch.tensor(b, dtype=torch.int64, device=dev),
                                torch.tensor(v, dtype=torch.int32, device=dev))
                for g, (a, rt, b, v) in offsets.items()}


def build_kernel_batch(segs: list[LoRASegment], buffer: AdapterBuffer, widths: dict[str, tuple[int, ...]],
                       in_features: dict[str, int], table, device: torch.device) -> LoRABatch:
    """Segment metadata + per-group offset tables, once per iteration, for every layer's kernels."""
    lens = [s.end - s.start for s in segs]
    meta = SegmentMeta(
        starts=torch.tensor([s.start for s in segs], dtype=torch.int32, device=device),
        lens=torch.tensor(lens, dtype=torch.int32, device=device),
        ranks=torch.tensor([s.adapter.rank for s in segs], dtype=torch.int32, device=device),
        scales=torch.tensor([s.scale for s in segs], dtype=torch.float32, device=device),
        max_len=max(lens), num_rows=sum(lens))
    r_max_rank = max(s.adapter.rank for s in segs)
    kernel = {}
    for g in GROUPS:
        offs = [s.adapter.offsets[g] for s in segs]
        r_max = len(GROUPS[g]) * r_max_rank
        kernel[g] = KernelGroupMeta(
            a_off=torch.stack([o.a_off for o in offs], dim=1), rtot=torch.stack([o.rtot for o in offs], dim=1),
            b_off=torch.stack([o.b_off for o in offs], dim=1), vcol=torch.stack([o.vcol for o in offs], dim=1),
            r_max=r_max, widths=widths[g],
            shrink_cfg=table.get("shrink", meta.num_rows, len(segs), in_features[g], r_max),
            expand_cfg=table.get("expand", meta.num_rows, len(segs), sum(widths[g]), r_max_rank))
    return LoRABatch(tuple(segs), meta, kernel, buffer.buf)
