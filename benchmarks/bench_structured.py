"""Structured output's cost: bench_e2e's workload with a 10-field JSON schema on every request vs unconstrained.

``--requests`` requests of ``--input-len`` seeded random prompt tokens, random adapters of ranks ``--ranks``
round-robin (every adapter used by as many requests), all at once through the engine (continuous batching).
Structured output needs a tokenizer: the model is the embedded SmolLM2-135M-Instruct by default, or a
``random:<preset>`` shape given a tokenizer (``--tokenizer``, default the embedded model's: its vocabulary of 49,152
then replaces the preset's, e.g. llama-2-7b's 32,000; the GPU machine has no Hub access). For each of greedy and sampled
(temperature 0.8, top_p 0.95, top_k 50):

1. constrained: every request carries :data:`SCHEMA` (``ignore_eos``; a request ends when its JSON is complete,
   or at ``--output-len``);
2. unconstrained: the same requests, request *i* generating exactly as many tokens as it did constrained
   (``min_tokens = max_tokens``, ``ignore_eos``), so that both runs do the same work.

Reported: output tok/s of each (the best of ``--rounds`` alternating rounds: a shared machine's noise only slows a
run down) and their ratio, and how many constrained outputs parse and validate. Each setting is preceded by a
short warm-up of both kinds (compiles, graph captures, the grammar's first compile).

    python benchmarks/bench_structured.py --out benchmarks/results/h100-<date>-structured     # GPU, SmolLM2
    python benchmarks/bench_structured.py --model random:llama-2-7b --out ...                # GPU, bench_e2e's shape
    python benchmarks/bench_structured.py --device cpu --requests 8 --input-len 32 --adapters 2 --ranks 8,16 \\
        --out /tmp/structured                                                                # CPU, small
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlora import LLM, GuidedSpec, SamplingParams  # noqa: E402
from vlora.lora.adapter import ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402
from vlora.models.loader import embedded_gguf  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "notes": {"type": "string", "maxLength": 40},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "address", "notes"],
    "additionalProperties": False,
}
"""The 10-field schema every constrained request carries."""

SETTINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_p=0.95, top_k=50)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(engine, prompts, adapters, params) -> dict:
    """All requests at once through ``engine.step``: wall seconds, output tokens and texts, errors."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, a, sp) for p, a, sp in zip(prompts, adapters, params)]
    done: dict[str, object] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    outs = [done[r] for r in ids]
    return {"wall_s": wall, "tokens": [len(o.token_ids) for o in outs], "texts": [o.text for o in outs],
            "errors": [o.error for o in outs if o.finish_reason == "error"]}


def valid(texts: list[str]) -> int:
    """How many texts parse as JSON and validate against SCHEMA (parse only without jsonschema)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    n = 0
    for t in texts:
        try:
            v = json.loads(t)
            if jsonschema is not None:
                jsonschema.validate(v, SCHEMA)
            n += 1
        except Exception:
            pass
    return n


def write_adapters(llm, args, root: Path) -> list[str | None]:
    cfg = llm.engine.model.cfg
    ins, outs = cfg.lora_in_out()
    shape = ModelShape(cfg.name, cfg.num_layers, ins, outs)
    if not args.adapters:
        return [None] * args.requests
    for j in range(args.adapters):
        llm.register_adapter(f"a{j}", write_random_adapter(root / f"a{j}", shape, args.ranks[j % len(args.ranks)],
                                                           seed=j, std=0.01))
    return [f"a{j % args.adapters}" for j in range(args.requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--tokenizer", default=None,
                    help="a model whose tokenizer a random:<preset> model takes (default for those: the embedded one)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128, help="most tokens per request")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    ap.add_argument("--kv-gb", type=float, default=None, help="unified pool, GiB (default: the engine's)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of each; the best is reported")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tokenizer is None and args.model is not None and args.model.startswith("random:"):
        args.tokenizer = str(embedded_gguf())
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_memory_gb=args.kv_gb,
              check_base_model=False, max_lora_rank=max(args.ranks), tokenizer=args.tokenizer)
    eng = llm.engine
    dev = eng.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    vocab = eng.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (args.requests, args.input_len), generator=g).tolist()
    spec = GuidedSpec(json_schema=SCHEMA)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    res = dict(date=dt.date.today().isoformat(), commit=commit, device=gpu, model=eng.model_name,
               tokenizer=args.tokenizer, vocab=vocab,
               dtype=str(eng.dtype).removeprefix("torch."), requests=args.requests, input_len=args.input_len,
               output_len=args.output_len, num_adapters=args.adapters, ranks=args.ranks, schema=SCHEMA,
               torch=torch.__version__, async_scheduling=eng.config.scheduler.async_scheduling, settings={})
    tag = gpu.lower().replace(" ", "-")
    path = args.out / f"structured-{tag}.json"
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(llm, args, Path(tmp))
        log(f"{gpu}: {eng.model_name}, {args.requests} requests x {args.input_len} prompt tokens, "
            f"{args.adapters} adapters")
        warm = min(len(prompts), 8)
        for name, fields in SETTINGS.items():
            log(f"{name}: warm-up")
            run(eng, prompts[:warm], adapters[:warm], [SamplingParams(max_tokens=8, ignore_eos=True, guided=spec,
                                                                      seed=i, **fields) for i in range(warm)])
            run(eng, prompts[:warm], adapters[:warm], [SamplingParams(max_tokens=8, ignore_eos=True, seed=i,
                                                                      **fields) for i in range(warm)])
            cons, frees = [], []
            for _ in range(args.rounds):
                cons.append(run(eng, prompts, adapters, [SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                                                        guided=spec, seed=i, **fields)
                                                         for i in range(args.requests)]))
                frees.append(run(eng, prompts, adapters, [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True,
                                                                         seed=i, **fields)
                                                          for i, n in enumerate(cons[0]["tokens"])]))
            for r in cons + frees:
                assert not r["errors"] and r["tokens"] == cons[0]["tokens"], (r["errors"], r["tokens"])
            con, free = min(cons, key=lambda r: r["wall_s"]), min(frees, key=lambda r: r["wall_s"])
            total = sum(con["tokens"])
            entry = {"constrained_tok_s": total / con["wall_s"], "unconstrained_tok_s": total / free["wall_s"],
                     "constrained_wall_s": con["wall_s"], "unconstrained_wall_s": free["wall_s"],
                     "output_tokens": total, "mean_output_len": total / len(prompts),
                     "valid_json": valid(con["texts"]), "requests": len(prompts),
                     "rounds_wall_s": {"constrained": [r["wall_s"] for r in cons],
                                       "unconstrained": [r["wall_s"] for r in frees]},
                     "example": con["texts"][0]}
            entry["ratio"] = entry["constrained_tok_s"] / entry["unconstrained_tok_s"]
            res["settings"][name] = entry
            path.write_text(json.dumps(res, indent=2))        # each setting as it finishes
            log(f"{name}: constrained {entry['constrained_tok_s']:.1f} tok/s, unconstrained "
                f"{entry['unconstrained_tok_s']:.1f} tok/s, ratio {entry['ratio']:.3f}; {entry['valid_json']}/"
                f"{len(prompts)} outputs valid; mean output {entry['mean_output_len']:.1f} tokens")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
