"""Serving speed over HTTP: ``vlora serve`` with its defaults, driven like a user's client, against the offline engine.

The workload is ``bench_e2e.py``'s: random weights of a Llama-2-7B-shaped model,
``--requests`` requests of ``--input-len`` random prompt tokens and exactly
``--output-len`` output tokens (greedy, ignore_eos), ``--adapters`` random
adapters of ranks ``--ranks`` round-robin, every adapter used by as many
requests; then the same requests on the base model. In one run:

1. the offline engine in this process (``Engine`` with the defaults, all
   requests added at once, ``step`` until done), then freed;
2. ``python -m vlora.cli serve --model M --adapter ...`` with no tuning flags,
   sent every request at once as a streaming ``/v1/completions`` with a
   token-id prompt (each stream chunk carries its ``token_ids``), one HTTP
   connection per request.

Reported per system and label (adapters, base): output tokens/s (all output
tokens over the time from the first request sent to the last token received)
and time to first token (mean, p50, p90; offline: from the moment all requests
were added), and HTTP / offline ratios; for the server, the CPU time of its
event-loop thread (HTTP, JSON, SSE) and of its other threads (the engine) per
output token. Writes ``serve-<device>.json`` and ``serve-<device>.png`` (output tok/s and mean TTFT, offline
and each server).

Sampled decoding (``--sampling``, default ``greedy,sampled``; the settings of ``bench_e2e.py``: greedy,
sampled, seeded, min_tokens, penalties, logprobs): each label runs every setting named, back to back, in both
systems (greedy always, first); over HTTP each request's body carries the setting's fields (temperature,
top_p, top_k, seed, min_tokens, presence_penalty, frequency_penalty, repetition_penalty, logit_bias with
string keys, logprobs), offline the same SamplingParams. Reported per setting and label: both systems' output
tok/s and TTFT and the HTTP / offline ratios (the greedy figures also where they were before: ``offline``,
``http`` and ``<label>_http_over_offline_*``). A setting that fails in one system (an error, a short stream, or
``logprobs`` without logprobs) is recorded with its error and the others still run; the script then exits with
status 1 after writing its results.

    python benchmarks/bench_serve.py --out benchmarks/results                      # GPU, the issue's setting
    python benchmarks/bench_serve.py --model random:tiny-llama --device cpu --out /tmp/serve   # small, on a CPU
    python benchmarks/bench_serve.py --model random:tiny-llama --device cpu --requests 8 --adapters 4 \\
        --sampling greedy,sampled,seeded,min_tokens,penalties,logprobs --out /tmp/serve     # every setting, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from bench_e2e import (SAMPLING, fmt_ttft, log, make_prompts, output_check, parse_sampling,  # noqa: E402
                       run_offline, sampling_fields, sampling_params, ttft_stats, write_adapters)

from vlora import SamplingParams  # noqa: E402
from vlora.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig  # noqa: E402
from vlora.bench.processes import descendants  # noqa: E402
from vlora.builder import build_engine  # noqa: E402

LABELS = ("adapters", "base")


def openai_fields(setting: str, max_tokens: int, i: int) -> dict:
    """The body fields of request ``i`` under a ``--sampling`` setting (logit_bias keys as strings, as in JSON)."""
    fields = dict(sampling_fields(setting, max_tokens, i))
    if "logit_bias" in fields:
        fields["logit_bias"] = {str(t): b for t, b in fields["logit_bias"].items()}
    return fields


def offline(args, prompts, names, adapter_dirs) -> dict:
    """The offline engine with the server's defaults: {setting: {label: output tok/s and TTFT, or its error}}."""
    engine = build_engine(EngineConfig(model=ModelConfig(model=args.model, device=args.device, dtype=args.dtype),
                                 cache=CacheConfig(), lora=LoRAConfig(check_base_model=False)))
    log(f"offline engine: {engine.sizing.describe()}")
    for name, path in adapter_dirs.items():
        engine.adapters.register(name, path)
    # stepped on a thread of its own, as the server's engine: on a 2-core CPU, stepping on the thread that built
    # the engine measured many times slower (torch's intra-op threads), which would flatter the server
    with ThreadPoolExecutor(1) as pool:
        out = pool.submit(_offline_runs, args, engine, prompts, names).result()
    dev = engine.device
    del engine
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _offline_runs(args, engine, prompts, names) -> dict:
    dev = engine.device
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    run_offline(engine, prompts, names, warm, dev)
    run_offline(engine, prompts, None, warm, dev)
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.capture_all()
    out = {setting: {} for setting in args.sampling}
    for label in LABELS:
        adapters = names if label == "adapters" else None
        for setting in args.sampling:
            try:
                if label == LABELS[0] and setting != "greedy":       # its first use may compile
                    run_offline(engine, prompts, adapters, sampling_params(setting, 4, len(prompts)), dev)
                runs, error = [], None
                for _ in range(args.repeat):
                    run = run_offline(engine, prompts, adapters,
                                      sampling_params(setting, args.output_len, len(prompts)), dev)
                    error = error or output_check(setting, run, args.output_len)
                    runs.append({"tok_s": sum(run["tokens"]) / run["wall_s"], "wall_s": run["wall_s"],
                                 "ttft_s": ttft_stats(run["ttft_s"])})
            except Exception as e:               # the engine raised: record it, go on with the next setting
                error = f"{type(e).__name__}: {e}"
            if error is not None:
                out[setting][label] = {"error": error}
                log(f"offline {label}, {setting}: FAILED: {error}")
                continue
            r = out[setting][label] = median_run(runs)
            log(f"offline {label}, {setting}: {r['tok_s']:.0f} output tok/s, TTFT {fmt_ttft(r['ttft_s'])}")
    return out


