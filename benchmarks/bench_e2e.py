"""End-to-end serving speed: vlora vs transformers (+PEFT), and decode steps against the bytes floor.

One run, one device, random weights of a Llama-2-7B-shaped model in bf16
(shapes decide speed), ``--requests`` requests of ``--input-len`` random prompt
tokens and exactly ``--output-len`` output tokens (greedy, ignore_eos), adapters
of ranks ``--ranks`` round-robin, every adapter used by the same number of
requests. Measured, in this order:

1. copy bandwidth (large device-to-device copy, bytes read + written);
2. vlora, all requests at once (continuous batching), with the engine's defaults
   (pool and batch limits sized for the device) unless options set them: with
   the adapters (unmerged, the batched LoRA op), then base model only; output
   tokens/s, time to first token (mean, p50, p90, from the moment all requests
   were added), median decode-step time inside the engine loop, and the decode forward alone
   (CUDA-graph replay, CUDA events) with and without the adapters on the same
   batch state;
3. vlora, one request: batch-1 decode step;
4. transformers alone (base model, static batch, no LoRA), then transformers +
   PEFT with every adapter loaded and a mixed ``adapter_names`` batch.

Floors: weight bytes (every weight matrix read once per step; the embedding
table is not, only its looked-up rows) / copy bandwidth; adapter bytes (the A
and B of every adapter active in the batch, all layers) / copy bandwidth; at
batch 64 the KV cache read by attention is reported as its own floor term. Prefill (the time until every
prompt has its first token): its matmul FLOPs / the dense bf16 matmul rate measured in the same run. The
engine-loop decode step less the graph replay is the host work between forwards (the GPU idles). Each run also
reports the host time of a decode step per phase (``vlora.bench.phases``) and, on CUDA, the GPU's time between
one graph replay and the next (sampling, the token copy and idle time); ``--also-sync`` repeats both runs with
async scheduling off, on the same engine.

Sampled decoding (``--sampling``, default ``greedy,sampled``): on the same engine, right after each of the
vlora runs above (with the adapters, then base only), every setting named runs the same requests back to back
with nothing timed inside the loop (no step or phase timers), each after a short warm-up of its own (on the
first run only); reported per setting: output tok/s, mean TTFT and the ratio of tok/s to greedy's on the same
engine (greedy is always measured, first). Every setting keeps ``ignore_eos`` and ``max_tokens =
--output-len``, so all do the same work:

- ``greedy``: temperature 0;
- ``sampled``: temperature 0.8, top_p 0.95, top_k 50;
- ``seeded``: sampled, with seed i for request i (distinct seeds);
- ``min_tokens``: greedy, min_tokens = --output-len;
- ``penalties``: sampled, presence, frequency and repetition penalties all 0.5 (a repetition penalty below 1
  favours repeats; what is measured is the penalties' cost) and logit_bias +1.0 on token ids 100-109;
- ``logprobs``: sampled, logprobs 5 (each token's logprob and its top 5 alternatives).

A setting that fails (the engine raises, a request fails or ends short, or ``logprobs`` brings none) is
recorded with its error and the others still run; the script then exits with status 1 after writing its results.

    python benchmarks/bench_e2e.py --out benchmarks/results            # GPU, the issue's setting
    python benchmarks/bench_e2e.py --model random:tiny-llama --device cpu --requests 4 --input-len 16 \\
        --output-len 4 --adapters 2 --ranks 8,16 --out /tmp/e2e            # CPU smoke run of the script
    python benchmarks/bench_e2e.py --model random:tiny-llama --device cpu --requests 4 --input-len 16 \\
        --output-len 4 --adapters 2 --ranks 8,16 --skip-hf --out /tmp/e2e \\
        --sampling greedy,sampled,seeded,min_tokens,penalties,logprobs  # every sampling setting, on a CPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlora import LLM, SamplingParams  # noqa: E402
from vlora.bench.baselines import PeftBaseline  # noqa: E402
from vlora.bench.phases import PhaseTimer, format_summary  # noqa: E402
from vlora.builder import profile_policy  # noqa: E402
from vlora.lora.adapter import ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402
from vlora.models.loader import RANDOM_PRESETS  # noqa: E402


SAMPLING = ("greedy", "sampled", "seeded", "min_tokens", "penalties", "logprobs")
"""The ``--sampling`` settings (see the module docstring)."""
BIAS_IDS = range(100, 110)
"""The token ids the ``penalties`` setting biases (logit_bias +1.0 each)."""


def sampling_fields(setting: str, max_tokens: int, i: int) -> dict:
    """The SamplingParams fields of request ``i`` under a ``--sampling`` setting, beside max_tokens and ignore_eos
    (their names are the OpenAI body's too; ``logit_bias`` keys are ints here)."""
    sampled = dict(temperature=0.8, top_p=0.95, top_k=50)
    fields = {"greedy": dict(temperature=0.0),
              "sampled": sampled,
              "seeded": dict(sampled, seed=i),
              "min_tokens": dict(temperature=0.0, min_tokens=max_tokens),
              "penalties": dict(sampled, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=0.5,
                                logit_bias={t: 1.0 for t in BIAS_IDS}),
              "logprobs": dict(sampled, logprobs=5)}
    if setting not in fields:
        raise ValueError(f"unknown sampling setting {setting!r} (known: {', '.join(SAMPLING)})")
    return fields[setting]


def sampling_params(setting: str, max_tokens: int, n: int) -> list[SamplingParams]:
    """One SamplingParams per request (``seeded`` gives each its own seed); ignore_eos, so all do the same work."""
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling_fields(setting, max_tokens, i))
            for i in range(n)]


