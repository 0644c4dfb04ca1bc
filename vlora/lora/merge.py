"""Swift, exact merge/unmerge of one adapter into the base weights (V-LoRA §4.4.1).

The decoder keeps each packed projection of all layers in one tensor
``[L, out, in]`` (the layers' weights are views of it), so a merge is one
batched ``ΔW = s·(A·B)^T`` per projection slice over all layers, added in place;
no per-layer loop of small launches and no copy of the model. Layers are
processed in chunks only to bound the float32 temporaries.

Exactness. ``W' = round(W + ΔW)`` loses information, so ``round(W' - ΔW)`` is
not always ``W``. At merge time we record, per element, how far the naive
restore would land from ``W`` in units in the last place (the difference of the
order-preserving integer images of the two floats): 2 bits per element for
{-1, 0, +1} (nearly all elements) and an exception list (flat index, original
bits) for the rest. Unmerge recomputes the identical ΔW (same op, same shapes),
applies the naive restore, then the codes: the base weights come back bit for
bit, after any number of cycles. Cost: 1/8 of the touched weights' bytes for the
codes plus 12 bytes per exception, held only while the adapter is merged.

On CUDA (or with ``kernel=True``) the same idea runs fused in one Triton launch
per slice (``vlora.kernels.merge``): ΔW tile on the tensor cores, weights read
and written once, 4-bit codes covering [-7, 6] units (far fewer exceptions),
the first exception of every tile row kept in its slot by the kernel, the
rest merged and listed by two small kernels after it. A record remembers
which path made it, and unmerge takes the same path, so ΔW is recomputed
identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlora.lora.batch import PackedAdapter

_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_EXC = 3                     # 2-bit code reserved for "see the exception list"


@dataclass
class MergeRecord:
    """What unmerging needs: the adapter's stacked factors, its scale, and the restore codes."""

    adapter: PackedAdapter
    scale: float
    factors: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    codes: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)      # uint8, 4 codes a byte
    exc_index: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # int64 flat indices
    exc_bits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)   # original bit patterns
    kernel: bool = False              # made by the fused Triton path (its records in ``slices``)
    slices: dict = field(default_factory=dict)   # (group, j) -> vlora.kernels.merge.SliceRestore (with its tile:
    #                                              unmerge recomputes ΔW with the same one)
    reused: bool = False              # this merge reused an earlier record of the adapter (wrote only the weights)
    base: tuple | None = None         # the weights' identity and version counters after the unmerge (reuse check)

    def restore_bytes(self) -> int:
        """Memory held to make the unmerge exact (codes + exceptions)."""
        tensors = [*self.codes.values(), *self.exc_index.values(), *self.exc_bits.values()]
        tensors += [t for sr in self.slices.values() for t in sr.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def num_exceptions(self) -> int:
        """Elements whose original bits are kept (the rest are restored from ΔW and their code)."""
        n = sum(t.numel() for t in self.exc_index.values())
        return n + sum(sr.exc_index.numel() for sr in self.slices.values())


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """Float bit patterns -> int64 in the same order as the floats (+0 and -0 distinct)."""
    b = bits.to(torch.int64)
    magnitude = (1 << (bits.element_size() * 8 - 1)) - 1
    return torch.where(b >= 0, b, -(b & magnitude) - 1)


def _unordered(o: torch.Tensor, int_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``_ordered`` back to the signed integer view of the float."""
    nbits = torch.iinfo(int_dtype).bits
    b = torch.where(o >= 0, o, (-(o + 1)) - (1 << (nbits - 1)))    # two's complement of sign|magnitude
    return b.to(int_dtype)


def _pack2(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 4)]).view(-1, 4)
    return flat[:, 0] | (flat[:, 1] << 2) | (flat[:, 2] << 4) | (flat[:, 3] << 6)


def _unpack2(packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    lo, hi = start // 4, -(-stop // 4)
    parts = torch.stack([(packed[lo:hi] >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)
    return parts[start - 4 * lo:stop - 4 * lo]


def _factors(adapter: PackedAdapter, group: str, j: int, num_layers: int, in_features: int, out_j: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Slice j's A and B of every layer, stacked as float32 (zeros where a layer lacks the slice)."""
    r = adapter.rank
    a = torch.zeros(num_layers, in_features, r)
    b = torch.zeros(num_layers, r, out_j)
    found = False
    for layer, groups in enumerate(adapter.layers):         # host-side gather of a few MB, no launches
        gw = groups.get(group)
        sl = next((x for x in gw.slices if x.index == j), None) if gw is not None else None
        if sl is not None:
            a[layer] = gw.a[:, sl.rank_start:sl.rank_start + r].float().cpu()
            b[layer] = sl.b.float().cpu()
            found = True
    return (a.to(device), b.to(device)) if found else None


def _slices(weights: dict[str, torch.Tensor], widths: dict[str, tuple[int, ...]]):
    for group, w in weights.items():
        start = 0
        for j, width in enumerate(widths[group]):
            yield group, j, w[:, start:start + width, :]
            start += width


def _chunks(num_layers: int, per_layer_elems: int, budget_elems: int) -> list[range]:
    step = max(1, budget_elems // max(1, per_layer_elems))
    return [range(i, min(i + step, num_layers)) for i in range(0, num_layers, step)]


def _delta(factors, layers: range, scale: float) -> torch.Tensor:
    a, b = factors                                              # [L, in, r], [L, r, out_j]
    sl = slice(layers.start, layers.stop)
    return torch.bmm(b[sl].transpose(1, 2), a[sl].transpose(1, 2)).mul_(scale)   # [n, out_j, in]


def _use_kernel(weights: dict[str, torch.Tensor], kernel: bool | None) -> bool:
    if kernel is not None:
        return kernel
    return next(iter(weights.values())).is_cuda


@torch.no_grad()
def merge_(weights: dict[str, torch.Tensor], widths: dict[str, tuple[int, ...]], adapter: PackedAdapter,
           scale: float | None = None, chunk_elems: int = 1 << 26, kernel: bool | None = None,
           staged: dict | None = None, reuse: MergeRecord | None = None) -> MergeRecord:
    """W += s·(A·B)^T for every targeted slice of every layer, in place; returns the restore record.

    weights: group -> [L, out_packed, in] base weights; widths: group -> output width of each slice.
    kernel: the fused Triton path (default: on CUDA); staged: this adapter's :func:`stage_factors`, if kept from before. reuse: the record of an earlier merge of this adapter,
    unmerged since. A restore record depends only on the base weights, the adapter and the scale, so when those
    are unchanged (:func:`can_reuse`) the merge writes the weights alone and returns ``reuse`` again (fused path
    only; otherwise ``reuse`` is ignored).
    """
    rec = MergeRecord(adapter, adapter.scaling if scale is None else scale, kernel=_use_kernel(weights, kernel))
    if rec.kernel:
        if reuse is not None and can_reuse(reuse, weights, adapter, rec.scale):
            reuse.factors = {}
            _merge_fused(reuse, weights, widths, staged, reuse=reuse)
            reuse.reused, reuse.base = True, None
            return reuse
        _merge_fused(rec, weights, widths, staged)
        return rec
    for group, j, w in _slices(weights, widths):
        f = _factors(adapter, group, j, w.shape[0], w.shape[2], w.shape[1], w.device)
        if f is None:
            continue
        rec.factors[(group, j)] = f
        int_dtype = _INT[w.dtype]
        per_layer = w.shape[1] * w.shape[2]
        codes, exc_i, exc_b = [], [], []
        for layers in _chunks(w.shape[0], per_layer, chunk_elems):
            d = _delta(f, layers, rec.scale)
            wc = w[layers.start:layers.stop]
            merged = (wc.float() + d).to(w.dtype)
            naive = (merged.float() - d).to(w.dtype)
            c = _ordered(wc.view(int_dtype)) - _ordered(naive.view(int_dtype))
            exc = c.abs() > 1
            idx = exc.reshape(-1).nonzero().squeeze(1)
            exc_i.append(idx + layers.start * per_layer)
            exc_b.append(wc.reshape(-1).view(int_dtype)[idx])
            codes.append(torch.where(exc, _EXC, c + 1).reshape(-1).to(torch.uint8))
            wc.copy_(merged)
        rec.codes[(group, j)] = _pack2(torch.cat(codes))
        rec.exc_index[(group, j)] = torch.cat(exc_i)
        rec.exc_bits[(group, j)] = torch.cat(exc_b)
    return rec


def stage_factors(adapter: PackedAdapter, weights: dict[str, torch.Tensor],
                  widths: dict[str, tuple[int, ...]]) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
    """The fused path's inputs: every targeted slice's A [L, in, r] and B [L, r, out] on the weights' device and
    in their dtype (lossless in the engine, whose adapters are in the model dtype). Staging them once lets
    later merges of the same adapter skip the host gather and the copy."""
    staged = {}
    for group, w in weights.items():
        for j, width in enumerate(widths[group]):
            f = _factors(adapter, group, j, w.shape[0], w.shape[2], width, w.device)
            if f is not None:
                staged[(group, j)] = (f[0].to(w.dtype), f[1].to(w.dtype))
    return staged


def stage_from_pool(adapter: PackedAdapter, buf: torch.Tensor, weights: dict[str, torch.Tensor],
                    widths: dict[str, tuple[int, ...]]) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] | None:
    """:func:`stage_factors` from where the adapter sits in the unified pool ``buf`` (on the weights' device, in
    their dtype): one strided copy per factor and slice, no host gather and no host-to-device copy, which on a
    large model would cost more than the merge itself (docs/decisions.md, 'Merge factors staged from the pool').
    None when the adapter is not in the pool. The results are copies: the pool's pages may be reused while the
    adapter stays merged."""
    host = adapter.placement.host
    if adapter.offsets is None or host is None or buf.dtype != next(iter(weights.values())).dtype:
        return None
    if adapter.placement.ready is not None:          # its copy into the pool may still be in flight
        torch.cuda.current_stream(buf.device).wait_event(adapter.placement.ready)
    staged = {}
    for group, w in weights.items():
        L, inn = w.shape[0], w.shape[2]
        a_off, rtot, b_off, vcol = host[group]
        for j, width in enumerate(widths[group]):
            present = [l for l in range(L) if rtot[l] and b_off[l][j] >= 0]
            if not present:
                continue
            r = adapter.rank
            a = torch.zeros(L, inn, r, dtype=buf.dtype, device=buf.device)
            b = torch.zeros(L, r, width, dtype=buf.dtype, device=buf.device)
            starts_a = [a_off[l] + vcol[l][j] * inn for l in present]
            starts_b = [b_off[l][j] for l in present]
            if len(present) == L and _uniform(starts_a) and _uniform(starts_b):     # one strided view each
                step_a = starts_a[1] - starts_a[0] if L > 1 else r * inn
                step_b = starts_b[1] - starts_b[0] if L > 1 else r * width
                base = buf.storage_offset()                       # as_strided takes storage offsets
                a.copy_(buf.as_strided((L, r, inn), (step_a, inn, 1), base + starts_a[0]).transpose(1, 2))
                b.copy_(buf.as_strided((L, r, width), (step_b, width, 1), base + starts_b[0]))
            else:
                for l, sa, sb in zip(present, starts_a, starts_b):
                    a[l].copy_(buf[sa:sa + r * inn].view(r, inn).T)
                    b[l].copy_(buf[sb:sb + r * width].view(r, width))
            staged[(group, j)] = (a, b)
    return staged


def _fingerprint(weights: dict[str, torch.Tensor]) -> tuple:
    """Which tensors the weights are and how often torch wrote them in place (Triton's writes are not counted,
    so it is taken after an unmerge's last, torch-side, write)."""
    return tuple((g, w.data_ptr(), w._version) for g, w in weights.items())


def can_reuse(rec: MergeRecord, weights: dict[str, torch.Tensor], adapter: PackedAdapter, scale: float) -> bool:
    """Whether merging ``adapter`` at ``scale`` into ``weights`` may reuse ``rec``: the fused path's record of
    the same adapter and scale, unmerged since (exactly: the weights are the ones it restored), with no write
    to them through torch after that."""
    return rec.kernel and rec.adapter is adapter and rec.scale == scale and rec.base == _fingerprint(weights)


def _uniform(starts: list[int]) -> bool:
    return len({y - x for x, y in zip(starts, starts[1:])}) <= 1


_RECORD_STREAMS: dict = {}


def _record_stream(device: torch.device):
    """The side stream records are made on, of high priority: the block scheduler runs its small kernels as
    soon as blocks of the queued merge kernels finish, so each slice's record is made while the next slice's
    kernel runs. At normal priority they would wait for every merge kernel queued before them
    (docs/decisions.md, 'Restore records on a high-priority stream')."""
    key = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    if key not in _RECORD_STREAMS:
        _RECORD_STREAMS[key] = torch.cuda.Stream(key, priority=-100)    # mapped to the highest the GPU has
    return _RECORD_STREAMS[key]


def _merge_fused(rec: MergeRecord, weights, widths, staged=None, reuse: MergeRecord | None = None) -> None:
    """Queue every slice's kernel, then make the records (host gathers and syncs) on a high-priority side
    stream, each after its own kernel, so that they overlap the kernels of the slices after it; the caller's
    stream then waits for them."""
    from vlora.kernels import merge as kernels

    staged = staged if staged is not None else stage_factors(rec.adapter, weights, widths)
    launched = {}
    for group, w in weights.items():
        row0 = 0
        for j, width in enumerate(widths[group]):
            if (group, j) in staged:
                a, b = staged[(group, j)]
                rec.factors[(group, j)] = (a, b)
                if reuse is not None:                 # the same ΔW (same kernel tile) on the same base weights
                    kernels.merge_slice_(w, row0, a, b, rec.scale, tile=reuse.slices[(group, j)].tile,
                                         restore=False)
                else:
                    launched[(group, j)] = kernels.launch_merge_(w, row0, a, b, rec.scale)
            row0 += width
    if not launched:
        return
    w = next(iter(weights.values()))
    if not w.is_cuda:
        rec.slices.update({key: kernels.finish_merge(m) for key, m in launched.items()})
        return
    main, side = torch.cuda.current_stream(w.device), _record_stream(w.device)
    with torch.cuda.stream(side):                  # each waits for its kernel's event (queued after its inputs)
        rec.slices.update({key: kernels.finish_merge(m) for key, m in launched.items()})
    main.wait_stream(side)       # before ``launched`` (codes, slots: the caller's stream's memory) is dropped,
    #                              so the caller's next use of that memory comes after the side stream's reads
    for sr in rec.slices.values():                 # made on the side stream, used later on the caller's
        for t in sr.tensors():
            t.record_stream(main)


@torch.no_grad()
def unmerge_(weights: dict[str, torch.Tensor], widths: dict[str, tuple[int, ...]], rec: MergeRecord,
             chunk_elems: int = 1 << 26) -> None:
    """Undo ``merge_`` exactly: afterwards the weights are bitwise what they were before it."""
    if rec.kernel:
        _unmerge_fused(rec, weights, widths)
        rec.base = _fingerprint(weights)
        return
    for group, j, w in _slices(weights, widths):
        key = (group, j)
        if key not in rec.codes:
            continue
        int_dtype = _INT[w.dtype]
        per_layer = w.shape[1] * w.shape[2]
        for layers in _chunks(w.shape[0], per_layer, chunk_elems):
            wc = w[layers.start:layers.stop]
            naive = (wc.float() - _delta(rec.factors[key], layers, rec.scale)).to(w.dtype)
            c = _unpack2(rec.codes[key], layers.start * per_layer, layers.stop * per_layer)
            step = torch.where(c == _EXC, 0, c.to(torch.int64) - 1).view(wc.shape)
            wc.view(int_dtype).copy_(_unordered(_ordered(naive.view(int_dtype)) + step, int_dtype))
        idx = rec.exc_index[key]
        if idx.numel():                 # exceptions: the original bits, where two bits could not say
            l, rest = idx // per_layer, idx % per_layer
            w.view(int_dtype)[l, rest // w.shape[2], rest % w.shape[2]] = rec.exc_bits[key]


def _unmerge_fused(rec: MergeRecord, weights, widths) -> None:
    from vlora.kernels.merge import unmerge_slice_

    for group, w in weights.items():
        row0 = 0
        for j, width in enumerate(widths[group]):
            sr = rec.slices.get((group, j))
            if sr is not None:
                a, b = rec.factors[(group, j)]
                unmerge_slice_(w, row0, a, b, rec.scale, sr)
            row0 += width


def group_widths(q_size: int, kv_size: int, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {"qkv": (q_size, kv_size, kv_size), "o": (hidden,), "gate_up": (intermediate,) * 2,
            "down": (hidden,)}


