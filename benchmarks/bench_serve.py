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
output token. Writes ``serve-<device>.json``.

    python benchmarks/bench_serve.py --out benchmarks/results                      # GPU, the issue's setting
    python benchmarks/bench_serve.py --model random:tiny-llama --device cpu --out /tmp/serve   # small, on a CPU
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

from bench_e2e import fmt_ttft, log, make_prompts, run_offline, ttft_stats, write_adapters  # noqa: E402

from vlora import SamplingParams  # noqa: E402
from vlora.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig  # noqa: E402
from vlora.engine.engine import Engine  # noqa: E402

LABELS = ("adapters", "base")


def offline(args, prompts, names, adapter_dirs) -> dict:
    """The offline engine with the server's defaults: output tok/s and TTFT per label."""
    engine = Engine(EngineConfig(model=ModelConfig(model=args.model, device=args.device, dtype=args.dtype),
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
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    out = {}
    for label in LABELS:
        run = run_offline(engine, prompts, names if label == "adapters" else None, sp, dev)
        assert all(n == args.output_len for n in run["tokens"])
        out[label] = {"tok_s": sum(run["tokens"]) / run["wall_s"], "wall_s": run["wall_s"],
                      "ttft_s": ttft_stats(run["ttft_s"])}
        log(f"offline {label}: {out[label]['tok_s']:.0f} output tok/s, TTFT {fmt_ttft(out[label]['ttft_s'])}")
    return out


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of process ``pid`` (Linux), by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_split(pid: int, before: dict[int, float], tokens: int) -> dict:
    """The server's CPU time since ``before``: its main thread (the event loop: HTTP, JSON, SSE) and the rest
    (the engine thread, torch's workers), in seconds and in microseconds per output token."""
    after = thread_cpu_s(pid)
    delta = {t: after[t] - before.get(t, 0.0) for t in after}
    loop = delta.get(pid, 0.0)
    rest = sum(v for t, v in delta.items() if t != pid)
    return {"event_loop_s": loop, "other_threads_s": rest, "event_loop_us_per_token": 1e6 * loop / tokens,
            "other_threads_us_per_token": 1e6 * rest / tokens}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, adapter_dirs: dict[str, str], port: int) -> subprocess.Popen:
    prof = ["-m", "cProfile", "-o", str(args.profile)] if args.profile else []
    cmd = [sys.executable, *prof, "-m", "vlora.cli", "serve", "--model", args.model, "--device", args.device,
           "--dtype", args.dtype, "--port", str(port), "--log-level", "warning", "--no-check-base-model"]
    cmd += [x for name, path in adapter_dirs.items() for x in ("--adapter", f"{name}={path}")]
    cmd += shlex.split(args.serve_args)
    log("starting: " + " ".join(cmd[:12 + len(prof)]) + f" ... ({len(adapter_dirs)} adapters) {args.serve_args}")
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


async def one_stream(client, body: dict, t0: float) -> tuple[float | None, float, int]:
    """(time to first token, time of the last chunk, output tokens) of one streaming completion."""
    first, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            n = sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
            if n and first is None:
                first = time.perf_counter() - t0
            tokens += n
    return first, time.perf_counter() - t0, tokens


async def drive(client, prompts, models, max_tokens: int) -> dict:
    """Every request at once; output tok/s over first send to last token, and TTFTs."""
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(one_stream(client, {"model": m, "prompt": p, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True, "stream": True}, t0)
                                  for p, m in zip(prompts, models)))
    wall = max(end for _, end, _ in runs)
    tokens = [n for _, _, n in runs]
    return {"tok_s": sum(tokens) / wall, "wall_s": wall, "tokens": tokens,
            "ttft_s": ttft_stats([f for f, _, _ in runs if f is not None])}


async def over_http(args, prompts, names, adapter_dirs, base_name: str) -> dict:
    import httpx

    port = free_port()
    proc = start_server(args, adapter_dirs, port)
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
            for label in LABELS:
                before = thread_cpu_s(proc.pid)
                r = await drive(client, prompts, models[label], args.output_len)
                tokens = r.pop("tokens")
                assert all(n == args.output_len for n in tokens), "a stream missed tokens"
                r["server_cpu"] = cpu_split(proc.pid, before, sum(tokens))
                out[label] = r
                c = r["server_cpu"]
                log(f"HTTP {label}: {r['tok_s']:.0f} output tok/s, TTFT {fmt_ttft(r['ttft_s'])}; server CPU per "
                    f"output token: event loop {c['event_loop_us_per_token']:.0f} us, other threads "
                    f"{c['other_threads_us_per_token']:.0f} us")
    finally:      # profiled, SIGINT: uvicorn re-raises the signal after its shutdown, and cProfile writes its
        proc.send_signal(signal.SIGINT if args.profile else signal.SIGTERM)   # stats on KeyboardInterrupt only
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


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
    ap.add_argument("--skip-offline", action="store_true", help="leave out the offline engine")
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
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dirs, names = write_adapters(args, Path(tmp))
        if not args.skip_offline:
            res["offline"] = offline(args, prompts, names, adapter_dirs)
        res["http"] = asyncio.run(over_http(args, prompts, names, adapter_dirs, base_name))
    if "offline" in res:
        for label in LABELS:
            h, o = res["http"][label], res["offline"][label]
            res[f"{label}_http_over_offline_tok_s"] = h["tok_s"] / o["tok_s"]
            res[f"{label}_http_over_offline_ttft_mean"] = h["ttft_s"]["mean"] / o["ttft_s"]["mean"]
            log(f"{label}: HTTP / offline = {res[f'{label}_http_over_offline_tok_s']:.2f} x output tok/s "
                f"(target >= 0.9), {res[f'{label}_http_over_offline_ttft_mean']:.2f} x mean TTFT (target <= 1.2)")
    tag = gpu.lower().replace(" ", "-")
    path = args.out / f"serve-{tag}.json"
    path.write_text(json.dumps(res, indent=2))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
