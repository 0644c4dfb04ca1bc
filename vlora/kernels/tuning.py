"""Adaptive tiling (V-LoRA §4.3.2): an offline-profiled table from shape bucket to tile config.

At run time :func:`get_config` is one dictionary lookup on a bucketed key; shapes
the table lacks get :func:`heuristic_config`. ``vlora tune`` (:func:`tune`) fills
the table by timing every config of a pruned search space on the shapes the
served model can produce and writes ``kernels/configs/<gpu name>.json``.

Keys:  ``shrink:T{tokens}:S{segments}:K{in}:R{rank total}`` and
       ``expand:T{tokens}:S{segments}:N{out total}:r{rank}``;
tokens, segments and ranks are rounded up to powers of two.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vlora.kernels.atmm import TileConfig
from vlora.kernels.limits import DeviceLimits, device_limits
from vlora.kernels.segments import SegmentMeta

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 8192)
SEGMENT_BUCKETS = (1, 4, 16, 64)
RANKS = (8, 16, 32, 64, 128, 256)


def pow2_bucket(n: int, cap: int | None = None) -> int:
    b = 1 << max(0, int(n) - 1).bit_length()
    return min(b, cap) if cap else b


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


def shape_key(op: str, tokens: int, segments: int, dim: int, rank: int) -> str:
    t, s = _bucket(tokens, TOKEN_BUCKETS), _bucket(segments, SEGMENT_BUCKETS)
    r = pow2_bucket(rank)
    return f"shrink:T{t}:S{s}:K{dim}:R{r}" if op == "shrink" else f"expand:T{t}:S{s}:N{dim}:r{r}"


def gpu_name(device: torch.device | None = None) -> str:
    """A file-name-safe GPU name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


class TilingTable:
    """Tuned configs by shape key, and the limits of the device they run on (the fallback sizes its split-K
    by the device's SM count; every config is fitted to its shared memory at launch, :func:`atmm.fit_shared`)."""

    def __init__(self, entries: dict[str, list[int]] | None = None, meta: dict | None = None,
                 limits: DeviceLimits | None = None):
        self.entries = {k: TileConfig(*v) for k, v in (entries or {}).items()}
        self.meta = meta or {}
        self.limits = limits or device_limits()

    @classmethod
    def load(cls, name: str | None = None, path: Path | None = None,
             limits: DeviceLimits | None = None) -> "TilingTable":
        """The table of GPU ``name`` (default: this one) in the shipped configs, or the file ``path``."""
        path = path or CONFIG_DIR / f"{name or gpu_name()}.json"
        if not path.is_file():
            if name is None and torch.cuda.is_available():
                log.warning("no ATMM tiling table for this GPU (%s): the LoRA kernels use fallback tile configs "
                            "fitted to its limits; `vlora tune` profiles and writes one", path.name)
            return cls(limits=limits)
        data = json.loads(path.read_text())
        return cls(data["entries"], {k: v for k, v in data.items() if k != "entries"}, limits)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        head = json.dumps(self.meta, indent=1)[:-2]
        rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(c.as_list())}" for k, c in sorted(self.entries.items()))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(f"{head},\n \"entries\": {{\n{rows}\n }}\n}}\n")
        os.replace(tmp, path)           # whole or not at all: a tune killed mid-save leaves the last table

    def get(self, op: str, tokens: int, segments: int, dim: int, rank: int) -> TileConfig:
        cfg = self.entries.get(shape_key(op, tokens, segments, dim, rank))
        if cfg is not None:
            return cfg
        # the fallback sees the key's buckets, not the raw counts: one config per key, so the set of kernel
        # variants is finite and known up front (vlora.engine.warmup compiles them all)
        return heuristic_config(op, _bucket(tokens, TOKEN_BUCKETS), _bucket(segments, SEGMENT_BUCKETS), dim,
                                pow2_bucket(rank), self.limits.num_sms)


