"""Tensor parallelism on one host: a random Llama-2-13B shape at TP=1 and TP=2, a random CodeLlama-34B shape
(too large for one 80 GB GPU with its KV cache) at TP=2, and on four GPUs a random Llama-2-70B shape at TP=4 with
a check of its tokens (the shape cut to two layers, TP=4 against TP=1).

Each configuration runs in its own process (a clean GPU for the next). For each, with ``--adapters`` random
adapters of ranks ``--ranks`` (round-robin, every adapter used by as many requests):

1. bench_e2e's workload: ``--requests`` requests of ``--input-len`` random tokens and exactly ``--output-len``
   output tokens, all at once (continuous batching), with the adapters and then base model only: output
   tokens/s, and the median decode step of the full batch inside the engine loop (CUDA-graph replay, logits and
   sampling included) with and without adapters, whose difference is the LoRA share of the step;
2. one request, with an adapter and without, each ``--sampling`` setting: the batch-1 decode step, and its LoRA
   share;
3. the GPU time between decode graph replays, per rank (rank 0 from its replays' events, each worker from its
   own), at batch 1 and the full batch with adapters: the host work async scheduling does not hide;
4. at TP > 1, the all-reduces alone, on every rank at once, for the decode messages of batch 1 and of the full
   batch (batch x hidden elements), NCCL and torch's symmetric-memory one-shot, eager and replayed from a CUDA
   graph; times 2 x layers, the all-reduce time of one decode step. Under ``--all-reduce auto`` the engine's
   own start-up timings and choices are recorded too.

Each configuration also records the floor of its decode steps on one GPU: the bytes its rank reads per step
(rank 0's weights, the embedding left out; at the full batch also its KV slices of the last step) over the copy
bandwidth measured on that GPU. ``70b-tokens`` runs the two-layer 70B shape at TP=1 and TP=4 in float32: greedy
tokens of eight requests with adapters and without, which must be equal.

Output: ``tp.json`` and ``tp.md`` (a summary table) under ``--out`` (``tp-13b.*`` or ``tp-34b.*`` for one model),
written again as each configuration finishes; a configuration writes its part after each measurement, so a run
cut by a time limit keeps what it measured.

    python benchmarks/bench_tp.py --out benchmarks/results                   # two GPUs, the issue's setting
    python benchmarks/bench_tp.py --configs 13b --out benchmarks/results     # one model per run (shorter runs)
    python benchmarks/bench_tp.py --configs 70b-tokens,70b --out benchmarks/results    # four GPUs
    python benchmarks/bench_tp.py --dry-run --out /tmp/tp                    # CPU: a tiny model, gloo, minutes
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_e2e import StepTimer, copy_bandwidth, log, run_offline, sampling_params, weight_bytes  # noqa: E402

from vlora import LLM, SamplingParams  # noqa: E402
from vlora.bench.phases import PhaseTimer  # noqa: E402
from vlora.lora.adapter import ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402
from vlora.models.loader import RANDOM_PRESETS  # noqa: E402

PHASES = (("13b", "random:llama-2-13b", 1), ("13b", "random:llama-2-13b", 2), ("34b", "random:codellama-34b", 2),
          ("70b-tokens", "random:llama-2-70b-2l", 1), ("70b-tokens", "random:llama-2-70b-2l", 4),
          ("70b", "random:llama-2-70b", 4))
DRY_PHASES = (("13b", "random:tiny-llama", 1), ("13b", "random:tiny-llama", 2), ("34b", "random:tiny-llama", 2),
              ("70b-tokens", "random:tiny-llama", 1), ("70b-tokens", "random:tiny-llama", 2),
              ("70b", "random:tiny-llama", 2))
TOKEN_PROMPTS = 8           # 70b-tokens: requests, half with an adapter


def preset(model: str) -> dict:
    return RANDOM_PRESETS[model.removeprefix("random:")]


def write_adapters(model: str, n: int, ranks: list[int], root: Path, dtype: torch.dtype) -> dict[str, str]:
    """``n`` random PEFT adapters on every projection of ``model``, ranks round-robin."""
    p = preset(model)
    h, i = p["hidden_size"], p["intermediate_size"]
    q, kv = h, p["num_key_value_heads"] * h // p["num_attention_heads"]
    shape = ModelShape(model, p["num_hidden_layers"],
                       {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": q, "gate_proj": h, "up_proj": h,
                        "down_proj": i},
                       {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": i, "up_proj": i,
                        "down_proj": h})
    log(f"writing {n} adapters for {model} (ranks {ranks}, all projections) under {root}")
    return {f"a{j}": str(write_random_adapter(root / f"a{j}", shape, ranks[j % len(ranks)], seed=j, std=0.01,
                                              dtype=dtype)) for j in range(n)}


def gaps(args, llm, prompts, adapters, sp, batch: int, tp: int) -> dict:
    """One run of ``batch`` requests with rank 0's phase timer and the workers' replay events on: the median GPU
    time between decode replays of the full batch, per rank (microseconds), and rank 0's host time per step."""
    eng = llm.engine
    timer = PhaseTimer(eng)
    if tp > 1:
        eng.model.gap_trace(None)
    try:
        llm.generate(prompts[:batch], None if adapters is None else adapters[:batch], sp)
    except BaseException:
        if tp > 1:                    # the workers stop recording (their file is not read)
            eng.model.gap_trace(str(Path(tempfile.gettempdir()) / "vlora-gaps-unread-{rank}.json"))
        raise
    finally:
        timer.close()
    summary = timer.summary(batch)
    out = {"rank0_gpu_gap_us": summary.get("gpu_gap_us"), "rank0_host_us": summary.get("host_us"),
           "rank0_step_us": summary.get("wall_us")}
    if tp > 1:
        with tempfile.TemporaryDirectory(prefix="vlora-gaps-") as tmp:
            path = str(Path(tmp) / "rank{rank}.json")
            eng.model.gap_trace(path)
            for rank in range(1, tp):
                f = Path(path.format(rank=rank))
                deadline = time.monotonic() + 60
                while not f.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.1)                   # the worker's write ends
                got = json.loads(f.read_text())["gaps"] if f.exists() else []
                xs = [g["gap_ms"] for g in got if g["rows"] == batch]
                out[f"rank{rank}_gpu_gap_us"] = 1e3 * statistics.median(xs) if xs else None
    return out