def thread_cpu_s(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds (user + system) of every thread of process ``pid`` and of the processes under it (the engine's
    process, by default), by (process id, thread id) (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in [pid, *descendants(pid)]:
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[p, int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_split(pid: int, before: dict[tuple[int, int], float], tokens: int) -> dict:
    """The server's CPU time since ``before``: its main thread (the event loop: HTTP, JSON, SSE), the rest of its
    process, the processes under it (the engine's: the engine thread, torch's workers, the relay), and
    ``other_threads`` (everything but the event loop), in seconds and in microseconds per output token."""
    after = thread_cpu_s(pid)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    loop = delta.get((pid, pid), 0.0)
    server_rest = sum(v for (p, t), v in delta.items() if p == pid and t != pid)
    engine = sum(v for (p, _), v in delta.items() if p != pid)
    out = {"event_loop_s": loop, "server_other_threads_s": server_rest, "engine_process_s": engine,
           "other_threads_s": server_rest + engine}
    for key in list(out):
        out[key.removesuffix("_s") + "_us_per_token"] = 1e6 * out[key] / tokens
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, adapter_dirs: dict[str, str], port: int, serve_args: str | None = None) -> subprocess.Popen:
    """``vlora serve`` with ``serve_args`` (default: ``args.serve_args``)."""
    serve_args = args.serve_args if serve_args is None else serve_args
    prof = ["-m", "cProfile", "-o", str(args.profile)] if args.profile else []
    cmd = [sys.executable, *prof, "-m", "vlora.cli", "serve", "--model", args.model, "--device", args.device,
           "--dtype", args.dtype, "--port", str(port), "--log-level", "warning", "--no-check-base-model"]
    cmd += [x for name, path in adapter_dirs.items() for x in ("--adapter", f"{name}={path}")]
    cmd += shlex.split(serve_args)
    log("starting: " + " ".join(cmd[:12 + len(prof)]) + f" ... ({len(adapter_dirs)} adapters) {serve_args}")
    return subprocess.Popen(cmd, cwd=ROOT.parent)


async def wait_healthy(client, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except Exception:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Ask the server to shut down (``sig``), killing it if it has not exited within a minute."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def stream_chunks(client, body: dict):
    """The data chunks of one streaming ``/v1/completions``: yields (``time.perf_counter()`` when the chunk
    arrived, tokens it carries, the chunk). Raises on an HTTP error or an error in the stream."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()       # before parsing: the JSON's cost is not the server's
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            yield now, sum(len(c.get("token_ids") or ()) for c in chunk["choices"]), chunk


async def one_stream(client, body: dict, t0: float) -> tuple[float | None, float, int, int]:
    """(time to first token, time of the last chunk, output tokens, tokens with a logprob) of one streaming
    completion."""
    first, tokens, logprobs = None, 0, 0
    async for now, n, chunk in stream_chunks(client, body):
        if n and first is None:
            first = now - t0
        tokens += n
        for c in chunk["choices"]:       # completions' logprobs: {"tokens", "token_logprobs", ...} per chunk
            lp = c.get("logprobs")
            if isinstance(lp, dict):
                logprobs += len(lp.get("token_logprobs") or lp.get("content") or ())
    return first, time.perf_counter() - t0, tokens, logprobs


async def drive(client, prompts, models, max_tokens: int, setting: str = "greedy") -> dict:
    """Every request at once, each with ``setting``'s fields; output tok/s over first send to last token, TTFTs,
    each stream's tokens and logprobs. If a stream fails, the first error is raised once all have ended."""
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(one_stream(client, {"model": m, "prompt": p, "max_tokens": max_tokens,
                                                      "ignore_eos": True, "stream": True,
                                                      **openai_fields(setting, max_tokens, i)}, t0)
                                  for i, (p, m) in enumerate(zip(prompts, models))), return_exceptions=True)
    failed = [r for r in runs if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(runs)} streams failed, the first: {failed[0]}")
    wall = max(end for _, end, _, _ in runs)
    tokens = [n for _, _, n, _ in runs]
    return {"tok_s": sum(tokens) / wall, "wall_s": wall, "tokens": tokens, "logprobs": [n for *_, n in runs],
            "ttft_s": ttft_stats([f for f, _, _, _ in runs if f is not None])}


def median_run(runs: list[dict]) -> dict:
    """The run of median output tok/s (the lower middle one of an even count), with every run's tok/s."""
    ranked = sorted(runs, key=lambda r: r["tok_s"])
    r = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        r["runs_tok_s"] = [x["tok_s"] for x in runs]
    return r


async def over_http(args, prompts, names, adapter_dirs, base_name: str, serve_args: str) -> dict:
    import httpx

    port = free_port()
    proc = start_server(args, adapter_dirs, port, serve_args)
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    out = {}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                     timeout=httpx.Timeout(args.request_timeout)) as client:
            t = time.perf_counter()
            await wait_healthy(client, proc, args.start_timeout)
            out["start_s"] = time.perf_counter() - t
            log(f"server healthy after {out['start_s']:.1f} s")
            models = {"adapters": names, "base": [base_name] * len(prompts)}
            for label in LABELS:                      # warm-up: compiles, graph captures
                await drive(client, prompts, models[label], 4)
            out["sampling"] = {setting: {} for setting in args.sampling}
            for label in LABELS:
                for setting in args.sampling:
                    try:
                        if label == LABELS[0] and setting != "greedy":    # its first use may compile
                            await drive(client, prompts, models[label], 4, setting)
                        runs, error = [], None
                        for _ in range(args.repeat):
                            before = thread_cpu_s(proc.pid)
                            r = await drive(client, prompts, models[label], args.output_len, setting)
                            r["server_cpu"] = cpu_split(proc.pid, before, sum(r["tokens"]))
                            error = error or output_check(setting, {"errors": [], **r}, args.output_len)
                            runs.append(r)
                        r = median_run(runs)
                    except Exception as e:       # refused or failed: record it, go on with the next setting
                        error = f"{type(e).__name__}: {e}"
                    if error is not None:
                        out["sampling"][setting][label] = {"error": error}
                        log(f"HTTP {label}, {setting}: FAILED: {error}")
                        continue
                    r.pop("tokens")
                    r.pop("logprobs")
                    out["sampling"][setting][label] = r
                    c = r["server_cpu"]
                    log(f"HTTP {label}, {setting}: {r['tok_s']:.0f} output tok/s"
                        + (f" (median of {', '.join(f'{x:.0f}' for x in r['runs_tok_s'])})" if 'runs_tok_s' in r
                           else "") + f", TTFT {fmt_ttft(r['ttft_s'])}; CPU per output token: server event loop "
                        f"{c['event_loop_us_per_token']:.0f} us, its other threads "
                        f"{c['server_other_threads_us_per_token']:.0f} us, engine process "
                        f"{c['engine_process_us_per_token']:.0f} us")
    finally:      # profiled, SIGINT: uvicorn re-raises the signal after its shutdown, and cProfile writes its
        stop_server(proc, signal.SIGINT if args.profile else signal.SIGTERM)   # stats on KeyboardInterrupt only
    return out


def ratios(res: dict) -> list[str]:
    """HTTP / offline per setting and label into ``res["sampling"]`` (greedy's also where they were before), and
    the table's lines."""
    lines = [f"{res['requests']} requests of {res['input_len']}/{res['output_len']} tokens: output tok/s offline "
             f"-> over HTTP (HTTP / offline), per sampling setting",
             f"  {'setting':<11}" + "".join(f"{label:>30}" for label in LABELS)]
    failures, notes = [], []
    for setting, entry in res["sampling"].items():
        cells = []
        for label in LABELS:
            h, o = entry["http"].get(label, {}), entry.get("offline", {}).get(label, {})
            for system, r in (("offline", o), ("HTTP", h)):
                if "error" in r:
                    failures.append(f"  {setting} ({label}, {system}) failed: {r['error']}")
            if "tok_s" in h and "tok_s" in o:
                entry.setdefault("http_over_offline_tok_s", {})[label] = h["tok_s"] / o["tok_s"]
                entry.setdefault("http_over_offline_ttft_mean", {})[label] = h["ttft_s"]["mean"] / o["ttft_s"]["mean"]
                notes.append(f"  {label}, {setting}: HTTP / offline = {entry['http_over_offline_tok_s'][label]:.2f} x "
                             f"output tok/s (target >= 0.95), {entry['http_over_offline_ttft_mean'][label]:.2f} x mean "
                             f"TTFT (target <= 1.1)")
                cells.append(f"{o['tok_s']:.0f} -> {h['tok_s']:.0f} ({entry['http_over_offline_tok_s'][label]:.2f}x)")
            else:
                cells.append(" / ".join(f"{n} {'FAILED' if 'error' in r else '-' if not r else round(r['tok_s'])}"
                                        for n, r in (("offline", o), ("HTTP", h))))
        lines.append(f"  {setting:<11}" + "".join(f"{c:>30}" for c in cells))
    greedy = res["sampling"].get("greedy", {})
    for label in LABELS:                          # where the greedy figures were before --sampling
        for key in ("tok_s", "ttft_mean"):
            if label in greedy.get(f"http_over_offline_{key}", {}):
                res[f"{label}_http_over_offline_{key}"] = greedy[f"http_over_offline_{key}"][label]
    return lines + notes + failures


def plot(res: dict, path: Path) -> None:
    """Output tok/s and mean TTFT per label and sampling setting: offline, then each server, the HTTP / offline
    ratio over each server's bar."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = res.get("variants") or {"HTTP": res}
    cases = [(label, s) for label in LABELS for s in res["sampling"]]
    systems = ["offline", *servers]
    width = 0.8 / len(systems)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for ax, key, unit in ((axes[0], "tok_s", "output tok/s"), (axes[1], "ttft", "mean TTFT (ms)")):
        for i, system in enumerate(systems):
            values, ratios_ = [], []
            for label, setting in cases:
                entry = res["sampling"][setting] if system == "offline" else servers[system]["sampling"][setting]
                r = entry.get("offline" if system == "offline" else "http", {}).get(label, {})
                value = r.get("tok_s") if key == "tok_s" else 1e3 * r["ttft_s"]["mean"] if "ttft_s" in r else None
                values.append(float("nan") if value is None else value)
                ratio = entry.get(f"http_over_offline_{'tok_s' if key == 'tok_s' else 'ttft_mean'}", {}).get(label)
                ratios_.append(None if system == "offline" else ratio)
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(cases))]
            bars = ax.bar(xs, values, width, label=system)
            for bar, ratio in zip(bars, ratios_):
                if ratio is not None:
                    ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(cases)), [f"{label}\n{setting}" for label, setting in cases])
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"HTTP against offline: {res['model']}, {res['requests']} requests of {res['input_len']}/"
                 f"{res['output_len']} tokens, {res['device']} (over the bars: HTTP / offline)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_variants(text: str) -> list[tuple[str, str]]:
    """``NAME=OPTIONS;...`` as (name, options) pairs; empty: one server, named "default", with no options added."""
    if not text.strip():
        return [("default", "")]
    out = []
    for part in text.split(";"):
        name, sep, extra = part.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--variants: expected NAME=OPTIONS, got {part!r}")
        out.append((name.strip(), extra.strip()))
    if len({n for n, _ in out}) != len(out):
        raise SystemExit("--variants: names must differ")
    return out


def assemble(base: dict, offline_runs: dict | None, variants: dict, settings) -> tuple[dict, list[str]]:
    """The results of the servers run so far: the first one's figures at the top level (where they were before
    --variants), each one's under ``variants`` when there are several; and the report's lines."""
    res, lines = dict(base), []
    for i, (name, http) in enumerate(variants.items()):
        one = dict(base, sampling={s: {"http": http["sampling"][s]} for s in settings})
        if offline_runs is not None:
            for s in settings:
                one["sampling"][s]["offline"] = offline_runs[s]
        if len(variants) > 1:
            lines.append(f"server {name!r} ({http['serve_args'] or 'its defaults'}):")
        lines += ratios(one)
        if i == 0:
            res.update(one)
            # the greedy figures where they were before --sampling: offline, http, <label>_http_over_offline_*
            if offline_runs is not None:
                res["offline"] = {label: r for label, r in offline_runs["greedy"].items() if "error" not in r}
            res["http"] = {"start_s": http["start_s"], **{label: r for label, r in http["sampling"]["greedy"].items()
                                                          if "error" not in r}}
        if len(variants) > 1:
            res.setdefault("variants", {})[name] = {"serve_args": http["serve_args"], "start_s": http["start_s"],
                                                    **{k: v for k, v in one.items() if k not in base}}
    return res, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:llama-2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 512 on CUDA, 64 on CPU)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens (default 128 on CUDA, 32 on CPU)")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    ap.add_argument("--serve-args", default="", help="extra `vlora serve` options (default: none, its defaults)")
    ap.add_argument("--variants", default="",
                    help="servers to compare on the same requests, one after another: NAME=OPTIONS pairs separated "
                         "by ';' (OPTIONS added to --serve-args), e.g. 'process=;thread=--no-engine-process'; the "
                         "first fills the top-level HTTP figures (default: one server, --serve-args)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each measurement, offline and over HTTP; the run of median tok/s is reported")
    ap.add_argument("--skip-offline", action="store_true", help="leave out the offline engine")
    ap.add_argument("--sampling", type=parse_sampling, default=parse_sampling("greedy,sampled"),
                    help=f"sampling settings, comma-separated, of {','.join(SAMPLING)} (default greedy,sampled; "
                         f"greedy is always measured); each runs in both systems")
    ap.add_argument("--profile", type=Path, default=None,
                    help="run the server under cProfile (its main thread: the event loop), stats written here")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the server's /health")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.input_len = args.input_len or (512 if cuda else 64)
    args.output_len = args.output_len or (128 if cuda else 32)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    res = dict(date=dt.date.today().isoformat(), device=gpu, model=args.model, requests=args.requests,
               input_len=args.input_len, output_len=args.output_len, num_adapters=args.adapters, ranks=args.ranks,
               serve_args=args.serve_args, torch=torch.__version__)
    prompts = make_prompts(args)
    base_name = "random-" + args.model.removeprefix("random:")
    res["sampling_settings"] = {s: openai_fields(s, args.output_len, 0) for s in args.sampling}
    res["repeat"] = args.repeat
    path = args.out / f"serve-{gpu.lower().replace(' ', '-')}.json"
    with tempfile.TemporaryDirectory() as tmp:
        # the files in the dtype the server loads them in (auto: bf16 on CUDA)
        adapter_dirs, names = write_adapters(args, Path(tmp), torch.bfloat16 if cuda else torch.float32)
        offline_runs = None if args.skip_offline else offline(args, prompts, names, adapter_dirs)
        variants, base = {}, dict(res)
        for name, extra in parse_variants(args.variants):
            serve_args = f"{args.serve_args} {extra}".strip()
            variants[name] = asyncio.run(over_http(args, prompts, names, adapter_dirs, base_name, serve_args))
            variants[name]["serve_args"] = serve_args
            res, lines = assemble(base, offline_runs, variants, args.sampling)
            path.write_text(json.dumps(res, indent=2))          # after each server: a later one may not finish
            plot(res, path.with_suffix(".png"))
    for line in lines:
        log(line)
    log(f"wrote {path}")
    failed = sorted({s for v in res.get("variants", {"": res}).values() for s, e in v["sampling"].items()
                     if any("error" in r for sys_ in ("http", "offline") for r in e.get(sys_, {}).values())})
    if failed:
        log(f"sampling settings that failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