def heuristic_config(op: str, tokens: int, segments: int, dim: int, rank: int, num_sms: int) -> TileConfig:
    """A reasonable config when the table has no entry (memory-bound skinny GEMMs): split-K until the grid
    has two programs per SM of the device."""
    per_seg = max(1, tokens // max(1, segments))
    if op == "shrink":      # what the tuned tables in kernels/configs/ pick most: thin M tiles, N fit to R, long K tiles, split-K
        bm = 16 if per_seg <= 256 else 32
        bn = min(128, max(16, pow2_bucket(rank)))
        programs = max(1, segments) * max(1, -(-per_seg // bm)) * max(1, -(-rank // bn))
        split = 1
        while programs * split < 2 * num_sms and split < 8 and dim // (split * 2) >= 256:
            split *= 2
        # planes summed in the shrink for long batches (one plane re-read per column tile, not split of them)
        return TileConfig(bm, bn, 256 if per_seg <= 64 else 128, split, 4, 3, reduce=int(split > 1 and tokens >= 1024))
    bm = 16 if per_seg <= 1024 else 32
    return TileConfig(bm, 128, 16, 1, 4, 2, 4 if per_seg >= 1024 else 1)


def search_space(op: str, tokens: int, segments: int, rank: int) -> list[TileConfig]:
    """Pruned by expert rules: M tile no larger than a segment needs, shrink's N tile fit to the rank,
    expand's K tile no larger than the rank, split-K only for shrink (K is the long dimension; its planes summed
    by the shrink or by the expand), M-tile walking only for long segments, N-strip walking for short ones or
    with v hoisted."""
    per_seg = max(1, tokens // max(1, segments))
    bms = [m for m in (16, 32, 64) if m <= max(16, pow2_bucket(per_seg))]
    if op == "shrink":
        bn = min(128, max(16, pow2_bucket(rank)))
        return [TileConfig(bm, bn, bk, split, 4 if bm * bn <= 64 * 64 else 8, 3, reduce=reduce)
                for bm, bk, split, reduce in itertools.product(bms, (128, 256), (1, 2, 4, 8), (0, 1))
                if split > 1 or not reduce]
    loops = [1, 4] if per_seg >= 256 else [1]
    strips = (1, 2, 4, 8) if per_seg <= 16 else (1,)    # decode: few rows, walk a long strip of B
    space = [TileConfig(bm, bn, bk, 1, 4, 2, loop, strip)
             for bm, bn, bk, loop, strip in itertools.product(bms, (64, 128, 256), (16, 32), loops, strips)
             if bk <= max(16, pow2_bucket(rank))]
    # v hoisted, the strip pipelined (K tile = the rank): decode, and prefill too, where a hoisted expand
    # walking a long strip can beat every other config (docs/decisions.md, 'Split-K planes, shrink and expand
    # tuned as a pair, hoisted expands for prefill')
    hoisted = ((2, 4, 8), (2, 3)) if per_seg <= 16 else ((4, 8), (3,))
    space += [TileConfig(bm, bn, max(16, pow2_bucket(rank)), 1, 4, stages, 1, strip, hoist=1)
              for bm, bn, strip, stages in itertools.product(bms, (64, 128), *hoisted)]
    return space


def model_shapes(hidden: int, q_size: int, kv_size: int, intermediate: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Packed LoRA groups of a decoder: name -> (in features, output slice widths)."""
    return {"qkv": (hidden, (q_size, kv_size, kv_size)), "o": (q_size, (hidden,)),
            "gate_up": (hidden, (intermediate, intermediate)), "down": (intermediate, (hidden,))}


_FLUSH: dict[str, torch.Tensor] = {}
REPLICAS = 8                 # copies of a shape's data captured in one graph when timing


def cold_l2_us(fn: Callable[[], object], warmup_ms: float = 2.0, rep_ms: float = 10.0, min_reps: int = 5) -> float:
    """Median µs of ``fn`` (a CUDA-graph replay) with a cold L2 holding clean lines.

    Before each timed call a 256 MiB buffer is *read* (a sum), which evicts the op's data from L2 the way a
    decode step's weight reads do and leaves clean lines. ``triton.testing.do_bench`` flushes by *writing*
    256 MiB, which leaves dirty lines for the timed op to write back, a cost that a decode step, whose weight
    reads leave clean lines, does not pay.
    """
    buf = _FLUSH.get("buf")
    if buf is None:
        buf = _FLUSH["buf"] = torch.ones(1 << 27, dtype=torch.float16, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    for _ in range(max(1, int(warmup_ms / est_ms))):
        fn()
    n_rep = int(min(1000, max(min_reps, rep_ms / max(est_ms, 0.05))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for i in range(n_rep):
        torch.sum(buf, dim=0, dtype=torch.float32, out=sink)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_cuda(fns: Callable[[], object] | list[Callable[[], object]]) -> float:
    """Seconds per call as a serving engine runs it: the calls (the same op on distinct copies of its data)
    captured one after another in one CUDA graph; the median replay after a read-only L2 flush
    (:func:`cold_l2_us`), divided by the number of calls."""
    fns = fns if isinstance(fns, list) else [fns]
    for f in fns:
        f()                                                # compile + warm up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return cold_l2_us(graph.replay) / len(fns) / 1e6


PRESETS = {   # packed groups to tune for: a served model's four groups, or the benchmark grid's shapes
    "llama-7b": model_shapes(4096, 4096, 4096, 11008),
    "llama-13b": model_shapes(5120, 5120, 5120, 13824),
    "bench-grid": {"h4096": (4096, (4096,)), "h5120": (5120, (5120,)), "up": (4096, (11008,)),
                   "down": (11008, (4096,))},
}


def tune(groups: dict[str, tuple[int, tuple[int, ...]]], dtype: torch.dtype = torch.bfloat16,
         token_buckets=TOKEN_BUCKETS, segment_buckets=SEGMENT_BUCKETS, ranks=RANKS,
         progress: bool = True, budget_s: float | None = None, workers: int | None = None,
         chunk: int = 16, fixed: dict[str, TileConfig] | None = None,
         on_chunk: Callable[[TilingTable], object] | None = None) -> TilingTable:
    """Profile every config of the search space on every bucket; returns the best-per-key table.

    Buckets go in chunks of ``chunk`` (shrink, expand) pairs: ``workers`` processes (default: half the host's
    cores, at most 16) first compile the chunk's shrink candidates, which are then timed; then the expand
    candidates with the planes the chunk's fastest shrinks hand over, then timed as pairs. A compile is a second
    or more of host work and a timing a few milliseconds, so compiled one by one in the timing loop they were
    most of a tune's time. ``fixed``: keys whose config the run keeps (a merged table's keys that pairs outside
    the run read too, :func:`shared_keys`); a pair with such a key is tuned around it. ``on_chunk`` gets the table
    after each chunk (a caller saves it, so that a run cut short keeps what it tuned). ``budget_s`` is checked
    before each chunk's compiles and before each pair."""
    from tqdm import tqdm

    from vlora.kernels.prebuild import prebuild_lora

    dev = torch.device("cuda")
    if workers is None:
        workers = min(16, max(1, (os.cpu_count() or 2) // 2))
    pairs = []              # one (shrink, expand) pair per group and bucket; groups may share either key
    for (name, (k_in, widths)), t, s, r in itertools.product(groups.items(), token_buckets, segment_buckets, ranks):
        if s > t:
            continue
        if s > 1 and t // s == 0:
            continue
        pairs.append((name, t, s, r, k_in, widths))
    pairs.sort(key=lambda j: -j[1])          # large token counts first: they matter most and tune slowest
    table = TilingTable(meta={"gpu": torch.cuda.get_device_name(), "dtype": str(dtype).removeprefix("torch."),
                              "triton": __import__("triton").__version__, "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d"),
                              "timing": f"CUDA graph of {REPLICAS} calls on copies of the data, median replay after a "
                                        "read-only L2 flush; a shrink with the expand that reads its planes"})
    t0 = time.perf_counter()
    fixed = fixed or {}
    over = lambda: budget_s is not None and time.perf_counter() - t0 > budget_s     # noqa: E731
    shrinks: dict[str, dict[int, tuple[float, TileConfig]]] = {}   # shrink key -> planes -> fastest (s, config)
    expands: dict[str, TileConfig] = {k: c for k, c in fixed.items() if k.startswith("expand:")}   # chosen already
    done: set[tuple[str, str]] = set()
    built: set[tuple] = set()
    bar = tqdm(total=len(pairs), desc="tuning ATMM", disable=not progress)
    for c0 in range(0, len(pairs), chunk):
        if over():
            break
        todo = []
        for name, t, s, r, k_in, widths in pairs[c0:c0 + chunk]:
            skey = shape_key("shrink", t, s, k_in, len(widths) * r)
            ekey = shape_key("expand", t, s, sum(widths), r)
            if (skey, ekey) in done:                   # another group's pair of the same keys
                bar.update(1)
                continue
            done.add((skey, ekey))
            todo.append((name, t, s, r, k_in, widths, skey, ekey))
        fresh = {j[6]: j for j in todo if j[6] not in shrinks}
        prebuild_lora(_new(built, shrink_items(fresh.values(), fixed)), dtype, dev, workers)
        for name, t, s, r, k_in, widths, skey, _ in fresh.values():
            cases = [_case("shrink", t, s, k_in, r, widths, dtype, dev) for _ in range(REPLICAS)]
            fastest = shrinks[skey] = _fastest_by_planes(cases, _shrink_space(skey, t, s, len(widths) * r, fixed))
            if not fastest and skey in fixed:       # the kept config does not run here: search after all
                log.warning("%s: the merged table's config %s does not run; searching", skey, fixed[skey])
                fastest = shrinks[skey] = _fastest_by_planes(cases, search_space("shrink", t, s, len(widths) * r))
            # the expand reads the planes of the shrink of the same batch: the pair is chosen together, from the
            # fastest shrink handing over one plane and the fastest handing over several
            if len(fastest) > 2:
                several = min((o for p, o in fastest.items() if p > 1), key=lambda o: o[0])
                shrinks[skey] = {p: o for p, o in fastest.items() if p == 1 or o is several}
        if over():
            break
        spaces = {ekey: [expands[ekey]] if ekey in expands else search_space("expand", t, s, r)
                  for _, t, s, r, _, _, _, ekey in todo}
        prebuild_lora(_new(built, expand_items(todo, shrinks, spaces)), dtype, dev, workers)
        for name, t, s, r, k_in, widths, skey, ekey in todo:
            if over():
                break
            # A key another pair chose already keeps its choice (a shrink key is shared by groups of one input
            # width, an expand key by groups of one output width: o and down).
            options = shrinks[skey]
            space = [expands[ekey]] if ekey in expands else spaces[ekey]
            best = None
            for planes, (s_sec, s_cfg) in sorted(options.items()):
                cases = [_case("expand", t, s, sum(widths), r, widths, dtype, dev, planes) for _ in range(REPLICAS)]
                for cfg in space:
                    sec = s_sec + _time(cases, cfg)
                    if sec < float("inf") and (best is None or sec < best[0]):
                        best = (sec, planes, s_cfg, cfg)
            bar.update(1)
            if best is None:
                continue
            sec, planes, s_cfg, e_cfg = best
            table.entries[skey], table.entries[ekey] = s_cfg, e_cfg
            shrinks[skey], expands[ekey] = {planes: options[planes]}, e_cfg
            bar.set_postfix_str(f"{skey} + {ekey} {sec * 1e6:.1f}us")
        if on_chunk is not None:
            on_chunk(table)
    bar.close()
    return table


def _fastest_by_planes(cases, configs: list[TileConfig]) -> dict[int, tuple[float, TileConfig]]:
    """Planes handed over -> (seconds, config) of the fastest shrink of ``configs`` that runs."""
    fastest: dict[int, tuple[float, TileConfig]] = {}
    for cfg in configs:
        sec = _time(cases, cfg)
        if sec < fastest.get(cfg.planes, (float("inf"),))[0]:
            fastest[cfg.planes] = (sec, cfg)
    return fastest


def _shrink_space(skey: str, tokens: int, segments: int, rank_total: int,
                  fixed: dict[str, TileConfig]) -> list[TileConfig]:
    return [fixed[skey]] if skey in fixed else search_space("shrink", tokens, segments, rank_total)


def shared_keys(groups: dict[str, tuple[int, tuple[int, ...]]], token_buckets, segment_buckets, ranks,
                others: dict[str, tuple[int, tuple[int, ...]]] | None = None) -> set[str]:
    """Keys of this run's pairs that pairs outside it read too: the other ranks, buckets and groups (``others``:
    default the presets' groups) of the full grid, as the tuner times them (one adapter per segment; mixed
    mode's paired launches, whose shrink reads the two ranks' total, are never timed as pairs). A packed group's
    rank total is rounded up to a power of two, so a shrink key serves several ranks (qkv at rank 64 and o at
    rank 256 both read ``R256``), and o and down share their expand keys. Merged into a table, such a key keeps its config (:func:`tune`'s ``fixed``): the
    pairs that chose it were timed with it."""
    def keys(grp, tokens, segs, rks):
        out = {}
        for (_, (k_in, widths)), t, s, r in itertools.product(grp.items(), tokens, segs, rks):
            if s <= t:
                out[(k_in, tuple(widths), t, s, r)] = (shape_key("shrink", t, s, k_in, len(widths) * r),
                                                       shape_key("expand", t, s, sum(widths), r))
        return out

    every = dict(groups)
    for preset in PRESETS.values() if others is None else [others]:
        every.update({f"{k_in}>{widths}": (k_in, widths) for k_in, widths in preset.values()})
    run = keys(groups, token_buckets, segment_buckets, ranks)
    outside = {k for pair, ks in keys(every, TOKEN_BUCKETS, SEGMENT_BUCKETS, RANKS).items() if pair not in run
               for k in ks}
    return {k for ks in run.values() for k in ks} & outside


def shrink_items(jobs, fixed: dict[str, TileConfig] | None = None) -> list[tuple]:
    """Variants to build for timing the shrink candidates of these (name, tokens, segments, rank, in features,
    widths, shrink key, ...) jobs (items for :mod:`vlora.kernels.prebuild`, the shrink alone)."""
    items = []
    for name, t, s, r, k_in, widths, skey, *_ in jobs:
        items += [(name, r, cfg, None, k_in, tuple(widths), False)
                  for cfg in _shrink_space(skey, t, s, len(widths) * r, fixed or {})]
    return items


def expand_items(jobs, shrinks: dict[str, dict[int, tuple[float, TileConfig]]],
                 spaces: dict[str, list[TileConfig]]) -> list[tuple]:
    """Variants to build for timing the expand candidates (``spaces`` by expand key) of these jobs, each after the
    shrinks it is timed with (``shrinks``: shrink key -> planes -> (seconds, config)): the expand reads as many
    planes as its shrink hands over, and a variant is built per count."""
    items = []
    for name, t, s, r, k_in, widths, skey, ekey in jobs:
        for _, s_cfg in shrinks.get(skey, {}).values():
            items += [(name, r, s_cfg, cfg, k_in, tuple(widths), False) for cfg in spaces[ekey]]
    return items


def _new(built: set, items: list[tuple]) -> list[tuple]:
    """The items whose variants are not in ``built`` yet (now marked built): a variant is its shapes and configs,
    whichever bucket asked for it."""
    out = []
    for name, r, sh, ex, k, widths, paired in items:
        key = (r, sh, ex, k, tuple(widths))
        if key not in built:
            built.add(key)
            out.append((name, r, sh, ex, k, widths, paired))
    return out


def _time(cases, cfg: TileConfig) -> float:
    """Seconds per call of ``cfg`` on the cases; inf where it cannot run (e.g. out of shared memory)."""
    try:
        return time_cuda([lambda c=c: c(cfg) for c in cases])
    except Exception:
        return float("inf")


def _case(op, tokens, segments, dim, r, widths, dtype, dev, planes: int = 1):
    """A closure running one op on random data of the given shape, for timing (expand: reading ``planes``
    planes of v, as a shrink handing over that many leaves them)."""
    from vlora.kernels import atmm

    ns = len(widths)
    lens = [tokens // segments + (1 if i < tokens % segments else 0) for i in range(segments)]
    starts = [sum(lens[:i]) for i in range(segments)]
    meta = SegmentMeta(torch.tensor(starts, dtype=torch.int32, device=dev),
                            torch.tensor(lens, dtype=torch.int32, device=dev),
                            torch.full((segments,), r, dtype=torch.int32, device=dev),
                            torch.ones(segments, dtype=torch.float32, device=dev), max(lens), tokens)
    k_in = dim if op == "shrink" else None
    per_adapter = ns * r * (k_in or 4096) + r * sum(widths)
    w = torch.randn(segments * per_adapter, dtype=dtype, device=dev) * 0.01
    a_off = torch.arange(segments, dtype=torch.int64, device=dev) * per_adapter
    if op == "shrink":
        x = torch.randn(tokens, dim, dtype=dtype, device=dev)
        rtot = torch.full((segments,), ns * r, dtype=torch.int32, device=dev)
        return lambda cfg: atmm.lora_shrink(x, w, a_off, rtot, meta, ns * r, cfg, aligned=True)
    v = torch.randn(planes, tokens, ns * r, dtype=torch.float32, device=dev)
    y = torch.zeros(tokens, sum(widths), dtype=dtype, device=dev)
    b_off = torch.stack([a_off + ns * r * 4096 + sum(widths[:j]) * r for j in range(ns)], dim=1)
    vcol = torch.tensor([[j * r for j in range(ns)]] * segments, dtype=torch.int32, device=dev)
    return lambda cfg: atmm.lora_expand(y, v, w, b_off, vcol, widths, meta, cfg, aligned=True, max_rank=r)
