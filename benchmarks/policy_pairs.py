"""What a default inference-mode policy of ``vlora`` changes on the uniform workload: the tok/s of bench_e2e or
bench_serve under ``--policy vlora`` over those under ``--policy unmerged``, per GPU, sampling setting and
workload (32 adapters, base only), from the folders ``gpu_paired.sh OUT e2e|serve`` writes
(``PART-POLICY-gpuN/*.json``: each GPU ran both policies, in opposite orders on alternate GPUs; on one GPU, N
numbers the calls, FIRST=vlora's from 1), and per sampling setting and workload the mean ratio over the pairs
with its 95% t-interval.

    python benchmarks/policy_pairs.py OUT e2e|serve     # writes OUT/PART-pairs.md and OUT/PART-pairs.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from vlora.bench.paired import t_interval

POLICIES = ("unmerged", "vlora")


def tok_s(part: str, entry: dict, workload: str) -> float | None:
    """A sampling setting's output tok/s for ``workload`` (adapters or base) in one result file's entry."""
    if part == "e2e":
        return entry.get(workload)
    return entry.get("http", {}).get(workload, {}).get("tok_s")


def collect(out: Path, part: str) -> dict[int, dict[str, dict]]:
    """GPU -> policy -> the result file's ``sampling`` entries (a run cut before it wrote one is left out)."""
    runs: dict[int, dict[str, dict]] = {}
    for d in sorted(out.glob(f"{part}-*-gpu*")):
        m = re.fullmatch(rf"{part}-({'|'.join(POLICIES)})-gpu(\d+)", d.name)
        files = sorted(d.glob("*.json")) if d.is_dir() else []
        if m and files:
            runs.setdefault(int(m.group(2)), {})[m.group(1)] = json.loads(files[0].read_text())["sampling"]
    return runs


def pairs(runs: dict[int, dict[str, dict]], part: str) -> list[dict]:
    rows = []
    for gpu, by_policy in sorted(runs.items()):
        if not all(p in by_policy for p in POLICIES):
            continue
        for setting in by_policy["unmerged"]:
            for workload in ("adapters", "base"):
                base, new = (tok_s(part, by_policy[p].get(setting, {}), workload) for p in POLICIES)
                if base and new:
                    rows.append(dict(gpu=gpu, setting=setting, workload=workload, unmerged=base, vlora=new,
                                     ratio=new / base))
    return rows


def summary(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    """(sampling setting, workload) -> the vlora / unmerged ratio of each pair that ran it."""
    out: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        out.setdefault((r["setting"], r["workload"]), []).append(r["ratio"])
    return out


def report(rows: list[dict], part: str, runs: dict) -> str:
    lines = [f"# {part}: tok/s under --policy vlora over --policy unmerged (uniform workload)", "",
             "| GPU | sampling | workload | unmerged tok/s | vlora tok/s | vlora / unmerged |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['gpu']} | {r['setting']} | {r['workload']} | {r['unmerged']:,.0f} | {r['vlora']:,.0f} | "
              f"{r['ratio']:.3f} |" for r in rows]
    missing = [f"GPU {g}: {p}" for g, by in sorted(runs.items()) for p in POLICIES if p not in by]
    if missing:
        lines += ["", f"Runs without a result file (cut or failed): {', '.join(missing)}."]
    if rows:
        lines += ["", "| sampling | workload | pairs | vlora / unmerged, mean [95% t-interval] |", "|---|---|---|---|"]
        for key, ratios in summary(rows).items():
            ci = t_interval(ratios)          # (mean, low, high); None for one pair
            cell = f"{ci[0]:.3f} [{ci[1]:.3f}, {ci[2]:.3f}]" if ci else f"{ratios[0]:.3f}"
            lines.append(f"| {key[0]} | {key[1]} | {len(ratios)} | {cell} |")
        ratios = [r["ratio"] for r in rows]
        lines += ["", f"vlora / unmerged over {len(rows)} pairs: mean {sum(ratios) / len(ratios):.3f}, "
                      f"lowest {min(ratios):.3f}, highest {max(ratios):.3f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder gpu_paired.sh wrote")
    ap.add_argument("part", choices=("e2e", "serve"))
    args = ap.parse_args()
    runs = collect(args.out, args.part)
    rows = pairs(runs, args.part)
    text = report(rows, args.part, runs)
    (args.out / f"{args.part}-pairs.md").write_text(text)
    (args.out / f"{args.part}-pairs.json").write_text(json.dumps(rows, indent=2))
    print(text, end="")


if __name__ == "__main__":
    main()
