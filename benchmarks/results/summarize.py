"""Shrink a raw benchmark JSON to the summary kept in this folder.

    python benchmarks/results/summarize.py RAW.json OUT.json

Drops the per-iteration and per-sample series (any list of values whose JSON exceeds 2,000 characters:
timelines, switch times, pool occupancy samples; lists of records such as runs and cases are kept) and, for ``bench_lora_kernels.py`` output, each case's timings of
every tiling candidate (``cand_us``). Every other field is copied unchanged, so the figures quoted in
docs/benchmarks.md read the same from the summary as from the raw file. ``summary_of`` records what was
dropped.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

MAX_LIST_CHARS = 2000


def _generic(path: str) -> str:
    """The path with every list index written as [*], so one entry names a field of every record."""
    return re.sub(r"\[\d+\]", "[*]", path)


def shrink(x, path: str, dropped: list[str]):
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if k == "cand_us":
                dropped.append(f"{_generic(path)}.{k}")
                continue
            out[k] = shrink(v, f"{path}.{k}", dropped)
        return out
    if isinstance(x, list):
        # Lists of records (runs, cases) are kept record by record; long lists of anything else are series.
        if x and all(isinstance(v, dict) for v in x):
            return [shrink(v, f"{path}[{i}]", dropped) for i, v in enumerate(x)]
        if len(json.dumps(x)) > MAX_LIST_CHARS:
            dropped.append(_generic(path))
            return None
        return [shrink(v, f"{path}[{i}]", dropped) for i, v in enumerate(x)]
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path, help="raw JSON written by the benchmark")
    p.add_argument("out", type=Path, help="summary JSON to write")
    args = p.parse_args()
    dropped: list[str] = []
    data = shrink(json.loads(args.raw.read_text()), "", dropped)
    data["summary_of"] = {"raw": args.raw.name, "dropped": sorted(set(dropped))}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{args.raw} -> {args.out}: {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
