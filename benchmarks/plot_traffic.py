"""Several Traffic sweeps (``bench_traffic.py``'s JSON) on one latency-vs-rate figure, e.g. before and after a change.

    python benchmarks/plot_traffic.py OUT.png "before=DIR1/traffic-nvidia-h200.json" "after=DIR2/traffic-nvidia-h200.json"

TTFT p99 and inter-token p99 (p50 dotted) against the arrival rate, one colour per run, the SLO bounds of the first
run as red lines; the SLO rate of each run in its label.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("runs", nargs="+", help="LABEL=path of a traffic-<device>.json")
    args = p.parse_args(argv)
    runs = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep:
            p.error(f"expected LABEL=PATH, got {item!r}")
        runs.append((label, json.loads(Path(path).read_text())))
    first = runs[0][1]["args"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2 + 0.4 * len(runs)))
    for k, (label, res) in enumerate(runs):
        x = [r["rate"] for r in res["rates"]]
        slo = res["slo_rate"]
        name = f"{label} (SLO rate {'none' if slo is None else f'{slo:g} req/s'})"
        for ax, key in ((axes[0], "ttft"), (axes[1], "itl")):
            val = lambda q: [r[f"{key}_{q}_ms"] if r[f"{key}_{q}_ms"] is not None else float("nan")  # noqa: E731
                             for r in res["rates"]]
            ax.plot(x, val("p99"), "s-", color=f"C{k}", label=f"{name}, p99")
            ax.plot(x, val("p50"), "o:", color=f"C{k}", alpha=0.6, label=f"{label}, p50")
    for ax, unit, bound in ((axes[0], "TTFT (ms)", 1e3 * first["slo_ttft_s"]),
                            (axes[1], "inter-token latency (ms)", first["slo_itl_ms"])):
        ax.axhline(bound, color="red", lw=1, ls="--",
                   label=f"SLO: TTFT p99 <= {first['slo_ttft_s']:g} s, inter-token p99 <= {first['slo_itl_ms']:g} ms")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(unit)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    res = runs[0][1]
    fig.suptitle(f"Traffic over HTTP: {res['model']} on {res['device']}, sampled, {res['date']}")
    fig.tight_layout(rect=(0, 0.09 + 0.035 * len(runs), 1, 1))
    fig.savefig(args.out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
