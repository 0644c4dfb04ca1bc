"""How long the loader's worker takes to read an adapter, on one core as the worker runs.

Per rank: a random PEFT adapter of ``--model``'s shape (all seven projections, stored in ``--stored-dtype``) is
written to ``--dir`` (default: /dev/shm where it exists, so that the disk stays out), then read ``--repeats`` times
by the worker's task as it runs now (:func:`vlora.lora.loader.read` into shared memory, then
:func:`~vlora.lora.loader.ship`) and by the earlier sequence of steps (convert every matrix, pack per group, lay
the packed matrices out for the pool, copy them into a second shared buffer to ship). Reports the median time of
each and checks that both give the same pool layout, bit for bit. Writes ``adapter-read-<label>.json`` after each rank.

    python benchmarks/bench_adapter_read.py --out benchmarks/results/<dir>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlora.lora.adapter import load_adapter                                     # noqa: E402
from vlora.lora.device_store import host_layout                                 # noqa: E402
from vlora.lora.loader import ReadAdapter, ReadSpec, pack, read, shared_zeros, ship  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter                      # noqa: E402
from vlora.models.loader import lora_shape                                       # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def earlier_read(spec: ReadSpec, path: str):
    """The worker's task before it wrote straight into the pool's layout."""
    loaded = load_adapter(path, "a", spec.shape, max_rank=spec.max_rank, dtype=spec.dtype, check_base_model=False)
    packed = pack(loaded, -1, spec.shape.out_features, torch.device("cpu"))
    host = host_layout(packed, shared_zeros)
    r = ReadAdapter(packed, path, None, None)
    return ship(r), host                 # ship copies the packed matrices into a buffer of their own, as it did


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        out = None                        # the previous result freed before the next read, as in the worker
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-2-7b", help="the served model whose adapter shape is read")
    ap.add_argument("--ranks", default="16,64", help="comma-separated adapter ranks")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="the served dtype")
    ap.add_argument("--stored-dtype", default="bfloat16", choices=DTYPES, help="the dtype the file stores")
    ap.add_argument("--repeats", type=int, default=5, help="reads per path and rank (the median is reported)")
    ap.add_argument("--dir", default=None, help="where the adapters are written (default /dev/shm, else a temp dir)")
    ap.add_argument("--label", default=platform.node() or "host", help="names the results file (the host)")
    ap.add_argument("--out", required=True, help="output directory")
    args = ap.parse_args()

    torch.set_num_threads(1)              # as the worker runs
    shape = lora_shape(args.model)
    root = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        commit = None
    result = {"model": args.model, "dtype": args.dtype, "stored_dtype": args.stored_dtype, "repeats": args.repeats,
              "host": platform.node(), "cpu": platform.processor() or platform.machine(), "commit": commit,
              "date": time.strftime("%Y-%m-%d"), "ranks": []}
    max_rank = max(int(r) for r in args.ranks.split(","))
    spec = ReadSpec(shape, max_rank, DTYPES[args.dtype], False, True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for rank in (int(r) for r in args.ranks.split(",")):
            path = str(write_random_adapter(Path(tmp) / f"r{rank}", shape, rank, seed=rank,
                                            dtype=DTYPES[args.stored_dtype]))
            now_s, now = timed(lambda: ship(read(spec, "a", path, alloc=shared_zeros)), args.repeats)
            before_s, (_, before_host) = timed(lambda: earlier_read(spec, path), args.repeats)
            same = torch.equal(now.flat, before_host.flat) and now.host_sizes == before_host.sizes
            mb = now.flat.numel() * now.flat.element_size() / 1e6
            row = {"rank": rank, "megabytes": round(mb, 1), "read_ms": round(1e3 * now_s, 1),
                   "earlier_ms": round(1e3 * before_s, 1), "same_layout": same}
            result["ranks"].append(row)
            print(f"rank {rank} ({mb:.0f} MB): read {row['read_ms']} ms, earlier {row['earlier_ms']} ms, "
                  f"same layout: {same}", flush=True)
            (out / f"adapter-read-{args.label}.json").write_text(json.dumps(result, indent=2))
    if not all(r["same_layout"] for r in result["ranks"]):
        sys.exit("the two paths gave different layouts")


if __name__ == "__main__":
    main()
