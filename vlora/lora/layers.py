"""The one entry point for LoRA math in a forward pass.

``lora_linear`` runs a packed projection and adds the iteration's batched LoRA
delta to its output: the Triton ATMM kernels when the batch carries device
metadata (CUDA), the torch reference :func:`lora_add_` otherwise (CPU; also the
oracle the kernel path is tested against).

On CUDA the LoRA kernels read only ``x`` and the adapter pool, so they need not
wait for the base projection: they run on a side stream while it runs, and
the main stream waits for them only where their result is added. Both are
bound by memory bandwidth, and a decode step's small LoRA launches otherwise
pay their launch, ramp-up and tail latency one after another, 8 per layer.
Three modes (``LoRAConfig.lora_overlap``, carried by the batch as ``launch.overlap``):

* ``shrink``: ``v = x·A`` on the side stream, the expand ``y += s·v·B`` after
  the projection on the main stream;
* ``full`` (default): shrink and expand into a zeroed delta buffer on the side
  stream, then one add ``y += delta`` on the main stream;
* ``off``: both after the projection, on the main stream.

Mixed mode (the merged adapter subtracted from the rows of the others) runs
in the same shrink and expand: each such segment carries the merged adapter as
its second pair (``LoRASegment.pair``, ``kernels/atmm.py``). A batch may
still carry a second pass (``LoRABatch.extra``: mixed mode in two launches,
``LoRALaunch.mixed="two"``); that pass shrinks on a second side stream,
beside the first pass's shrink, with its own split-K counters, and its expand
follows the first's on the side stream (docs/decisions.md, 'Mixed mode in one
launch').

Every tensor the side stream touches is allocated on the main stream before the
fork and kept alive past the join, so the caching allocator (and CUDA-graph
capture) never sees a cross-stream free.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlora.lora.batch import LoRABatch

OVERLAP_MODES = ("off", "shrink", "full")
_side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, lane: int = 0) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, lane) not in _side_streams:
        _side_streams[(index, lane)] = torch.cuda.Stream(device=index)
    return _side_streams[(index, lane)]


def lora_linear(x: torch.Tensor, proj: nn.Linear, lora: LoRABatch | None, layer: int, group: str,
                linear: Callable = F.linear) -> torch.Tensor:
    """``linear(x, proj.weight, proj.bias)`` plus, on the rows of every segment, ``scaling * (x @ A) @ B`` of the
    segment's adapter.

    Shape: x [T, in]; the projection's output [T, out_packed] (a fresh tensor: the delta is added in place).
    """
    if lora is None or lora.kernel is None or not x.is_cuda or lora.launch.overlap == "off":
        return add_lora(linear(x, proj.weight, proj.bias), x, lora, layer, group)
    from vlora.kernels.atmm import shrink_output

    overlap = lora.launch.overlap
    passes = []
    while lora is not None:                                 # the batch, then its second pass (mixed mode)
        passes.append(lora)
        lora = lora.extra
    passes = [p for p in passes if p.meta.max_len > 0]
    if not passes:
        return linear(x, proj.weight, proj.bias)
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    # allocated on the main stream (see the module doc)
    vs = [shrink_output(x, p.kernel[group].r_max, p.kernel[group].shrink_cfg) for p in passes]
    delta = None
    if overlap == "full":
        k0 = passes[0].kernel[group]
        delta = torch.zeros(x.shape[0], sum(k0.widths), dtype=x.dtype, device=x.device)
    side.wait_stream(main)
    second = None
    if len(passes) > 1:             # mixed mode: the second pass's shrink runs beside the first's
        second = _side_stream(x.device, 1)
        second.wait_stream(main)
        with torch.cuda.stream(second):
            vs[1] = _shrink(x, passes[1], layer, group, vs[1], lane=1)
    with torch.cuda.stream(side):
        vs[0] = _shrink(x, passes[0], layer, group, vs[0])      # the planes each hands over
        if second is not None:
            side.wait_stream(second)
        if delta is not None:
            for p, v in zip(passes, vs):
                _expand(delta, v, p, layer, group)
    y = linear(x, proj.weight, proj.bias)
    main.wait_stream(side)
    if delta is not None:
        y += delta
    else:
        for p, v in zip(passes, vs):
            _expand(y, v, p, layer, group)
    return y


def _shrink(x: torch.Tensor, lora: LoRABatch, layer: int, group: str, out: torch.Tensor | None = None,
            lane: int = 0):
    from vlora.kernels.atmm import lora_shrink

    k = lora.kernel[group]
    pair = None if k.pair is None else (k.pair.a_off[layer], k.pair.rtot[layer])
    # the adapter buffer aligns every A and B to 16 elements, and ranks are >= 8
    return lora_shrink(x, lora.buffer, k.a_off[layer], k.rtot[layer], lora.meta, k.r_max, k.shrink_cfg,
                       out=out, aligned=True, lane=lane, pdl=lora.launch.pdl, pair=pair)


def _expand(y: torch.Tensor, v: torch.Tensor, lora: LoRABatch, layer: int, group: str) -> None:
    from vlora.kernels.atmm import lora_expand

    k = lora.kernel[group]
    pair = None if k.pair is None else (k.pair.b_off[layer], k.pair.vcol[layer], k.rtot[layer])
    lora_expand(y, v, lora.buffer, k.b_off[layer], k.vcol[layer], k.widths, lora.meta, k.expand_cfg,
                aligned=True, max_rank=k.rank_bound, pdl=lora.launch.pdl, pair=pair)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora: LoRABatch | None, layer: int, group: str) -> torch.Tensor:
    """y[rows of segment] += scaling * (x @ A) @ B for every segment's adapter; returns y.

    Shape: x [T, in]; y [T, out_packed] (the base projection's output, updated in place).
    """
    while lora is not None:                 # the batch, then its second pass (mixed mode), if any
        if lora.kernel is None:
            lora_add_(y, x, lora, layer, group)
        else:
            _expand(y, _shrink(x, lora, layer, group), lora, layer, group)
        lora = lora.extra
    return y


def lora_add_(y: torch.Tensor, x: torch.Tensor, lora: LoRABatch, layer: int, group: str) -> None:
    """Batched LoRA delta, in place, for one layer and one packed projection group.

    Semantics: for each segment (rows [s, e), adapter i) and each slice j of the group:
        y[s:e, cols_j] += scale_s * (x[s:e] @ A_ij) @ B_ij   (scale_s: the segment's, usually s_i)
    Shape: x [T, in], y [T, out_packed]; A_ij [in, r_i]; B_ij [r_i, out_j].
    Tokens are grouped by adapter; each adapter runs at its own rank (no padding). A segment's second adapter
    (``seg.pair``, mixed mode) adds its own delta the same way, at ``seg.pair_scale``.
    """
    for seg in lora.segments:
        for adapter, scale in ((seg.adapter, seg.scale), (seg.pair, seg.pair_scale)):
            gw = None if adapter is None else adapter.layers[layer].get(group)
            if gw is None:
                continue
            r = adapter.rank
            v = x[seg.start:seg.end] @ gw.a                       # shrink: [n, r * slices]
            rows = y[seg.start:seg.end]
            for sl in gw.slices:                                  # expand, scaling fused via alpha
                out = rows[:, sl.col_start:sl.col_start + sl.b.shape[1]]
                out.addmm_(v[:, sl.rank_start:sl.rank_start + r], sl.b, alpha=scale)
