"""vlora vs transformers+PEFT: mixed-adapter generation on CPU, greedy and sampled.

Both systems serve the same requests (chat prompts of varying length, adapters
assigned round-robin, fixed output length) on the embedded SmolLM2-135M-Instruct
in float32, greedy (identical tokens expected) and sampled (temperature 0.8,
top_p 0.95, top_k 50: the same work, different draws). Runs alternate A B C D
after one smaller warm-up of each; the best time per system is reported (the
median is kept too).

    python benchmarks/bench_cpu_generate.py            # 32 requests x 64 tokens, 4 adapters
    python benchmarks/bench_cpu_generate.py --requests 8 --max-tokens 16 --rounds 1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import ALL_TARGETS, make_peft_adapter  # noqa: E402
from vlora import LLM, SamplingParams  # noqa: E402
from vlora.llm import apply_chat_template  # noqa: E402
from vlora.bench.baselines import PeftBaseline  # noqa: E402
from vlora.models.loader import resolve_model_dir  # noqa: E402

RANKS = (8, 16, 16, 32)
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}       # what chat clients send
QUESTIONS = [
    "Hi!",
    "What is 2 + 2?",
    "Name a primary colour.",
    "Translate 'good morning' into French.",
    "Why is the sky blue?",
    "Give me three tips for sleeping better.",
    "What is the capital of Australia?",
    "Write a haiku about autumn leaves.",
    "Explain what a neural network is in one paragraph.",
    "How do I boil an egg?",
    "List the planets of the solar system in order from the Sun.",
    "What does HTTP stand for?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Suggest a name for a small bakery that sells sourdough bread and pastries.",
    "What is the difference between weather and climate?",
    "Write a Python function that returns the factorial of a number.",
    "Can you recommend a good book for learning about the history of science?",
    "How many legs does a spider have?",
    "Describe the water cycle for a ten-year-old.",
    "What are the main causes of inflation, and how do central banks usually respond to it?",
    "Tell me a joke about computers.",
    "Why do cats purr?",
    "I am planning a three-day trip to Rome in spring. What should I see, and how should I split my days?",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "What is photosynthesis?",
    "Give an example of a metaphor.",
    "Write a short, polite email declining a meeting invitation because of a scheduling conflict.",
    "Who painted the Mona Lisa?",
    "What is the square root of 144?",
    "Explain recursion to a beginner programmer, with a simple example.",
    "What should I pack for a day hike in the mountains?",
    "Is a tomato a fruit or a vegetable?",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4, help=f"adapters, ranks cycling through {RANKS}")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (fixed length)")
    p.add_argument("--rounds", type=int, default=2, help="timed runs per system, alternating")
    p.add_argument("--peft-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_generate-cpu.json")
    return p.parse_args()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (variant {i // len(QUESTIONS)})")
        out.append(apply_chat_template(tokenizer, [{"role": "user", "content": q}]))
    return out


def make_adapters(model_dir: Path, root: Path, n: int) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = {}
    for i in range(n):
        rank = RANKS[i % len(RANKS)]
        paths[f"lora{i}-r{rank}"] = make_peft_adapter(hf, root / f"lora{i}", rank=rank, seed=1000 + i,
                                                      targets=ALL_TARGETS)
    del hf
    return paths


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)
    log(f"model {model_dir.name}; torch {torch.__version__}, {torch.get_num_threads()} threads")

    with tempfile.TemporaryDirectory(prefix="vlora-bench-") as tmp:
        log(f"making {args.adapters} random adapters (ranks {[RANKS[i % len(RANKS)] for i in range(args.adapters)]})")
        adapters = make_adapters(model_dir, Path(tmp), args.adapters)
        names = list(adapters)

        log("loading vlora")
        llm = LLM(model=None, adapters={n: p for n, p in adapters.items()})
        prompts = chat_prompts(llm.tokenizer, args.requests)
        req_adapters = [names[i % len(names)] for i in range(args.requests)]
        lens = [len(p) for p in prompts]
        log(f"{args.requests} prompts, {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.1f}); "
            f"{args.max_tokens} new tokens each")

        log("loading transformers + PEFT")
        peft = PeftBaseline.from_pretrained(model_dir, {n: str(p) for n, p in adapters.items()})

        def run_vlora(n: int, max_tokens: int, sampling: dict | None = None) -> list[list[int]]:
            # min_tokens bans EOS as PEFT's min_new_tokens does, so both pick the same greedy tokens
            sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                **(sampling or {"temperature": 0.0}))
            return [o.token_ids for o in llm.generate(prompts[:n], adapters=req_adapters[:n], sampling=sp)]

        def run_peft(n: int, max_tokens: int, sampling: dict | None = None) -> list[list[int]]:
            return peft.generate(prompts[:n], req_adapters[:n], max_tokens, args.peft_batch_size, sampling)

        systems = {"vlora": run_vlora, "peft": run_peft,
                   "vlora_sampled": lambda n, t: run_vlora(n, t, SAMPLED),
                   "peft_sampled": lambda n, t: run_peft(n, t, SAMPLED)}
        warm_n, warm_tokens = max(1, min(args.requests, max(args.adapters, args.requests // 4))), min(8, args.max_tokens)
        for name, fn in systems.items():
            t = time.perf_counter()
            fn(warm_n, warm_tokens)
            log(f"warm-up {name}: {warm_n} requests x {warm_tokens} tokens in {time.perf_counter() - t:.2f}s")

        load_before = os.getloadavg()
        log(f"load average before timing: {load_before[0]:.2f} (other processes on {os.cpu_count()} CPUs skew timings)")
        times: dict[str, list[float]] = {name: [] for name in systems}
        outputs: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            for name, fn in systems.items():
                t = time.perf_counter()
                outputs[name] = fn(args.requests, args.max_tokens)
                times[name].append(time.perf_counter() - t)
                log(f"round {r + 1}/{args.rounds} {name}: {times[name][-1]:.2f}s")
        load_after = os.getloadavg()

    bad_len = [i for name in systems for i, o in enumerate(outputs[name]) if len(o) != args.max_tokens]
    if bad_len:
        raise SystemExit(f"requests {sorted(set(bad_len))} did not produce exactly {args.max_tokens} tokens")
    eos = set(llm.engine.eos_token_ids)
    same = eos_split = 0
    near_tie_at = []
    for a, b in zip(outputs["vlora"], outputs["peft"]):
        if a == b:
            same += 1
            continue
        j = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        if a[j] in eos or b[j] in eos:   # the two systems ban different EOS ids
            eos_split += 1
        else:
            near_tie_at.append(j)
    print(f"\nidentical token ids: {same}/{args.requests} requests")
    if same < args.requests:
        print(f"WARNING: {args.requests - same} requests differ: {eos_split} first at an EOS token (the systems "
              f"ban different EOS ids), {len(near_tie_at)} elsewhere "
              f"(first differing position {sorted(near_tie_at)}; fp32 near-ties in the argmax can do this)")

    total_tokens = args.requests * args.max_tokens
    res = {}
    for name in systems:
        best = min(times[name])
        res[name] = {"seconds_best": best, "seconds_median": statistics.median(times[name]),
                     "seconds_all": times[name], "output_tok_per_s": total_tokens / best}
    ratio = res["vlora"]["output_tok_per_s"] / res["peft"]["output_tok_per_s"]
    sampled_ratio = res["vlora_sampled"]["output_tok_per_s"] / res["peft_sampled"]["output_tok_per_s"]
    kept = res["vlora_sampled"]["output_tok_per_s"] / res["vlora"]["output_tok_per_s"]

    print(f"\n{'system':<28}{'seconds':>10}{'tok/s':>10}")
    for name, label in (("vlora", "vlora greedy"), ("peft", "transformers+PEFT greedy"),
                        ("vlora_sampled", "vlora sampled"), ("peft_sampled", "transformers+PEFT sampled")):
        print(f"{label:<28}{res[name]['seconds_best']:>10.2f}{res[name]['output_tok_per_s']:>10.1f}")
    print(f"vlora/PEFT throughput ratio: greedy {ratio:.2f}x, sampled {sampled_ratio:.2f}x; vlora sampled / greedy "
          f"{kept:.2f}  (best of {args.rounds} rounds each)")

    record = {
        "benchmark": "cpu_generate",
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1min_before_after": [load_before[0], load_after[0]]},
        "torch": torch.__version__,
        "config": {"model": model_dir.name, "dtype": "float32", "threads": args.threads,
                   "requests": args.requests, "adapters": args.adapters,
                   "ranks": [RANKS[i % len(RANKS)] for i in range(args.adapters)], "targets": ALL_TARGETS,
                   "adapter_assignment": "round-robin", "max_tokens": args.max_tokens, "sampled": SAMPLED,
                   "fixed_length": True, "rounds": args.rounds, "peft_batch_size": args.peft_batch_size,
                   "prompt_tokens": lens},
        "results": {**res, "throughput_ratio_vlora_over_peft": ratio,
                    "throughput_ratio_vlora_over_peft_sampled": sampled_ratio, "vlora_sampled_over_greedy": kept,
                    "identical_requests": same, "differ_at_eos": eos_split,
                    "differ_elsewhere": len(near_tie_at), "output_tokens_per_run": total_tokens},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    log(f"wrote {args.output}")


if __name__ == "__main__":
    main()