def floors(args, eng, dev) -> dict:
    """The decode step's bytes floor on one GPU: rank 0's weights (its shard; the embedding left out, a step reads
    only its looked-up rows) and, at the full batch, its KV slices of the last step, over the copy bandwidth."""
    cfg = eng.model.cfg
    inner = getattr(eng.model, "inner", eng.model)
    kv_heads = getattr(eng.model, "kv_heads_per_rank", cfg.num_kv_heads)
    kv_token = 2 * cfg.num_layers * kv_heads * cfg.head_dim * torch.finfo(eng.dtype).bits // 8
    out = {"weight_bytes_per_gpu": weight_bytes(inner),
           "kv_bytes_per_gpu_last_step": kv_token * args.requests * (args.input_len + args.output_len),
           "copy_bw": copy_bandwidth(dev)}
    out["floor_ms_b1"] = 1e3 * out["weight_bytes_per_gpu"] / out["copy_bw"]
    out[f"floor_ms_b{args.requests}"] = 1e3 * (out["weight_bytes_per_gpu"] + out["kv_bytes_per_gpu_last_step"]) \
        / out["copy_bw"]
    return out


def run_tokens(args, model: str, tp: int, adapter_dirs: dict[str, str], path: Path) -> None:
    """Greedy tokens of TOKEN_PROMPTS requests, every other one with an adapter (``70b-tokens``)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, preset(model)["vocab_size"], (TOKEN_PROMPTS, 64), generator=g).tolist()
    names = [None if j % 2 else f"a{j % len(adapter_dirs)}" for j in range(TOKEN_PROMPTS)]
    # float32: TP=N sums each row-parallel projection in another order than TP=1, which in bf16 can flip a greedy
    # token between near-tied logits; in float32 a difference means a bug
    llm = LLM(model, device=args.device, dtype="float32", tensor_parallel_size=tp, all_reduce=args.all_reduce,
              max_model_len=256, max_lora_rank=max(args.ranks), check_base_model=False)
    try:
        for n, p in adapter_dirs.items():
            llm.register_adapter(n, p)
        out = llm.generate(prompts, names, SamplingParams(max_tokens=16, ignore_eos=True))
        path.write_text(json.dumps({"model": model, "tp": tp, "tokens": [o.token_ids for o in out]}))
        log(f"{model} TP={tp}: tokens of {len(out)} requests")
    finally:
        llm.close()


def run_phase(args, model: str, tp: int, adapter_dirs: dict[str, str], path: Path) -> dict:
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, preset(model)["vocab_size"], (args.requests, args.input_len), generator=g).tolist()
    names = [f"a{j % len(adapter_dirs)}" for j in range(args.requests)]
    t0 = time.perf_counter()
    llm = LLM(model, device=args.device, dtype=args.dtype, tensor_parallel_size=tp, all_reduce=args.all_reduce,
              max_num_seqs=args.requests, max_num_batched_tokens=args.max_batched_tokens,
              max_model_len=args.input_len + args.output_len + 16, max_lora_rank=max(args.ranks),
              check_base_model=False, async_scheduling=args.async_scheduling == "on")
    eng = llm.engine
    res = {"model": model, "tp": tp, "all_reduce": args.all_reduce, "start_s": time.perf_counter() - t0,
           "pool": eng.sizing.describe(), "async_scheduling": args.async_scheduling}
    if tp > 1:
        res["all_reduce_chosen"] = eng.model.all_reduce
        res["all_reduce_timings"] = eng.model.all_reduce_timings
    log(f"{model} TP={tp}: started in {res['start_s']:.0f} s; {res['pool']}; all-reduce "
        f"{res.get('all_reduce_chosen', '-')}")

    def save():                                  # after each measurement: a cut run keeps what it measured
        path.write_text(json.dumps(res, indent=2))
    try:
        t0 = time.perf_counter()
        for n, p in adapter_dirs.items():
            llm.register_adapter(n, p)
        res["register_s"] = time.perf_counter() - t0
        log(f"registered {len(adapter_dirs)} adapters in {res['register_s']:.0f} s; warm-up (compiles, graphs)")
        warm = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.generate(prompts, names, warm)
        llm.generate(prompts, None, warm)
        llm.generate(prompts[:1], names[:1], warm)
        llm.generate(prompts[:1], None, warm)
        eng.runner.capture_graphs()
        sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        out_tokens = args.requests * args.output_len
        overlapped = eng.num_overlapped
        for setting in args.sampling.split(","):      # greedy keys unsuffixed; "adapters_tok_s_sampled", ...
            sps = sampling_params(setting, args.output_len, args.requests)
            tag = "" if setting == "greedy" else f"_{setting}"
            for label, adapters in (("adapters", names), ("base", None)):
                timer = StepTimer(eng, dev)
                run = run_offline(eng, prompts, adapters, sps, dev)
                timer.close()
                res[f"{label}_tok_s{tag}"] = out_tokens / run["wall_s"]
                res[f"{label}_step_ms_b{args.requests}{tag}"] = timer.decode_median_ms(args.requests)
                log(f"  e2e {label} {setting}: {res[f'{label}_tok_s{tag}']:.0f} output tok/s, decode step "
                    f"(B={args.requests}) {res[f'{label}_step_ms_b{args.requests}{tag}']} ms")
                save()
        res["overlapped_iterations"] = eng.num_overlapped - overlapped    # decodes queued behind another
        for setting in args.sampling.split(","):      # greedy keys unsuffixed, as above
            tag = "" if setting == "greedy" else f"_{setting}"
            for label, adapters in (("adapters", names[:1]), ("base", None)):
                timer = StepTimer(eng, dev)
                llm.generate(prompts[:1], adapters, sampling_params(setting, args.output_len, 1))
                timer.close()
                res[f"{label}_step_ms_b1{tag}"] = timer.decode_median_ms(1)
                log(f"  batch 1 {label} {setting}: decode step {res[f'{label}_step_ms_b1{tag}']} ms")
                save()
        for b in (1, args.requests):
            res[f"gaps_b{b}"] = gaps(args, llm, prompts, names, sp, b, tp)
            log(f"  GPU time between replays, batch {b}, adapters (us, per rank): {res[f'gaps_b{b}']}")
            save()
        for b in (1, args.requests):
            lo, base = res[f"adapters_step_ms_b{b}"], res[f"base_step_ms_b{b}"]
            res[f"lora_share_b{b}"] = None if lo is None or base is None else (lo - base) / lo
        res.update(floors(args, eng, dev))
        for b in (1, args.requests):
            step = res.get(f"base_step_ms_b{b}")
            res[f"base_step_vs_floor_b{b}"] = None if step is None else step / res[f"floor_ms_b{b}"]
        log(f"  floors: batch 1 {res['floor_ms_b1']:.2f} ms, batch {args.requests} "
            f"{res[f'floor_ms_b{args.requests}']:.2f} ms (copy {res['copy_bw'] / 1e9:.0f} GB/s)")
        save()
        if tp > 1:
            res["all_reduce_ms"] = probe_all_reduces(args, eng, dev)
        save()
    finally:
        llm.close()
    return res


def probe_all_reduces(args, eng, dev) -> dict:
    """Per call and per decode step (2 x layers calls), for the decode messages of batch 1 and the full batch."""
    cfg = eng.model.cfg
    kinds = ["nccl"] + (["symm_mem"] if dev.type == "cuda" else [])
    modes = [False, True] if dev.type == "cuda" else [False]
    out = {}
    for b in (1, args.requests):
        for kind in kinds:
            for graphed in modes:
                key = f"{kind}_{'graph' if graphed else 'eager'}_b{b}"
                try:
                    ms = eng.model.time_all_reduce(kind, b * cfg.hidden_size, reps=args.reduce_reps, graphed=graphed)
                except Exception as e:                # symm_mem may be missing from this torch or this host
                    out[key] = {"error": f"{type(e).__name__}: {e}"}
                    log(f"  all-reduce {key}: failed ({e})")
                    continue
                out[key] = {"per_call_ms": ms, "per_step_ms": ms * 2 * cfg.num_layers,
                            "bytes": b * cfg.hidden_size * torch.finfo(eng.dtype).bits // 8}
                log(f"  all-reduce {key}: {1e3 * ms:.1f} us per call, {ms * 2 * cfg.num_layers:.2f} ms per step")
    return out


def _fmt(x, unit="") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if isinstance(x, float) else str(x)


def summarize(res: dict, requests: int) -> list[str]:
    one, two = res.get("13b_tp1", {}), res.get("13b_tp2", {})
    big = res.get("34b_tp2", {})

    def ratio(key):
        a, b = one.get(key), two.get(key)
        return None if not a or not b else b / a

    rows = [("decode step, batch 1, base (ms)", "base_step_ms_b1"),
            ("decode step, batch 1, with an adapter (ms)", "adapters_step_ms_b1"),
            ("decode step, batch 1, base, sampled (ms)", "base_step_ms_b1_sampled"),
            (f"decode step, batch {requests}, base, sampled (ms)", f"base_step_ms_b{requests}_sampled"),
            (f"decode step, batch {requests}, base (ms)", f"base_step_ms_b{requests}"),
            (f"decode step, batch {requests}, {res['adapters']} adapters (ms)", f"adapters_step_ms_b{requests}"),
            ("LoRA share of the step, batch 1", "lora_share_b1"),
            (f"LoRA share of the step, batch {requests}", f"lora_share_b{requests}"),
            (f"e2e output tok/s, {res['adapters']} adapters", "adapters_tok_s"),
            ("e2e output tok/s, base", "base_tok_s"),
            (f"e2e output tok/s, {res['adapters']} adapters, sampled", "adapters_tok_s_sampled"),
            ("e2e output tok/s, base, sampled", "base_tok_s_sampled"),
            ("decodes queued behind another (async scheduling)", "overlapped_iterations"),
            ("decode step floor on one GPU, batch 1 (ms)", "floor_ms_b1"),
            (f"decode step floor on one GPU, batch {requests} (ms)", f"floor_ms_b{requests}"),
            ("base decode step / floor, batch 1", "base_step_vs_floor_b1"),
            (f"base decode step / floor, batch {requests}", f"base_step_vs_floor_b{requests}")]
    def gap(r, b):
        g = r.get(f"gaps_b{b}") or {}
        ranks = sorted(k for k in g if k.endswith("_gpu_gap_us"))
        return " / ".join(_fmt(g[k]) for k in ranks) if ranks else "-"

    lines = [f"# Tensor parallelism ({res['device']}, {res['dtype']}, {res['date']})", "",
             f"Workload: {requests} requests, {res['input_len']} in / {res['output_len']} out, "
             f"{res['adapters']} adapters of ranks {res['ranks']}; all_reduce {res['all_reduce']}."]
    if one or two:
        lines += ["", "| Llama-2-13B shape | TP=1 | TP=2 | TP=2 / TP=1 |", "|---|---|---|---|"]
        lines += [f"| {label} | {_fmt(one.get(key))} | {_fmt(two.get(key))} | {_fmt(ratio(key))} |"
                  for label, key in rows]
        lines += [f"| GPU time between decode replays, batch {b}, adapters, per rank (us) | {gap(one, b)} | "
                  f"{gap(two, b)} | |" for b in (1, requests)]
        if two.get("all_reduce_chosen"):
            lines += ["", f"All-reduce at TP=2: {two['all_reduce_chosen']}."]
    ar = two.get("all_reduce_ms", {})
    if ar:
        lines += ["", "All-reduces alone at TP=2 (both ranks), per decode step (2 x layers calls):", "",
                  "| message | " + " | ".join(sorted({k.rsplit('_b', 1)[0] for k in ar})) + " |",
                  "|---|" + "---|" * len({k.rsplit('_b', 1)[0] for k in ar})]
        for b in (1, requests):
            cells = []
            for kind in sorted({k.rsplit('_b', 1)[0] for k in ar}):
                v = ar.get(f"{kind}_b{b}", {})
                cells.append(v.get("error", "")[:40] if "error" in v else
                             f"{v['per_step_ms']:.2f} ms ({1e3 * v['per_call_ms']:.0f} us/call)")
            nbytes = next((v["bytes"] for k, v in ar.items() if k.endswith(f"_b{b}") and "bytes" in v), None)
            lines.append(f"| batch {b} ({_fmt(nbytes)} B) | " + " | ".join(cells) + " |")
    if big:
        lines += ["", f"CodeLlama-34B shape at TP=2, {res['adapters']} adapters: "
                  f"{_fmt(big.get('adapters_tok_s'))} output tok/s (base {_fmt(big.get('base_tok_s'))}); "
                  f"decode step batch {requests} {_fmt(big.get(f'adapters_step_ms_b{requests}'))} ms, "
                  f"batch 1 {_fmt(big.get('adapters_step_ms_b1'))} ms."]
    huge = next((v for k, v in res.items() if k.startswith("70b_tp")), {})
    if huge:
        lines += ["", f"Llama-2-70B shape at TP={huge.get('tp', '-')}, {res['adapters']} adapters: "
                  f"{_fmt(huge.get('adapters_tok_s'))} output tok/s (base {_fmt(huge.get('base_tok_s'))}; sampled "
                  f"{_fmt(huge.get('adapters_tok_s_sampled'))} / {_fmt(huge.get('base_tok_s_sampled'))}); base decode "
                  f"step batch 1 {_fmt(huge.get('base_step_ms_b1'))} ms (floor {_fmt(huge.get('floor_ms_b1'))}), "
                  f"batch {requests} {_fmt(huge.get(f'base_step_ms_b{requests}'))} ms (floor "
                  f"{_fmt(huge.get(f'floor_ms_b{requests}'))}); with adapters batch 1 "
                  f"{_fmt(huge.get('adapters_step_ms_b1'))} ms, batch {requests} "
                  f"{_fmt(huge.get(f'adapters_step_ms_b{requests}'))} ms."]
    if "70b_tokens_equal" in res:
        lines += ["", f"70B shape cut to two layers, greedy tokens of {TOKEN_PROMPTS} requests at "
                  f"TP={res.get('70b_tokens_tp', '-')} and TP=1: "
                  f"{'equal' if res['70b_tokens_equal'] else 'DIFFERENT'}."]
    for key, r in res.items():
        if isinstance(r, dict) and "error" in r:
            lines += ["", f"{key} failed: {r['error']}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the results (tp.json and tp.md)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny random model, gloo: checks the script")
    ap.add_argument("--requests", type=int, default=None, help="default 64 (dry run: 4)")
    ap.add_argument("--input-len", type=int, default=None, help="default 512 (dry run: 12)")
    ap.add_argument("--output-len", type=int, default=None, help="default 128 (dry run: 3)")
    ap.add_argument("--adapters", type=int, default=None, help="default 32 (dry run: 2)")
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="default 8,16,32,64 (dry run: 8,16)")
    ap.add_argument("--all-reduce", choices=["auto", "nccl", "symm_mem"], default="auto",
                    help="the engines' all-reduce (auto: per message size, as timed at start-up)")
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="default: the engine's for the device")
    ap.add_argument("--reduce-reps", type=int, default=200, help="all-reduces per timing")
    ap.add_argument("--sampling", default="greedy,sampled",
                    help="decoding of the e2e workload, comma-separated: greedy (always measured, first), sampled "
                         "(temperature 0.8, top_p 0.95, top_k 50)")
    ap.add_argument("--async-scheduling", choices=["on", "off"], default="on",
                    help="the engines' async scheduling (off: the synchronous loop, for a before/after pair)")
    ap.add_argument("--configs", default="13b,34b",
                    help="which configurations to run, comma-separated: 13b (TP=1 and TP=2), 34b (TP=2), 70b-tokens "
                         "(the 70B shape cut to two layers: TP=1 and TP=4 tokens), 70b (TP=4)")
    ap.add_argument("--phase", type=int, default=None, help=argparse.SUPPRESS)      # internal: one configuration
    ap.add_argument("--adapter-root", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad = [x for x in args.sampling.split(",") if x not in ("greedy", "sampled")]
    if bad:
        ap.error(f"--sampling: unknown setting(s) {', '.join(bad)} (known: greedy, sampled)")
    args.sampling = ",".join(dict.fromkeys(["greedy"] + args.sampling.split(",")))     # greedy always, first
    dry = args.dry_run
    for name, full, small in (("requests", 64, 4), ("input_len", 512, 12), ("output_len", 128, 3),
                              ("adapters", 32, 2), ("ranks", [8, 16, 32, 64], [8, 16])):
        if getattr(args, name) is None:
            setattr(args, name, small if dry else full)
    args.device, args.dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    phases = DRY_PHASES if dry else PHASES
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase is not None:                     # a child: one configuration, its result as JSON on stdout's file
        size, model, tp = phases[args.phase]
        dirs = {p.name: str(p) for p in sorted(args.adapter_root.iterdir())}
        run = run_tokens if size == "70b-tokens" else run_phase
        run(args, model, tp, dirs, args.out / f"phase{args.phase}.json")
        return
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - {size for size, _, _ in phases})
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)} (known: 13b, 34b, 70b-tokens, 70b)")
    need = max(tp for size, _, tp in phases if size in configs)
    token_tp = max(tp for size, _, tp in phases if size == "70b-tokens")
    if not dry and torch.cuda.device_count() < need:
        sys.exit(f"bench_tp --configs {args.configs} needs {need} GPUs (or --dry-run)")
    res = dict(date=dt.date.today().isoformat(), torch=torch.__version__, dtype=args.dtype,
               device=torch.cuda.get_device_name(0) if not dry else "cpu", requests=args.requests,
               input_len=args.input_len, output_len=args.output_len, adapters=args.adapters, ranks=args.ranks,
               all_reduce=args.all_reduce)
    name = "tp" if set(args.configs.split(",")) == {"13b", "34b"} else "tp-" + args.configs.replace(",", "-")

    def write() -> list[str]:                  # after each configuration: a cut run keeps those that finished
        lines = summarize(res, args.requests)
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=2))
        (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
        return lines

    with tempfile.TemporaryDirectory(prefix="vlora-tp-") as tmp:
        written: dict[str, Path] = {}
        for i, (size, model, tp) in enumerate(phases):
            if size not in configs:
                continue
            if model not in written:
                written[model] = Path(tmp) / model.removeprefix("random:")
                write_adapters(model, args.adapters, args.ranks, written[model], getattr(torch, args.dtype))
            key = f"{size}_tp{tp}"
            log(f"== {key}: {model} at TP={tp}")
            cmd = [sys.executable, __file__, "--phase", str(i), "--adapter-root", str(written[model]),
                   "--out", str(args.out)] + sys.argv[1:]
            proc = subprocess.run(cmd)
            path = args.out / f"phase{i}.json"
            res[key] = json.loads(path.read_text()) if path.exists() else {}    # what it measured, if it failed
            path.unlink(missing_ok=True)
            if proc.returncode != 0:
                res[key]["error"] = f"exit code {proc.returncode}"
                log(f"{key} failed (exit code {proc.returncode})")
            one, many = res.get("70b-tokens_tp1", {}), res.get(f"70b-tokens_tp{token_tp}", {})
            if "tokens" in one and "tokens" in many:
                res["70b_tokens_equal"] = one["tokens"] == many["tokens"]
                res["70b_tokens_tp"] = token_tp
            write()
    lines = write()
    print("\n".join(lines))
    log(f"wrote {args.out}/{name}.json and {name}.md")


if __name__ == "__main__":
    main()
