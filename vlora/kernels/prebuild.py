"""Triton LoRA kernel variants compiled ahead of their first timed or served launch.

A variant of the ATMM kernels is a function of its tile configs (and of a few shapes: the input width, the
slices, the rank bound a hoisted expand checks, the planes a split-K shrink hands over). Compiling one takes a
second or more of mostly single-threaded host work, so many of them are compiled by worker processes at once,
into Triton's disk cache, from which the caller's own launches then load them: the engine's start-up
(:mod:`vlora.engine.warmup`) and the tuner (:func:`vlora.kernels.tuning.tune`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vlora.kernels.segments import SegmentMeta


def launch_lora(g: str, r: int, shrink, expand, k: int, widths: tuple[int, ...], dtype, device,
                pdl: bool = True, paired: bool = False) -> None:
    """One segment of one row at rank ``r`` through ``shrink`` and ``expand``; ``paired``: with a second adapter
    of rank ``r`` (the same weights) in the same launches; ``expand`` None: the shrink alone. ``g`` only names
    the group."""
    from vlora.kernels.atmm import lora_expand, lora_shrink

    ns = len(widths)
    w = torch.zeros(max(ns * r * k, r * sum(widths)) + 16, dtype=dtype, device=device)
    one = lambda value, dt=torch.int32: torch.full((1,), value, dtype=dt, device=device)     # noqa: E731
    meta = SegmentMeta(starts=one(0), lens=one(1), ranks=one(r), scales=one(0.0, torch.float32), max_len=1,
                       num_rows=1, pair_ranks=one(r) if paired else None,
                       pair_scales=one(0.0, torch.float32) if paired else None)
    x = torch.zeros(1, k, dtype=dtype, device=device)
    y = torch.zeros(1, sum(widths), dtype=dtype, device=device)
    a_off, rtot = one(0, torch.int64), one(ns * r)
    b_off = torch.zeros(1, ns, dtype=torch.int64, device=device)
    vcol = torch.tensor([[j * r for j in range(ns)]], dtype=torch.int32, device=device)
    v = lora_shrink(x, w, a_off, rtot, meta, ns * r * (2 if paired else 1), shrink, aligned=True, pdl=pdl,
                    pair=(a_off, rtot) if paired else None)
    if expand is not None:
        lora_expand(y, v, w, b_off, vcol, widths, meta, expand, aligned=True, max_rank=r, pdl=pdl,
                    pair=(b_off, vcol, rtot) if paired else None)


def launch_items(items: list[tuple], dtype: torch.dtype, device: torch.device, pdl: bool = True) -> None:
    """:func:`launch_lora` of each (group, rank, shrink, expand, in features, widths, paired) item."""
    for g, r, shrink, expand, k, widths, paired in items:
        launch_lora(g, r, shrink, expand, k, widths, dtype, device, pdl, paired)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prebuild_lora(items: list[tuple], dtype: torch.dtype, device: torch.device, workers: int,
                  pdl: bool = True) -> None:
    """Compile LoRA variants in ``workers`` fresh interpreters (a compile is mostly single-threaded), so that the
    caller's own launches load them from Triton's disk cache. Each worker holds a CUDA context; what a worker
    did not build (it stops at its first failure) is left to the caller's launches."""
    if workers < 2 or len(items) < 2 * workers:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "variants.json"
        path.write_text(json.dumps([[g, r, sh.as_list(), ex and ex.as_list(), k, list(w), p]
                                    for g, r, sh, ex, k, w, p in items]))
        procs = [subprocess.Popen([sys.executable, "-m", "vlora.kernels.prebuild", str(path), str(i), str(workers),
                                   str(dtype).removeprefix("torch."), str(device), "pdl" if pdl else "no-pdl"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(workers)]
        for p in procs:
            try:
                p.wait(timeout=1200)
            except subprocess.TimeoutExpired:
                p.kill()


def _main(argv: list[str]) -> None:
    """Worker: ``python -m vlora.kernels.prebuild VARIANTS.json INDEX WORKERS DTYPE DEVICE pdl|no-pdl`` builds its
    share."""
    from vlora.kernels.atmm import TileConfig

    path, index, workers, dtype, device, pdl = argv
    rows = json.loads(Path(path).read_text())[int(index)::int(workers)]
    items = [(g, r, TileConfig(*sh), ex and TileConfig(*ex), k, tuple(w), p) for g, r, sh, ex, k, w, p in rows]
    with torch.inference_mode():
        launch_items(items, getattr(torch, dtype), torch.device(device), pdl == "pdl")


if __name__ == "__main__":
    _main(sys.argv[1:])
