"""The fusion report: which source went into which adapter, accuracy per task against its requirement, training
time and adapter sizes, for the fusion and its two baselines (V-LoRA Fig. 5), which method's adapters were
written and why any requirement is missed; as JSON and as markdown."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from vlora.adapters.fusion import METHOD_NAMES, FusionResult, meets

REPORT_JSON, REPORT_MD = "fusion-report.json", "fusion-report.md"
OUTCOME = {"alone": "trained alone", "open": "opened adapter (its solo run)", "fuse": "fused",
           "rollback": "violation: rolled back",
           "park": "misses everywhere: placed where it does best (one adapter fewer)"}


def to_json(r: FusionResult) -> dict:
    req = r.requirement
    methods = {"fusion": {"adapters": len(r.adapters), "accuracy": r.fused_accuracy(), "train_s": r.train_s,
                          "size_bytes": sum(a.size_bytes for a in r.adapters)}}
    methods.update({name: asdict(b) for name, b in r.baselines.items()})
    for m in methods.values():
        m["met"] = {t: meets(a, req[t]) for t, a in m["accuracy"].items()}
        m["all_met"] = all(m["met"].values())
    return {"sources": r.sources, "order": r.order, "best": r.best, "written": r.chosen,
            "adapters": [{"name": a.name, "tasks": a.tasks, "accuracy": a.accuracy, "size_bytes": a.size_bytes}
                         for a in r.output],
            "fusion_adapters": [{"name": a.name, "tasks": a.tasks, "accuracy": a.accuracy} for a in r.adapters],
            "attempts": [asdict(a) for a in r.attempts], "methods": methods, "all_met": r.all_met,
            "unmet": r.unmet(), "train_s": r.train_s, "wall_s": r.wall_s, "settings": r.settings}


def to_markdown(r: FusionResult) -> str:
    j = to_json(r)
    req, methods = r.requirement, j["methods"]
    written = METHOD_NAMES[r.chosen]
    total = r.train_s + sum(b.train_s for k, b in r.baselines.items() if k != "per-source")
    lines = ["# Adapter fusion report", "",
             f"{len(r.sources)} knowledge sources -> **{len(r.output)} adapters** ({written}); every requirement "
             f"met: **{'yes' if r.all_met else 'NO'}**. Training {total:.1f} s, wall time {r.wall_s:.1f} s (baselines "
             f"included; the fusion's solo runs are the per-source baseline)."]
    if r.best != "fusion":
        lines += ["", f"**The baseline '{METHOD_NAMES[r.best]}' beats the fusion** (more requirements met, or as "
                      f"many with fewer adapters); "
                      + ("its adapters are the ones written." if r.chosen == r.best else
                         "the fusion's adapters are written as asked (--output fusion).")]
    lines += ["", "## Methods (V-LoRA Fig. 5)", "",
              "| method | adapters | tasks meeting requirement | mean accuracy | training time | adapter size |",
              "|---|---|---|---|---|---|"]
    for key, m in methods.items():
        acc = m["accuracy"]
        mark = " (written)" if key == r.chosen else ""
        lines.append(f"| {METHOD_NAMES.get(key, key)}{mark} | {m['adapters']} | {sum(m['met'].values())}/{len(acc)} | "
                     f"{sum(acc.values()) / len(acc):.3f} | {m['train_s']:.1f} s | {_size(m['size_bytes'])} |")
    home = {t: a.name for a in r.output for t in a.tasks}
    head = "| task | requirement | adapter | " + " | ".join(METHOD_NAMES.get(k, k) for k in methods) + " |"
    lines += ["", "## Accuracy per task (held-out split)", "", head, "|---" * (3 + len(methods)) + "|"]
    for s in r.sources:
        t = s["task"]
        cells = [_acc(m["accuracy"][t], req[t]) for m in methods.values()]
        lines.append(f"| {t} | {req[t]:.2f} | {home.get(t, '-')} | " + " | ".join(cells) + " |")
    if j["unmet"]:
        lines += ["", "## Requirements not met", ""] + [f"- **{t}**: {why}" for t, why in j["unmet"].items()]
    lines += ["", "## Adapters written", "", "| adapter | tasks | size |", "|---|---|---|"]
    lines += [f"| {a.name} | {', '.join(a.tasks)} | {_size(a.size_bytes)} |" for a in r.output]
    lines += ["", f"## Fusion steps (packing order: {', '.join(r.order)})", "",
              "| step | adapter | source | outcome | held-out accuracy / requirement | training time |",
              "|---|---|---|---|---|---|"]
    for i, a in enumerate(r.attempts, 1):
        accs = ", ".join(f"{t} {_acc(v, req[t])}" for t, v in a.accuracy.items())
        where = f"adapter-{a.adapter}" if a.adapter else "-"
        steps = "" if a.steps is None else f", {a.steps} steps"
        lines.append(f"| {i} | {where} | {a.source} | {OUTCOME[a.kind]} | {accs} | {a.train_s:.1f} s{steps} |")
    lines += ["", "## Sources", "", "| task | origin | inputs | answered by | train | held-out | labels | prompt |",
              "|---|---|---|---|---|---|---|---|"]
    for s in r.sources:
        prompt = s["prompt"].replace("\n", "\\n").replace("|", "\\|")
        answer = "task head" if s.get("head") else "label text"
        lines.append(f"| {s['task']} | {s['origin']} | {'images' if s.get('images') else 'text'} | {answer} | "
                     f"{s['train']} | {s['heldout']} | {', '.join(s['labels'])} | `{prompt}` |")
    notes = [f"- {METHOD_NAMES.get(k, k)}: {b.note}" for k, b in r.baselines.items() if b.note]
    lines += ["", "## Settings", "", "```"] + [f"{k}: {json.dumps(v)}" for k, v in r.settings.items()] + ["```"]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def write_report(r: FusionResult, out_dir: str | Path) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pj, pm = out_dir / REPORT_JSON, out_dir / REPORT_MD
    pj.write_text(json.dumps(to_json(r), indent=2) + "\n", encoding="utf-8")
    pm.write_text(to_markdown(r), encoding="utf-8")
    return pj, pm


def _acc(a: float, req: float) -> str:
    return f"{a:.3f} {'ok' if meets(a, req) else 'FAIL'}"


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
