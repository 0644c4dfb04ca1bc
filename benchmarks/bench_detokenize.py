"""Host cost of detokenizing one decode step, with the embedded model's tokenizer (SmolLM2).

The engine thread detokenizes every running sequence between GPU steps: ``Detokenizer.update`` (the text and
stop strings) and ``stream_delta`` (what the stream sends). This script times one step of a batch of sequences
at each output length, for:

- ``full``: the whole output decoded every step (what tokenizers without an exact window decode still do);
- ``incremental``: the tokens after the sequence's read offset decoded (the byte-level path);
- ``decode_stream``: ``tokenizers.decoders.DecodeStream.step`` per sequence, for reference (it yields text only
  once a character is complete, so it cannot give ``seq.text`` with a pending partial character).

The outputs are windows of the project's docs tokenized, so tokens are those of real text. At each length the
``--steps`` steps that bring the outputs to it are timed, ``--repeats`` times; the median step is reported.

    python benchmarks/bench_detokenize.py [--batch 64 --lengths 32 64 128 256 512 --out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlora.engine.detokenizer import Detokenizer  # noqa: E402
from vlora.engine.sequence import Sequence  # noqa: E402
from vlora.sampling_params import SamplingParams  # noqa: E402


def corpus_ids(tokenizer) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    return tokenizer.encode(text, add_special_tokens=False)


def outputs(ids: list[int], batch: int, length: int) -> list[list[int]]:
    """``batch`` different windows of ``length`` tokens."""
    stride = max(1, (len(ids) - length) // batch)
    return [ids[i * stride:i * stride + length] for i in range(batch)]


def time_detokenizer(detok: Detokenizer, streams: list[list[int]], start: int, steps: int) -> list[float]:
    """Seconds per step for steps ``start .. start + steps`` (the sequences reach ``start`` untimed first)."""
    seqs = [Sequence(f"r{i}", [1], SamplingParams(), None, 0) for i in range(len(streams))]
    for seq, ids in zip(seqs, streams):
        for t in ids[:start]:
            seq.output_token_ids.append(t)
            detok.update(seq)
            detok.stream_delta(seq)
    out = []
    for k in range(start, start + steps):
        t0 = time.perf_counter()
        for seq, ids in zip(seqs, streams):
            seq.output_token_ids.append(ids[k])
            detok.update(seq)
            detok.stream_delta(seq)
        out.append(time.perf_counter() - t0)
    return out


def time_decode_stream(backend, streams: list[list[int]], start: int, steps: int) -> list[float]:
    from tokenizers.decoders import DecodeStream

    decoders = [DecodeStream(skip_special_tokens=True) for _ in streams]
    for d, ids in zip(decoders, streams):
        for t in ids[:start]:
            d.step(backend, t)
    out = []
    for k in range(start, start + steps):
        t0 = time.perf_counter()
        for d, ids in zip(decoders, streams):
            d.step(backend, ids[k])
        out.append(time.perf_counter() - t0)
    return out


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")] \
        if info.is_file() else []
    return names[0] if names else platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences detokenized per step")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512],
                    help="output lengths (tokens) at which a step is timed")
    ap.add_argument("--steps", type=int, default=16, help="consecutive steps timed at each length")
    ap.add_argument("--repeats", type=int, default=3, help="times each length is timed; the median step is kept")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json (default: print only)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vlora.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    full, incremental = Detokenizer(tokenizer), Detokenizer(tokenizer)
    full.backend = None                         # the whole output decoded every step
    assert incremental.backend is not None, "the embedded tokenizer should decode incrementally"
    ids = corpus_ids(tokenizer)

    rows = []
    for length in args.lengths:
        start = max(0, length - args.steps)
        streams = outputs(ids, args.batch, start + args.steps)
        per = {"full": [], "incremental": [], "decode_stream": []}
        for _ in range(args.repeats):
            per["full"] += time_detokenizer(full, streams, start, args.steps)
            per["incremental"] += time_detokenizer(incremental, streams, start, args.steps)
            per["decode_stream"] += time_decode_stream(incremental.backend, streams, start, args.steps)
        row = {"output_len": length, **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in per.items()}}
        row["speedup"] = row["full_ms"] / row["incremental_ms"]
        rows.append(row)

    print(f"\ndetokenize one step of {args.batch} sequences (median of {args.steps * args.repeats} steps), ms")
    print(f"{'output len':>10} {'full':>8} {'incremental':>12} {'DecodeStream':>13} {'speedup':>8}")
    for r in rows:
        print(f"{r['output_len']:>10} {r['full_ms']:>8.3f} {r['incremental_ms']:>12.3f} "
              f"{r['decode_stream_ms']:>13.3f} {r['speedup']:>7.1f}x")
    if args.out is not None:
        import tokenizers
        import transformers

        args.out.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        meta = {"batch": args.batch, "steps": args.steps, "repeats": args.repeats,
                "tokenizer": "SmolLM2-135M-Instruct", "device": cpu_name(), "python": platform.python_version(),
                "tokenizers": tokenizers.__version__, "transformers": transformers.__version__, "commit": commit}
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
