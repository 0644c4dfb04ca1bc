"""Soak test of `vlora serve`: a steady mixed load for a long time, then check nothing leaked.

Starts `vlora serve` (embedded SmolLM2-135M, its two demo adapters, an --adapter-dir) in a
subprocess and keeps ``--concurrency`` clients busy for ``--duration`` seconds with a mix of
chat and completion requests, streaming or not, greedy or sampled, over the base model and the
adapters; a share of the clients disconnect midway, a share (``--invalid-share``) send invalid
or fault-injecting requests (each must get its expected 4xx: out-of-vocabulary stop ids, NUL in
paths, deep JSON, lone surrogates, wrong Content-Type, text too long for the context, ...; or,
for a tiny temperature, an answer; or be a client that leaves mid-body), and every
``--adapter-cycle`` seconds an extra adapter is loaded, used and unloaded. Reports requests
ok / failed (by why), refusals by status, disconnects, latency percentiles, the server's RSS at
the start (after warm-up) and end, and the KV pages in use once the load stops (should be 0).
Writes benchmarks/results/soak_server-cpu.json.

    python benchmarks/soak_server.py                    # 10 minutes
    python benchmarks/soak_server.py --duration 120     # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "soak-key"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
             "Give me three tips for learning to cook.", "Explain what a LoRA adapter is in one sentence.",
             "How many legs does a spider have?", "Why is the sky blue?", "Tell me a joke about computers.",
             "Describe the water cycle for a ten-year-old.", "What is photosynthesis?"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16, help="clients, each one request at a time")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    p.add_argument("--stream-share", type=float, default=0.4)
    p.add_argument("--disconnect-share", type=float, default=0.1)
    p.add_argument("--invalid-share", type=float, default=0.15, help="share of invalid or fault-injecting requests")
    p.add_argument("--adapter-cycle", type=float, default=30, help="seconds between load/unload of an extra adapter")
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "soak_server-cpu.json")
    return p.parse_args()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric_values(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value from the Prometheus text format."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def pct(xs: list[float], q: float) -> float | None:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) >= 2 else (xs[0] if xs else None)


class Soak:
    def __init__(self, args, url: str, models: list[str]):
        self.args, self.url, self.models = args, url, models
        self.rng = random.Random(args.seed)
        self.stop_at = 0.0
        self.ok = self.failed = self.disconnected = self.refused = self.left_mid_body = 0
        self.failures: dict[str, int] = {}
        self.refusals: dict[str, int] = {}          # invalid requests answered as expected, by status
        self.latency: list[float] = []
        self.ttft: list[float] = []
        self.tokens = 0

    def fail(self, why: str) -> None:
        self.failed += 1
        self.failures[why] = self.failures.get(why, 0) + 1

    async def client(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.stop_at:
            r = self.rng.random()
            if r < self.args.invalid_share:
                try:
                    await self.invalid(http)
                except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
                    self.fail(f"invalid request: {type(e).__name__}")
                continue
            r = (r - self.args.invalid_share) / (1 - self.args.invalid_share)
            kind = "drop" if r < self.args.disconnect_share else \
                "stream" if r < self.args.disconnect_share + self.args.stream_share else "plain"
            chat = self.rng.random() < 0.7
            body = {"model": self.rng.choice(self.models), "max_tokens": self.rng.randint(*self.args.max_tokens),
                    "temperature": self.rng.choice([0.0, 0.8]), "seed": self.rng.randrange(1 << 30)}
            q = self.rng.choice(QUESTIONS)
            if chat:
                body["messages"] = [{"role": "user", "content": q}]
            else:
                body["prompt"] = q
            if kind != "plain":
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            if kind == "drop":
                body["max_tokens"] = body["min_tokens"] = 200
            path = "/v1/chat/completions" if chat else "/v1/completions"
            try:
                await self.one(http, path, body, kind)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.fail(type(e).__name__)

    async def one(self, http: httpx.AsyncClient, path: str, body: dict, kind: str) -> None:
        t0 = time.monotonic()
        if kind == "plain":
            r = await http.post(path, json=body)
            if r.status_code != 200:
                return self.fail(f"http {r.status_code}")
            self.ok += 1
            self.latency.append(time.monotonic() - t0)
            self.tokens += r.json()["usage"]["completion_tokens"]
            return
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return self.fail(f"http {r.status_code}")
            first, done = None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return self.fail("stream error")
                if event.get("usage"):
                    self.tokens += event["usage"]["completion_tokens"]
                for c in event["choices"]:
                    if (c.get("delta", {}).get("content") or c.get("text")) and first is None:
                        first = time.monotonic() - t0
                        if kind == "drop":       # leave midway: the server must abort it
                            self.disconnected += 1
                            return
            if not done:
                return self.fail("stream ended without [DONE]")
            self.ok += 1
            self.latency.append(time.monotonic() - t0)
            if first is not None:
                self.ttft.append(first)

    async def invalid(self, http: httpx.AsyncClient) -> None:
        """One invalid or fault-injecting request; its answer must be the expected status."""
        name, path, body, headers, expected = self.rng.choice(INVALID)
        if name == "leaves mid-body":
            return await self.leave_mid_body(path)
        if isinstance(body, dict):
            body = json.dumps({"model": self.rng.choice(self.models), **body} if path.endswith("completions") else body)
        r = await http.post(path, content=body.encode("utf-8", "surrogatepass"),
                            headers={"Content-Type": "application/json", **headers})
        if r.status_code != expected:
            return self.fail(f"{name}: http {r.status_code} (expected {expected})")
        if expected != 200 and set(r.json().get("error", {})) != {"message", "type", "param", "code"}:
            return self.fail(f"{name}: error body not in OpenAI's shape")
        self.refused += expected != 200
        self.ok += expected == 200
        key = f"{expected} {name}"
        self.refusals[key] = self.refusals.get(key, 0) + 1

    async def leave_mid_body(self, path: str) -> None:
        """Announce a body, send part of it, and close the connection."""
        host, port = self.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"model\": ".encode())
        await writer.drain()
        await asyncio.sleep(self.rng.uniform(0, 0.2))
        writer.close()
        await writer.wait_closed()
        self.left_mid_body += 1

    async def adapter_cycler(self, http: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() + self.args.adapter_cycle < self.stop_at:
            await asyncio.sleep(self.args.adapter_cycle)
            name = f"cycled-{n}"
            n += 1
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "extra"})
            if r.status_code != 200:
                self.fail(f"load {r.status_code}")
                continue
            r = await http.post("/v1/chat/completions", json={"model": name, "max_tokens": 8, "messages": [
                {"role": "user", "content": "Hello!"}]})
            if r.status_code == 200:
                self.ok += 1
            else:
                self.fail(f"http {r.status_code} on a loaded adapter")
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": name})
            if r.status_code != 200:
                self.fail(f"unload {r.status_code}")

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.args.concurrency + 4)
        async with httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=300, limits=limits) as http:
            self.stop_at = time.monotonic() + self.args.duration
            await asyncio.gather(self.adapter_cycler(http), *(self.client(http) for _ in range(self.args.concurrency)))


HI = [{"role": "user", "content": "Hi"}]
INVALID = [   # (name, route, body (a dict gets a served model), extra headers, expected status)
    ("temperature 1e-300", "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "temperature": 1e-300}, {}, 200),
    ("top_p 5e-324", "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "top_p": 5e-324}, {}, 200),
    ("stop id 1e9 + min_tokens", "/v1/chat/completions",
     {"messages": HI, "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [10**9]}, {}, 400),
    ("stop id 2**70 + min_tokens", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [2**70]}, {}, 400),
    ("prompt id 2**70", "/v1/completions", {"prompt": [1, 2**70]}, {}, 400),
    ("NUL in image path", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///x\x00.png"}}]}], "max_tokens": 4}, {}, 400),
    ("NUL in lora_path", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "extra\x00"}, {}, 400),
    ("lone surrogate", "/v1/completions", {"prompt": "ab\ud800cd"}, {}, 400),
    ("max_completion_tokens 1e12", "/v1/chat/completions", {"messages": HI, "max_completion_tokens": 10**12}, {}, 400),
    ("NaN temperature", "/v1/chat/completions", {"messages": HI, "temperature": float("nan")}, {}, 400),
    ("deep JSON", "/v1/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", {}, 400),
    ("not JSON", "/v1/completions", '{"model": ', {}, 400),
    ("text/plain body", "/v1/chat/completions", {"messages": HI}, {"Content-Type": "text/plain"}, 415),
    ("text too long for the context", "/v1/completions", {"prompt": "x" * (4 << 20)}, {}, 400),
    ("unknown 100 kB model name", "/v1/chat/completions",
     json.dumps({"model": "m" * 100_000, "messages": HI, "max_tokens": 4}), {}, 404),
    ("leaves mid-body", "/v1/chat/completions", None, {}, 0),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    from vlora.lora.random_adapter import write_random_adapter

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="vlora-soak-") as tmp:
        adapter_dir = Path(tmp) / "adapters"
        shape = _embedded_shape()
        write_random_adapter(adapter_dir / "extra", shape, rank=8, seed=9, std=0.03)
        cmd = [sys.executable, "-m", "vlora.cli", "serve", "--port", str(port), "--adapter-dir", str(adapter_dir),
               "--kv-cache-memory-gb", str(args.kv_cache_memory_gb), "--log-level", "warning"]
        log(f"starting: {' '.join(cmd[1:])}")
        server = subprocess.Popen(cmd, env={**os.environ, "VLORA_API_KEY": KEY}, cwd=ROOT)
        try:
            record = asyncio.run(_soak(args, server, url))
        finally:
            if server.poll() is None:
                server.terminate()
                server.wait(120)
    record["server_exit_code"] = server.returncode
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    r = record["results"]
    print(f"\n{'requests':<28}{r['requests']:>10}")
    print(f"{'requests ok':<28}{r['requests_ok']:>10}")
    print(f"{'requests failed':<28}{r['requests_failed']:>10}  {r['failures'] or ''}")
    print(f"{'invalid, refused as expected':<28}{r['invalid_refused']:>10}")
    for key, n in sorted(r["invalid_by_kind"].items()):
        print(f"{'':<6}{n:>6}  {key}")
    print(f"{'disconnected mid-stream':<28}{r['disconnected']:>10}  (server counted {r['server_aborted']:.0f} aborts)")
    print(f"{'left mid-body':<28}{r['left_mid_body']:>10}")
    print(f"{'latency p50/p90/p99 (s)':<28}{_fmt(r['latency_s'])}")
    print(f"{'stream TTFT p50/p90/p99 (s)':<28}{_fmt(r['ttft_s'])}")
    print(f"{'output tokens/s':<28}{r['output_tok_per_s']:>10.1f}")
    print(f"{'server RSS start/end (MiB)':<28}{r['rss_mib_start']:>10.0f} / {r['rss_mib_end']:.0f} "
          f"(max {r['rss_mib_max']:.0f})")
    print(f"{'KV pages used at the end':<28}{r['kv_blocks_used_end']:>10.0f} of {r['kv_blocks_total']:.0f}")
    print(f"{'server healthy at the end':<28}{r['healthy_end']!s:>10}")
    log(f"wrote {args.output}")


def _fmt(p: dict) -> str:
    return " / ".join("-" if p[k] is None else f"{p[k]:.2f}" for k in ("p50", "p90", "p99"))


def _embedded_shape():
    from transformers import AutoConfig

    from vlora.lora.adapter import ModelShape
    from vlora.models.loader import decoder_config, resolve_model_dir

    model_dir = resolve_model_dir(None)
    cfg = decoder_config(AutoConfig.from_pretrained(model_dir), model_dir.name)
    ins, outs = cfg.lora_in_out()
    return ModelShape(cfg.name, cfg.num_layers, ins, outs)


async def _soak(args, server: subprocess.Popen, url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"vlora serve exited with {server.returncode}")
            try:
                if (await http.get("/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("vlora serve did not come up")
            await asyncio.sleep(0.5)
        models = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        log(f"server up; models {models}; warming up")
        for m in models:
            await http.post("/v1/chat/completions", json={"model": m, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
        rss_start = rss_mib(server.pid)
        soak = Soak(args, url, models)
        rss = [rss_start]
        load_before = os.getloadavg()[0]

        async def sample_rss():
            while True:
                await asyncio.sleep(5)
                rss.append(rss_mib(server.pid))

        log(f"soaking for {args.duration:.0f}s with {args.concurrency} clients (RSS {rss_start:.0f} MiB)")
        sampler = asyncio.ensure_future(sample_rss())
        t0 = time.monotonic()
        await soak.run()
        elapsed = time.monotonic() - t0
        sampler.cancel()
        deadline = time.monotonic() + 60            # let the aborted ones flush
        while True:
            m = metric_values((await http.get("/metrics")).text)
            if (m["vlora_kv_blocks_used"] == 0 and m["vlora_requests_running"] == 0
                    and m["vlora_requests_waiting"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        rss_end = rss_mib(server.pid)
        healthy = (await http.get("/health")).status_code == 200
        aborted = sum(v for k, v in m.items() if k.startswith("vlora_requests_total{") and 'finish_reason="abort"' in k)
        log(f"done after {elapsed:.0f}s; stopping the server (SIGTERM)")
        server.terminate()
        server.wait(120)
    return {
        "benchmark": "soak_server",
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1min_before": load_before},
        "config": {"duration_s": args.duration, "concurrency": args.concurrency, "max_tokens": list(args.max_tokens),
                   "stream_share": args.stream_share, "disconnect_share": args.disconnect_share,
                   "invalid_share": args.invalid_share,
                   "adapter_cycle_s": args.adapter_cycle, "kv_cache_memory_gb": args.kv_cache_memory_gb,
                   "models": models, "model": "SmolLM2-135M-Instruct (embedded), float32, CPU",
                   "clients": "in this process (httpx), server in a subprocess"},
        "results": {
            "elapsed_s": elapsed,
            "requests": soak.ok + soak.failed + soak.refused + soak.disconnected + soak.left_mid_body,
            "requests_ok": soak.ok, "requests_failed": soak.failed, "failures": soak.failures,
            "invalid_refused": soak.refused, "invalid_by_kind": soak.refusals,
            "disconnected": soak.disconnected, "left_mid_body": soak.left_mid_body, "server_aborted": aborted,
            "healthy_end": healthy,
            "latency_s": {f"p{q}": pct(soak.latency, q) for q in (50, 90, 99)},
            "ttft_s": {f"p{q}": pct(soak.ttft, q) for q in (50, 90, 99)},
            "output_tokens": soak.tokens, "output_tok_per_s": soak.tokens / elapsed,
            "rss_mib_start": rss_start, "rss_mib_end": rss_end, "rss_mib_max": max(rss),
            "kv_blocks_used_end": m["vlora_kv_blocks_used"], "kv_blocks_total": m["vlora_kv_blocks_total"],
        },
    }


if __name__ == "__main__":
    main()
