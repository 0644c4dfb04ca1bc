"""TTFT of the pressure runs in one results folder, per run and policy, as a bar chart.

    python benchmarks/plot_pressure.py benchmarks/results/h200-2026-11-25-pressure

Reads every ``*/memory-*.json`` of ``bench_memory.py --pressure`` under the folder and writes ``ttft.png`` there:
mean TTFT as bars (the part spent waiting to be scheduled hatched, where the run reports it), p50 and p90 as
markers, one group per run folder; FastLibra's host KV tier is in its label.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    args = p.parse_args()
    rows = []
    for f in sorted(args.folder.glob("*/memory-*.json")):
        res = json.loads(f.read_text())
        rate = res["dynamic_workload"]["session_rate"]
        host = res["dynamic_workload"].get("host_kv_gb")
        for policy, m in res["dynamic"].items():
            name = policy + (f" ({host:g} GiB host)" if policy == "fastlibra" and host is not None else "")
            rows.append((f"{f.parent.name.replace('-', ' ')}\n{name}", rate, policy, m))
    colors = {"fastlibra": "tab:blue", "lru-fixed": "tab:orange", "unified": "tab:green"}
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4.5))
    for i, (label, rate, policy, m) in enumerate(rows):
        ax.bar(i, m["ttft_mean_s"] * 1e3, color=colors.get(policy, "grey"), label=policy)
        if m.get("queued_mean_s") is not None:
            ax.bar(i, m["queued_mean_s"] * 1e3, color="none", hatch="//", edgecolor="black", lw=0,
                   label="waiting to be scheduled")
        ax.plot([i, i], [m["ttft_p50_s"] * 1e3, m["ttft_p90_s"] * 1e3], "k_-", ms=14)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys())
    ax.set_xticks(range(len(rows)), [f"{r[0]}\n{r[1]} sess/s" for r in rows], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("TTFT, ms")
    ax.set_title(f"Multi-turn chats under pressure: {args.folder.name}\n"
                 "bar: mean (hatched: the part spent waiting to be scheduled); line: p50 to p90", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.folder / "ttft.png", dpi=110)
    print(f"wrote {args.folder / 'ttft.png'}")


if __name__ == "__main__":
    main()