def parse_sampling(text: str) -> list[str]:
    """``--sampling``: comma-separated setting names -> the list, greedy first (always measured), no repeats."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in SAMPLING]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown sampling setting(s) {', '.join(bad)} (known: {', '.join(SAMPLING)})")
    return ["greedy"] + [x for x in dict.fromkeys(names) if x != "greedy"]


def output_check(setting: str, run: dict, output_len: int) -> str | None:
    """Why a run of ``setting`` does not count (a request failed or ended short), else None; a ``logprobs`` run
    must also have brought a logprob with every output token."""
    if run["errors"]:
        return f"{len(run['errors'])} request(s) failed: {run['errors'][0]}"
    if any(n != output_len for n in run["tokens"]):
        return f"output lengths {sorted(set(run['tokens']))}, expected {output_len} each"
    if setting == "logprobs" and any(n != output_len for n in run["logprobs"]):
        return f"logprobs came back for {sorted(set(run['logprobs']))} tokens per request, expected {output_len}"
    return None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes/s (read + written) of a 1 GiB device copy (64 MiB on CPU), median of repeats."""
    n = (1 << 30) if dev.type == "cuda" else (64 << 20)
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(30 if dev.type == "cuda" else 5):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times[len(times) // 3:])


def matmul_rate(dev: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a dense square matmul (8192 on GPU, 1024 on CPU), median of repeats: the prefill floor's rate."""
    n = 8192 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    times = []
    for _ in range(20 if dev.type == "cuda" else 3):
        sync(dev)
        t0 = time.perf_counter()
        a @ b
        sync(dev)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times[len(times) // 3:])


def prefill_flops(cfg, prompt_lens: list[int]) -> float:
    """Matmul FLOPs of prefilling these prompts: every projection over every token, causal attention
    (QK^T and PV over each token's prefix), the LM head for each prompt's last token."""
    ins, outs = cfg.lora_in_out()
    per_token = 2 * cfg.num_layers * sum(ins[k] * outs[k] for k in ins)
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(n * (n + 1) // 2 for n in prompt_lens)
    head = 2 * len(prompt_lens) * cfg.hidden_size * cfg.vocab_size
    return per_token * sum(prompt_lens) + attn + head


def replay_ms(graph, dev: torch.device, reps: int = 50) -> float:
    """Median time of one CUDA-graph replay (CUDA events)."""
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


class StepTimer:
    """Wraps ``engine.step``: wall time of every step and whether it was decode-only, for the whole batch."""

    def __init__(self, engine, dev: torch.device, probe=None, probe_batch: int = 0, probe_after: int = 8):
        """``probe``: called once, after the ``probe_after``-th decode-only step of ``probe_batch`` sequences,
        while the graphs' static buffers hold a full batch mid-run (at the end of a run they hold whatever
        rows finished last, which can be fewer)."""
        self.engine, self.dev, self.steps = engine, dev, []
        self._step = engine.step
        self._probe, self._probe_batch, self._probe_after = probe, probe_batch, probe_after
        self.probe_s = 0.0              # the probe's time, taken out of the run's wall time
        self._full = 0                  # decode-only steps of probe_batch sequences so far

        def timed():
            # no device sync after the step: every step waits for its own tokens already, and with async
            # scheduling the next forward is queued when it returns (a sync would drain that queue)
            sched = engine.scheduler
            before = {s.request_id: s.num_computed for s in sched.unfinished()}
            t0 = time.perf_counter()
            out = self._step()
            dt_ = time.perf_counter() - t0
            decode_only = all(s.num_computed - before.get(s.request_id, s.num_computed) <= 1
                              for s in sched.unfinished())
            self.steps.append((dt_, len(before), decode_only and bool(out)))
            self._full += decode_only and bool(out) and len(before) == self._probe_batch
            if self._probe is not None and self._full == self._probe_after:
                t1 = time.perf_counter()
                self._probe()
                self.probe_s = time.perf_counter() - t1
                self._probe = None
            return out

        engine.step = timed

    def decode_median_ms(self, batch: int) -> float | None:
        xs = [t for t, n, d in self.steps if d and n == batch]
        return 1e3 * statistics.median(xs) if xs else None

    def close(self) -> None:
        self.engine.step = self._step


def run_offline(engine, prompts, adapters, sp, dev: torch.device) -> dict:
    """All requests at once through ``engine.step`` (continuous batching, as ``LLM.generate``): wall seconds,
    each request's time to first token (from the moment all were added), output tokens, logprobs received
    (0 where none) and the errors of the requests that failed. ``sp``: one SamplingParams, or one per request.
    If the engine raises, the run's unfinished requests are aborted (as far as it still can) before it re-raises."""
    names = adapters if isinstance(adapters, list) else [adapters] * len(prompts)
    params = sp if isinstance(sp, list) else [sp] * len(prompts)
    sync(dev)
    t0 = time.perf_counter()
    ids: list[str] = []
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    logprobs: dict[str, int] = {}
    errors: list[str] = []
    try:
        for p, a, s in zip(prompts, names, params):
            ids.append(engine.add_request(p, a, s))
        mine = set(ids)
        while len(tokens) < len(ids):
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                rid = out.request_id
                if rid not in mine:              # an aborted request of an earlier run that failed
                    continue
                if out.delta_token_ids and rid not in first:
                    first[rid] = now - t0
                if out.finished:
                    tokens[rid] = len(out.token_ids)
                    logprobs[rid] = len(getattr(out, "logprobs", None) or ())
                    if out.finish_reason == "error" or out.error:
                        errors.append(f"{rid}: {out.finish_reason}: {out.error}")
        sync(dev)
    except BaseException:
        for rid in ids:
            if rid not in tokens:
                try:
                    engine.abort(rid)
                except Exception:
                    pass
        raise
    return {"wall_s": time.perf_counter() - t0, "ttft_s": [first[r] for r in ids if r in first],
            "tokens": [tokens[r] for r in ids], "logprobs": [logprobs[r] for r in ids], "errors": errors}


def ttft_stats(xs: list[float]) -> dict:
    """Mean, p50 and p90 of times to first token (seconds)."""
    s = sorted(xs)
    return {"mean": statistics.fmean(s), "p50": s[len(s) // 2], "p90": s[min(len(s) - 1, int(0.9 * len(s)))]}


def fmt_ttft(t: dict) -> str:
    return f"mean {1e3 * t['mean']:.0f} / p50 {1e3 * t['p50']:.0f} / p90 {1e3 * t['p90']:.0f} ms"


def make_prompts(args) -> list[list[int]]:
    """``--requests`` prompts of ``--input-len`` seeded random token ids."""
    preset = RANDOM_PRESETS[args.model.removeprefix("random:")]
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, preset["vocab_size"], (args.requests, args.input_len), generator=g).tolist()


def draw_device(device: str) -> str:
    """Where random adapters are drawn: the GPU when the benchmark runs on one (seconds, against minutes on a
    busy host's CPU), else the CPU."""
    return "cuda" if device.startswith("cuda") and torch.cuda.is_available() else "cpu"


def write_adapters(args, root: Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, str], list[str]]:
    """``--adapters`` random PEFT adapters on every projection, ranks ``--ranks`` round-robin, under ``root``,
    stored in ``dtype``; returns (name -> directory, the adapter of each request: every adapter used by as many
    requests)."""
    preset = RANDOM_PRESETS[args.model.removeprefix("random:")]
    h, i = preset["hidden_size"], preset["intermediate_size"]
    q, kv = h, preset["num_key_value_heads"] * h // preset["num_attention_heads"]
    shape = ModelShape(args.model, preset["num_hidden_layers"],
                       {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": q, "gate_proj": h, "up_proj": h,
                        "down_proj": i},
                       {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": i, "up_proj": i,
                        "down_proj": h})
    log(f"writing {args.adapters} adapters (ranks {args.ranks}, all projections, {str(dtype).removeprefix('torch.')}) "
        f"under {root}")
    t0 = time.perf_counter()
    dirs = {f"a{j}": str(write_random_adapter(root / f"a{j}", shape, args.ranks[j % len(args.ranks)], seed=j,
                                              std=0.01, dtype=dtype,
                                              device=draw_device(args.device)))
            for j in range(args.adapters)}
    log(f"{args.adapters} adapters written in {time.perf_counter() - t0:.1f} s")
    return dirs, [f"a{j % args.adapters}" for j in range(args.requests)]


def weight_bytes(model) -> int:
    """Bytes of every weight a decode step reads in full (the embedding table: only B rows, left out)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed."))


def adapter_bytes(engine, names: list[str]) -> int:
    total = 0
    for name in set(names):
        for groups in engine.adapters.get(name).layers:
            for gw in groups.values():
                total += gw.a.numel() * gw.a.element_size() + sum(s.b.numel() * s.b.element_size() for s in gw.slices)
    return total


def run_vlora(args, dev, dtype, prompts, names, adapter_dirs, res) -> None:
    llm = LLM(args.model, device=str(dev), dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_batched_tokens, kv_cache_memory_gb=args.kv_gb,
              max_model_len=args.max_model_len, max_lora_rank=args.max_lora_rank or 128, check_base_model=False,
              lora_overlap=args.lora_overlap,
              lora_pdl=args.lora_pdl, async_scheduling=args.async_scheduling, policy=args.policy,
              max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes)
    eng = llm.engine
    res["engine"] = engine_settings(eng)
    log(f"vlora: {eng.model_name}, {eng.sizing.describe()}")
    t0 = time.perf_counter()
    for n, p in adapter_dirs.items():
        llm.register_adapter(n, p)
    res["vlora_register_s"] = time.perf_counter() - t0
    log(f"{len(adapter_dirs)} adapters registered in {res['vlora_register_s']:.1f} s")
    profile_policy(eng)                   # as `vlora serve` does once its adapters are registered
    res["engine"]["mode_costs_timed"] = eng.mode_costs is not None
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    log("vlora warm-up (Triton compiles, CUDA graphs capture)")
    llm.generate(prompts, names, warm)
    llm.generate(prompts, None, warm)
    llm.generate(prompts[:1], None, warm)
    graphs = eng.runner.graphs
    if graphs is not None:
        graphs.capture_all()

    wb = weight_bytes(eng.model)
    ab = adapter_bytes(eng, names)
    res.update(weight_bytes=wb, adapter_bytes=ab)
    out_tokens = len(prompts) * args.output_len
    b = len(prompts)

    def replay_full_batch():
        # base first: the LoRA graph, replayed last, rewrites the step's KV as the run computed it
        res["vlora_graph_base_ms"] = replay_ms(graphs.graphs[(graphs.bucket(b), 0, False)][0], dev)
        res["vlora_graph_lora_ms"] = replay_ms(graphs.graphs[(graphs.bucket(b), 1, False)][0], dev)
        log(f"decode forward B={b} (graph replay mid-run): with adapters {res['vlora_graph_lora_ms']:.2f} ms, "
            f"base {res['vlora_graph_base_ms']:.2f} ms")

    res["sampling_settings"] = {s: sampling_fields(s, args.output_len, 0) for s in args.sampling}
    sampling = res["sampling"] = {s: {} for s in args.sampling}
    runs = [("adapters", names), ("base", None)]
    if args.also_sync and args.async_scheduling:
        runs += [("adapters_sync", names), ("base_sync", None)]
    for label, adapters in runs:
        sc = eng.config.scheduler             # the same engine, async scheduling switched for the _sync runs
        eng.config = replace(eng.config, scheduler=replace(sc, async_scheduling=args.async_scheduling
                                                           and not label.endswith("_sync")))
        probe = replay_full_batch if graphs is not None and label == "adapters" else None
        timer = StepTimer(eng, dev, probe, b, probe_after=min(8, args.output_len // 2))
        phases = PhaseTimer(eng)
        run = run_offline(eng, prompts, adapters, sp, dev)
        phases.close()
        timer.close()
        res[f"vlora_{label}_phases"] = phases.summary(b)
        log(f"vlora {label}: decode step (B={b}) host phases, median: {format_summary(res[f'vlora_{label}_phases'])}")
        assert all(n == args.output_len for n in run["tokens"])
        wall = run["wall_s"] - timer.probe_s      # every first token came before the probe
        step = timer.decode_median_ms(b)
        res[f"vlora_{label}_tok_s"] = out_tokens / wall
        res[f"vlora_{label}_wall_s"] = wall
        res[f"vlora_{label}_decode_step_ms"] = step
        res[f"vlora_{label}_ttft_s"] = ttft_stats(run["ttft_s"])
        res[f"vlora_{label}_prefill_s"] = max(run["ttft_s"])     # every prompt prefilled
        log(f"vlora {label}: {out_tokens / wall:.0f} output tok/s ({wall:.2f} s), TTFT "
            f"{fmt_ttft(res[f'vlora_{label}_ttft_s'])}, decode step (B={b}) "
            f"{step if step is None else round(step, 2)} ms, {len(timer.steps)} steps")
        if label in ("adapters", "base"):     # the sampling settings, on this engine, before the next run
            run_sampling(args, eng, dev, prompts, adapters, label, sampling, warm_up=label == runs[0][0])
    res["prefill_flops"] = prefill_flops(eng.model.cfg, [len(p) for p in prompts])
    res["matmul_flops_s"] = matmul_rate(dev, dtype)
    kv_tok = 2 * eng.model.cfg.num_layers * eng.model.cfg.kv_size * torch.finfo(dtype).bits // 8
    res["kv_bytes_last_step"] = kv_tok * len(prompts) * (args.input_len + args.output_len)
    # batch 1
    timer = StepTimer(eng, dev)
    llm.generate(prompts[:1], None, sp)
    timer.close()
    res["vlora_b1_decode_step_ms"] = timer.decode_median_ms(1)
    if graphs is not None:
        res["vlora_b1_graph_ms"] = replay_ms(graphs.graphs[(1, 0, False)][0], dev)
        res["graph_replays"] = graphs.num_replays
    log(f"vlora batch 1: decode step {res['vlora_b1_decode_step_ms']:.2f} ms (engine loop), "
        f"forward {res.get('vlora_b1_graph_ms', float('nan')):.2f} ms (graph replay)")


def run_sampling(args, eng, dev, prompts, adapters, label: str, sampling: dict, warm_up: bool) -> None:
    """Every ``--sampling`` setting on this engine, back to back, nothing timed inside the loop: output tok/s,
    mean TTFT and wall time into ``sampling[setting]`` under ``label``, or the setting's error into its
    ``error``. ``warm_up``: each non-greedy setting first runs 4 tokens (its first use may compile)."""
    out_tokens = len(prompts) * args.output_len
    for setting in args.sampling:
        entry = sampling[setting]
        try:
            if warm_up and setting != "greedy":
                run_offline(eng, prompts, adapters, sampling_params(setting, 4, len(prompts)), dev)
            run = run_offline(eng, prompts, adapters, sampling_params(setting, args.output_len, len(prompts)), dev)
            error = output_check(setting, run, args.output_len)
        except Exception as e:                   # the engine raised: record it, go on with the next setting
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            entry.setdefault("error", {})[label] = error
            log(f"vlora {label}, sampling {setting}: FAILED: {error}")
            continue
        entry[label] = out_tokens / run["wall_s"]
        entry.setdefault("ttft_mean_s", {})[label] = statistics.fmean(run["ttft_s"])
        entry.setdefault("wall_s", {})[label] = run["wall_s"]
        greedy = sampling["greedy"].get(label)
        ratio = f" = {entry[label] / greedy:.2f}x greedy" if greedy else ""
        log(f"vlora {label}, sampling {setting}: {entry[label]:.0f} output tok/s ({run['wall_s']:.2f} s){ratio}, "
            f"TTFT mean {1e3 * entry['ttft_mean_s'][label]:.0f} ms")


def sampling_table(res: dict) -> list[str]:
    """The ``sampling`` section's ratios to greedy (computed here, into it) and its table's lines."""
    sampling = res.get("sampling") or {}
    if not sampling:
        return []
    labels = ("adapters", "base")
    greedy = sampling.get("greedy", {})
    lines = [f"sampled decoding, {res['requests']} requests of {res['input_len']}/{res['output_len']} tokens: "
             f"output tok/s, x greedy on the same engine, mean TTFT",
             f"  {'setting':<11}" + "".join(f"{label:>32}" for label in labels)]
    for setting, entry in list(sampling.items()):
        entry["ratio_to_greedy"] = {label: entry[label] / greedy[label] for label in labels
                                    if label in entry and greedy.get(label)}
        keys = (*labels, "ratio_to_greedy", "ttft_mean_s", "wall_s", "error")        # the JSON's order
        sampling[setting] = entry = {k: entry[k] for k in keys if k in entry}
        cells = []
        for label in labels:
            if label in entry:
                ratio = entry["ratio_to_greedy"].get(label)
                ratio = "     -" if ratio is None else f"{ratio:5.2f}x"
                cells.append(f"{entry[label]:8.0f} tok/s {ratio} {1e3 * entry['ttft_mean_s'][label]:6.0f} ms")
            else:
                cells.append("FAILED" if label in entry.get("error", {}) else "-")
        lines.append(f"  {setting:<11}" + "".join(f"{c:>32}" for c in cells))
    for setting, entry in sampling.items():
        for label, error in entry.get("error", {}).items():
            lines.append(f"  {setting} ({label}) failed: {error}")
    return lines


def engine_settings(eng) -> dict:
    """The engine settings that decide speed, as served (defaults resolved)."""
    c = eng.config
    return dict(max_num_seqs=c.scheduler.max_num_seqs, max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
                max_model_len=eng.max_model_len, pool_gib=round(eng.sizing.pool_bytes / 2**30, 2),
                pool_source=eng.sizing.source, lora_overlap=c.lora.lora_overlap, lora_pdl=c.lora.lora_pdl,
                max_lora_rank=c.lora.max_lora_rank, policy=c.scheduler.policy,
                max_prefill_tokens_with_decodes=eng.scheduler.config.max_prefill_tokens_with_decodes,
                mode_costs_timed=eng.mode_costs is not None)


def hf_model(args, dev: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    name = args.model.removeprefix("random:")
    cfg = LlamaConfig(**RANDOM_PRESETS[name], bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def run_hf(args, dev, dtype, prompts, names, adapter_dirs, res) -> None:
    model = hf_model(args, dev, dtype)
    out_tokens = len(prompts) * args.output_len
    systems = [("hf_base", None)] + ([] if args.skip_peft else [("peft", adapter_dirs)])
    for label, adapters in systems:
        base = PeftBaseline(model, adapters, pad_token_id=0)
        req_names = names if adapters else [None] * len(prompts)
        log(f"{label}: warm-up")
        base.generate(prompts[:2], req_names[:2], 2, 2)
        sync(dev)
        t0 = time.perf_counter()
        outs = base.generate(prompts, req_names, args.output_len, len(prompts))
        sync(dev)
        wall = time.perf_counter() - t0
        assert all(len(o) == args.output_len for o in outs)
        res[f"{label}_tok_s"] = out_tokens / wall
        res[f"{label}_wall_s"] = wall
        log(f"{label}: {out_tokens / wall:.1f} output tok/s ({wall:.2f} s)")
        model = base.model.unload() if adapters else base.model      # peft: back to the plain model
    del model
    gc.collect()


def summarize(res: dict) -> list[str]:
    bw = res["copy_bw"]
    lines = []
    wf = 1e3 * res["weight_bytes"] / bw
    af = 1e3 * res["adapter_bytes"] / bw
    kvf = 1e3 * res["kv_bytes_last_step"] / bw
    res.update(weight_floor_ms=wf, adapter_floor_ms=af, kv_floor_ms=kvf)
    if "hf_base_tok_s" in res:
        res["vlora_adapters_vs_hf_base"] = res["vlora_adapters_tok_s"] / res["hf_base_tok_s"]
        lines.append(f"vlora unmerged, {res['num_adapters']} adapters: {res['vlora_adapters_tok_s']:.0f} tok/s = "
                     f"{res['vlora_adapters_vs_hf_base']:.2f}x transformers base-only "
                     f"({res['hf_base_tok_s']:.0f} tok/s; target >= 2)")
    if "peft_tok_s" in res:
        res["vlora_adapters_vs_peft"] = res["vlora_adapters_tok_s"] / res["peft_tok_s"]
        lines.append(f"  = {res['vlora_adapters_vs_peft']:.1f}x transformers+PEFT mixed adapters "
                     f"({res['peft_tok_s']:.1f} tok/s; target >= 60)")
    if res.get("vlora_b1_graph_ms"):
        res["b1_vs_floor"] = res["vlora_b1_graph_ms"] / wf
        lines.append(f"batch-1 decode forward {res['vlora_b1_graph_ms']:.2f} ms vs weight floor {wf:.2f} ms = "
                     f"{res['b1_vs_floor']:.2f}x (target <= 1.25); engine-loop step "
                     f"{res['vlora_b1_decode_step_ms']:.2f} ms")
    if res.get("vlora_graph_lora_ms"):
        extra = res["vlora_graph_lora_ms"] - res["vlora_graph_base_ms"]
        res["lora_extra_ms"] = extra
        res["lora_extra_vs_floor"] = extra / af
        lines.append(f"batch-{res['requests']} decode forward: base {res['vlora_graph_base_ms']:.2f} ms (weight floor "
                     f"{wf:.2f} + KV floor {kvf:.2f} = {wf + kvf:.2f} ms), with adapters "
                     f"{res['vlora_graph_lora_ms']:.2f} ms: extra {extra:.2f} ms vs adapter floor {af:.2f} ms = "
                     f"{res['lora_extra_vs_floor']:.2f}x (target <= 1.5)")
    if res.get("prefill_flops") and res.get("vlora_base_prefill_s"):
        floor = res["prefill_flops"] / res["matmul_flops_s"]
        res["prefill_floor_s"] = floor
        for label in ("base", "adapters"):
            res[f"{label}_prefill_vs_floor"] = res[f"vlora_{label}_prefill_s"] / floor
        lines.append(f"prefill of {res['requests']} x {res['input_len']} tokens (last first token): base "
                     f"{res['vlora_base_prefill_s']:.3f} s, with adapters {res['vlora_adapters_prefill_s']:.3f} s vs "
                     f"compute floor {floor:.3f} s ({res['prefill_flops'] / 1e12:.0f} TFLOP at "
                     f"{res['matmul_flops_s'] / 1e12:.0f} TFLOP/s dense matmul) = {res['base_prefill_vs_floor']:.2f}x / "
                     f"{res['adapters_prefill_vs_floor']:.2f}x (target <= 1.3)")
    for label in ("base", "adapters", "base_sync", "adapters_sync"):
        graph = res.get(f"vlora_graph_{'lora' if label.startswith('adapters') else 'base'}_ms")
        step = res.get(f"vlora_{label}_decode_step_ms")
        if graph and step:            # the GPU idles while the host finishes one step and prepares the next
            res[f"{label}_host_gap_ms"] = step - graph
            gap = res.get(f"vlora_{label}_phases", {}).get("gpu_gap_us")
            between = "" if gap is None else f"; GPU time between graph replays {gap:.0f} us (median; target < 500)"
            lines.append(f"batch-{res['requests']} decode, {label}: engine-loop step {step:.2f} ms vs forward "
                         f"{graph:.2f} ms: {step - graph:.2f} ms ({(step - graph) / step:.0%}) not in the "
                         f"forward{between}")
    return lines + sampling_table(res)


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        log("matplotlib is not installed: no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    systems = [(k, res.get(f"{k}_tok_s")) for k in ("vlora_adapters", "vlora_base", "hf_base", "peft")]
    systems = [(k, v) for k, v in systems if v]
    a1.bar([k.replace("_", "\n") for k, _ in systems], [v for _, v in systems], color="tab:blue")
    a1.set_yscale("log")
    a1.set_ylabel("output tokens/s (log)")
    a1.set_title(f"{res['requests']} requests, {res['input_len']}/{res['output_len']} tokens")
    bars = []
    if res.get("vlora_b1_graph_ms"):
        bars += [("B=1 forward", res["vlora_b1_graph_ms"], res["weight_floor_ms"])]
    if res.get("vlora_graph_base_ms"):
        bars += [(f"B={res['requests']} base", res["vlora_graph_base_ms"], res["weight_floor_ms"] + res["kv_floor_ms"]),
                 (f"B={res['requests']} LoRA extra", res["lora_extra_ms"], res["adapter_floor_ms"])]
    if bars:
        x = range(len(bars))
        a2.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="measured")
        a2.bar([i + 0.2 for i in x], [b[2] for b in bars], 0.4, label="bytes floor")
        a2.set_xticks(list(x), [b[0] for b in bars])
        a2.set_ylabel("ms")
        a2.legend()
        a2.set_title("decode step vs floor")
    fig.suptitle(f"{res['model']} {res['dtype']} on {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:llama-2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="unified pool (KV + adapters), GiB (default: the engine's, sized for the device)")
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="default: the engine's for the device")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's for the device")
    ap.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                    help="prompt tokens an iteration takes beside decodes (default: the engine's; the token budget "
                         "for no separate bound)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="default: the engine's")
    ap.add_argument("--lora-overlap", choices=["off", "shrink", "full"], default="full",
                    help="LoRA kernels beside the base projection (the engine's lora_overlap)")
    ap.add_argument("--lora-pdl", action=argparse.BooleanOptionalAction, default=True,
                    help="LoRA expand as a programmatic dependent of its shrink (the engine's lora_pdl)")
    ap.add_argument("--policy", choices=("unmerged", "vlora", "merged-only", "dlora"), default="unmerged",
                    help="the engine's inference-mode policy (vlora: the modes timed after the adapters register)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="queue each decode behind the one in flight (the engine's async_scheduling)")
    ap.add_argument("--also-sync", action="store_true",
                    help="repeat both vlora runs with async scheduling off, on the same engine (before/after)")
    ap.add_argument("--skip-peft", action="store_true", help="leave out the transformers+PEFT mixed run")
    ap.add_argument("--skip-hf", action="store_true", help="leave out both transformers runs")
    ap.add_argument("--sampling", type=parse_sampling, default=parse_sampling("greedy,sampled"),
                    help=f"sampling settings measured on the same engine, comma-separated, of {','.join(SAMPLING)} "
                         f"(default greedy,sampled; greedy is always measured)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    res = dict(date=dt.date.today().isoformat(), device=gpu, model=args.model, dtype=args.dtype,
               requests=args.requests, input_len=args.input_len, output_len=args.output_len,
               num_adapters=args.adapters, ranks=args.ranks, torch=torch.__version__)
    res["copy_bw"] = copy_bandwidth(dev)
    log(f"{gpu}: copy bandwidth {res['copy_bw'] / 1e9:.0f} GB/s")

    prompts = make_prompts(args)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dirs, names = write_adapters(args, Path(tmp), dtype)     # the files in the model's dtype
        run_vlora(args, dev, dtype, prompts, names, adapter_dirs, res)
        gc.collect()                          # the engine is unreachable now: give its memory back
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            log(f"GPU memory in use after vlora: {torch.cuda.memory_allocated(dev) / 2**30:.2f} GiB")
        if not args.skip_hf:
            run_hf(args, dev, dtype, prompts, names, adapter_dirs, res)
    lines = summarize(res)
    for line in lines:
        log(line)
    tag = gpu.lower().replace(" ", "-")
    (args.out / f"e2e-{tag}.json").write_text(json.dumps(res, indent=2))
    plot(res, args.out / f"e2e-{tag}.png")
    log(f"wrote {args.out}/e2e-{tag}.json and .png")
    failed = [s for s, entry in res["sampling"].items() if entry.get("error")]
    if failed:
        log(f"sampling settings that failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
