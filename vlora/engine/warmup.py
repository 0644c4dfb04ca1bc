"""Build every Triton kernel variant the serving path can launch, before the first request.

A variant met for the first time mid-serving stalls the whole iteration for its compile (a second or more;
V-LoRA's mixed mode and prefix-cached prefills met theirs late, behind the warm-up requests of a benchmark).
With the batch-dependent arguments unspecialised (:func:`vlora.kernels.compiles.jit`), a kernel's variant is
a function of its tile config, and a LoRA config is a function of the tuning table's bucketed key (tokens,
segments, the group's size, rank): this module walks every key the engine's limits allow and launches each
distinct variant once on a one-token problem. The sampler's Gumbel-max kernel has two variants. Attention's
variants are the decode split (one per power of two of parts) and the prefill kernel; the fused merge
kernels', when the mode policy merges, one per
:func:`vlora.kernels.merge.variant` of the ranks allowed. The rest (norms, RoPE, activations, skinny GEMMs,
decode attention) runs in every decode graph capture.
"""

from __future__ import annotations

import time

import torch

from vlora.kernels.prebuild import launch_items, prebuild_lora
from vlora.kernels.tuning import SEGMENT_BUCKETS, TOKEN_BUCKETS
from vlora.lora.batch import GROUPS


def _buckets_upto(buckets: tuple[int, ...], limit: int) -> list[int]:
    """The buckets a count in [1, limit] can fall in."""
    out = []
    for b in buckets:
        out.append(b)
        if b >= limit:
            break
    return out


def _pair_totals(r: int, slices: int) -> list[int]:
    """Shrink widths R = slices * (r1 + r2) of segments whose larger rank is ``r`` (r2 <= r1 = r), one per power
    of two they fall in (the tuning table's rank buckets)."""
    from vlora.kernels.tuning import pow2_bucket

    lo, hi = slices * (r + 1), slices * 2 * r
    out, b = [], pow2_bucket(lo)
    while b <= pow2_bucket(hi):
        out.append(min(b, hi))
        b *= 2
    return out


def lora_variants(table, group_in: dict[str, int], widths: dict[str, tuple[int, ...]], max_rank: int,
                  max_tokens: int, max_segments: int, elem_bytes: int = 2, pairs: bool = False) -> dict[tuple, tuple]:
    """Every distinct (group, shrink config, expand config, hoisted or not, paired or not) the runner can pick
    under these limits: key -> (group, a rank that picks it, shrink config, expand config, paired). ``pairs``:
    the one-launch mixed mode's variants too (segments with a second adapter: the shrink's width covers both)."""
    from vlora.kernels.atmm import expand_hoisted, fit_shared

    variants: dict[tuple, tuple] = {}
    for t in _buckets_upto(TOKEN_BUCKETS, max_tokens):
        for s in _buckets_upto(SEGMENT_BUCKETS, min(t, max_segments)):
            for g, modules in GROUPS.items():
                for r in range(1, max_rank + 1):
                    expand = table.get("expand", t, s, sum(widths[g]), r)
                    hoisted = expand_hoisted(fit_shared(expand, 4, elem_bytes), r)
                    widths_r = [(len(modules) * r, False)] + [(w, True) for w in _pair_totals(r, len(modules))
                                                              if pairs]
                    for width, paired in widths_r:
                        shrink = table.get("shrink", t, s, group_in[g], width)
                        variants.setdefault((g, shrink, expand, hoisted, paired), (g, r, shrink, expand, paired))
    return variants


def _launch_attention(runner) -> int:
    from vlora.kernels.attention import paged_decode, paged_prefill

    cfg, dev = getattr(runner.model, "local_cfg", runner.model.cfg), runner.device     # TP: this rank's heads
    k_cache, v_cache = runner.kv_cache[:, 0, 0], runner.kv_cache[:, 0, 1]
    heads, d = cfg.num_heads, k_cache.shape[-1]
    q = torch.zeros(1, heads, d, dtype=k_cache.dtype, device=dev)
    scratch = torch.full((1, 1), runner.kv_cache.shape[0] - 1, dtype=torch.int32, device=dev)
    one = torch.ones(1, dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    window = cfg.sliding_window or 0
    paged_prefill(q, k_cache, v_cache, scratch, zero, one, one, 1, 1.0, window)
    parts, n = 1, 1
    while True:                        # the split decode's reduce: one variant per power of two of parts
        paged_decode(q, k_cache, v_cache, scratch, one, 1.0, window, max_ctx=64 * parts, parts=parts)
        n += 1
        if parts >= -(-512 // heads):  # attention.decode_parts: at most ceil(512 / heads) parts (batch 1)
            return n
        parts *= 2


def lora_items(table, group_in: dict[str, int], widths: dict[str, tuple[int, ...]], max_rank: int,
               max_tokens: int, max_segments: int, elem_bytes: int, pairs: bool = False) -> list[tuple]:
    """(group, rank, shrink, expand, in features, widths, paired) of every variant, ready to launch."""
    return [(g, r, sh, ex, group_in[g], widths[g], p) for g, r, sh, ex, p in
            lora_variants(table, group_in, widths, max_rank, max_tokens, max_segments, elem_bytes,
                          pairs).values()]


def build_merge(dtype: torch.dtype, device: torch.device, max_rank: int) -> int:
    """Merge (with and without a record) and unmerge an adapter into a small weight once per variant the ranks up
    to ``max_rank`` make of the fused merge kernels (:func:`vlora.kernels.merge.variant`). Returns the
    launches."""
    from vlora.kernels import merge as kernels

    ranks = {}
    for r in range(1, max_rank + 1):
        ranks.setdefault(kernels.variant(r), r)
    bm, bn, _ = kernels.TILE
    for r in ranks.values():
        # a slice the tile divides (no masks) and one it does not, sizes multiples of 16 as in models; weights
        # so small that every element is an exception, which builds the host-finishing kernels too
        for inn in (bn, bn + 16):
            w = torch.full((1, bm, inn), torch.finfo(dtype).tiny, dtype=dtype, device=device)
            a = torch.ones(1, inn, r, dtype=dtype, device=device)
            b = torch.ones(1, r, bm, dtype=dtype, device=device)
            rec = kernels.merge_slice_(w, 0, a, b, 1.0)
            kernels.unmerge_slice_(w, 0, a, b, 1.0, rec)
            kernels.merge_slice_(w, 0, a, b, 1.0, restore=False)     # a merge that reuses its record
    return 6 * len(ranks)


@torch.inference_mode()
def build_kernels(runner, max_tokens: int, max_segments: int, workers: int = 1, log=None,
                  merges: bool = False) -> dict:
    """Launch every kernel variant the runner can pick under these limits (LoRA variants compiled by
    ``workers`` processes first; the merge kernels and the mixed mode's paired LoRA variants too when the mode
    policy ``merges``); returns counts and seconds."""
    from vlora.kernels import compiles

    if not (runner.use_kernels and runner.device.type == "cuda"):
        return {}
    compiles.install()
    mark, t0 = compiles.snapshot(), time.perf_counter()
    launches = _launch_attention(runner)
    from vlora.kernels.sampling import build_variants

    launches += build_variants(runner.device)
    if runner.tiling is not None:
        dtype = runner.adapters.store.buf.dtype
        pairs = merges and runner.lora_launch.mixed == "one"         # mixed mode's one-launch variants
        items = lora_items(runner.tiling, runner.group_in, runner.group_widths, runner.adapters.max_rank,
                           max_tokens, max_segments, dtype.itemsize, pairs)
        pdl = runner.lora_launch.pdl              # the variants the engine launches: GDC is a compile-time flag
        prebuild_lora(items, dtype, runner.device, workers, pdl)
        launch_items(items, dtype, runner.device, pdl)
        launches += len(items)
    if merges:                          # the merge kernels read the stacked weights, not the tiling table
        weights = next(iter(runner.modes.weights.values()))
        launches += build_merge(weights.dtype, runner.device, runner.adapters.max_rank)
    torch.cuda.synchronize(runner.device)
    out = {"launches": launches, "seconds": round(time.perf_counter() - t0, 2)} | compiles.since(mark)
    out.pop("kernels")
    if log:
        log(f"kernel variants built: {out['compiles']} in {out['seconds']} s ({launches} launches, "
            f"{workers} compile processes)")
    return out

