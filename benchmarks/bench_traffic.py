"""Traffic over HTTP: ``vlora serve`` with its defaults under open-loop Poisson arrivals at a swept rate.

The workload (``vlora.bench.traffic.traffic_trace``, a pure function of ``--seed`` and the options): for each
rate of ``--rates``, ``--duration`` seconds of Poisson arrivals at that rate (requests per second); prompt
lengths log-normal with median ``--prompt-median`` and p99 ``--prompt-p99`` (256 and 2,048 tokens), output
lengths log-normal with median ``--output-median`` and p99 ``--output-p99`` (128 and 1,024), clipped to the
server's context (``max_model_len`` from ``/v1/models``); each request asks for its drawn output length as
``max_tokens`` with ``ignore_eos``, so every request does its drawn work. ``--base-share`` of the requests
(10%) go to the base model, the rest to ``--adapters`` random adapters (ranks ``--ranks`` round-robin, on all
seven projections, stored in bf16) with Zipf-``--zipf`` popularity (1.0: adapter ``a0`` the most popular).
Prompts are random token ids. Decoding is sampled (temperature 0.8, top_p 0.95, top_k 50).

Thousands of adapters of a 7B model do not fit a disk (about 150 MB each in bf16 at ranks 8-64) nor host
memory: ``--distinct N`` writes N weight sets (``a0`` .. ``a{N-1}``) and makes every later adapter ``a{j}`` a
directory of links to the files of ``a{j mod N}`` (its rank too); the server still reads, packs and holds each
adapter as its own. ``--on-demand`` gives the server no adapter at start: it serves the folder with
``--adapter-dir`` and loads each adapter on its first request, keeping at most ``--max-loaded-adapters`` (least
recently used unloaded first), as a server with more adapters than memory runs.

``python -m vlora.cli serve --model M --adapter a0=... ...`` (or ``--adapter-dir DIR``) starts with no tuning
flags (``--serve-args`` adds some), gets a few warm-up requests, then each rate runs in turn: every request is
sent at its arrival time as a streaming ``/v1/completions`` with a token-id prompt, one HTTP connection each,
and after the last arrival the rate waits up to ``--drain-timeout`` seconds for the requests in flight (those
left then are cancelled and count as unfinished). Measured per request: the time to first token (send to the first chunk carrying a token), the
inter-token gaps (between successive token-bearing chunks; a chunk of k tokens counts as one gap and k - 1 gaps
of zero, so a request of n tokens gives n - 1 gaps), output tokens, errors (an HTTP error, an error in the
stream, or fewer tokens than asked).

Reported per rate: requests sent, finished and failed; TTFT p50 / p99 and inter-token p50 / p99 (all requests'
gaps pooled); output tok/s (all output tokens over the time from the rate's first send to its last token); and
whether it meets the SLO: TTFT p99 <= ``--slo-ttft-s`` (1 s) and inter-token p99 <= ``--slo-itl-ms`` (60 ms)
with every request finished and none failed. The SLO rate is the highest rate of the sweep that meets it with
every lower rate meeting it too (null when the lowest does not). Writes ``traffic-<device>.json``, ``traffic-<device>.md`` (a table) and
``traffic-<device>.png`` (latency vs rate, the SLO lines drawn) after each rate, so that a run cut short keeps
what finished. Progress lines go to stderr.

    python benchmarks/bench_traffic.py --rates 2,4,6,8,10 --out benchmarks/results          # GPU, 100 adapters
    python benchmarks/bench_traffic.py --adapters 1000 --distinct 100 --on-demand --max-loaded-adapters 200 \\
        --rates 2,4,6,8,10 --out benchmarks/results/1000
    python benchmarks/bench_traffic.py --model random:tiny-llama --device cpu --adapters 4 --rates 1,2 \\
        --duration 2 --prompt-median 16 --prompt-p99 64 --output-median 8 --output-p99 32 --out /tmp/traffic  # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from bench_e2e import write_adapters  # noqa: E402
from bench_serve import free_port, openai_fields, start_server, stop_server, stream_chunks, wait_healthy  # noqa: E402

from vlora.bench.traffic import chunk_gaps, lognormal_sigma, percentile, traffic_trace  # noqa: E402
from vlora.models.loader import RANDOM_PRESETS  # noqa: E402

SAMPLING = "sampled"
"""``bench_e2e.py``'s sampled setting: temperature 0.8, top_p 0.95, top_k 50."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _positive(kind):
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not x > 0 or (kind is float and not math.isfinite(x)):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return x
    return parse


def _positive_list(kind):
    one = _positive(kind)

    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("needs at least one value")
        return [one(x) for x in items]
    return parse


def _share(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return x


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:llama-2-7b",
                    help=f"random:<preset> ({', '.join(RANDOM_PRESETS)}): the adapters are written for its shapes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--adapters", type=_positive(int), default=100)
    ap.add_argument("--ranks", type=_positive_list(int), default=[8, 16, 32, 64],
                    help="adapter ranks, round-robin over a0, a1, ... (default 8,16,32,64)")
    ap.add_argument("--distinct", type=_positive(int), default=None,
                    help="weight sets written (default: one per adapter); adapter a{j} links to a{j mod N}'s files")
    ap.add_argument("--on-demand", action="store_true",
                    help="no adapter at start: the server loads each from --adapter-dir on its first request")
    ap.add_argument("--max-loaded-adapters", type=_positive(int), default=None,
                    help="with --on-demand: the most adapters the server keeps loaded (default: no bound)")
    ap.add_argument("--rates", type=_positive_list(float), default=[2.0, 4.0, 6.0],
                    help="arrival rates to sweep, requests/s, comma-separated (default 2,4,6)")
    ap.add_argument("--duration", type=_positive(float), default=60.0, help="seconds of arrivals per rate")
    ap.add_argument("--seed", type=int, default=0, help="the seed every trace is drawn from")
    ap.add_argument("--prompt-median", type=_positive(float), default=256.0)
    ap.add_argument("--prompt-p99", type=_positive(float), default=2048.0)
    ap.add_argument("--output-median", type=_positive(float), default=128.0)
    ap.add_argument("--output-p99", type=_positive(float), default=1024.0)
    ap.add_argument("--base-share", type=_share, default=0.1, help="share of requests on the base model")
    ap.add_argument("--zipf", type=_positive(float), default=1.0, help="the Zipf exponent of adapter popularity")
    ap.add_argument("--slo-ttft-s", type=_positive(float), default=1.0, help="the SLO's TTFT p99 bound")
    ap.add_argument("--slo-itl-ms", type=_positive(float), default=60.0, help="the SLO's inter-token p99 bound")
    ap.add_argument("--warmup", type=int, default=4, help="short requests sent before the sweep (compiles, captures)")
    ap.add_argument("--serve-args", default="", help="extra `vlora serve` options (default: none, its defaults)")
    ap.add_argument("--start-timeout", type=_positive(float), default=600.0,
                    help="seconds to wait for the server's /health")
    ap.add_argument("--request-timeout", type=_positive(float), default=600.0, help="HTTP timeout of one request")
    ap.add_argument("--drain-timeout", type=_positive(float), default=600.0,
                    help="seconds a rate waits after its last arrival for the requests in flight")
    ap.add_argument("--out", type=Path, required=True)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if args.max_loaded_adapters is not None and not args.on_demand:
        ap.error("--max-loaded-adapters needs --on-demand (adapters given at start are never unloaded)")
    if args.model.removeprefix("random:") not in RANDOM_PRESETS or not args.model.startswith("random:"):
        ap.error(f"--model must be random:<preset> with a preset of {', '.join(RANDOM_PRESETS)}, got {args.model!r}")
    for name in ("prompt", "output"):
        try:
            lognormal_sigma(getattr(args, f"{name}_median"), getattr(args, f"{name}_p99"))
        except ValueError:
            ap.error(f"--{name}-median must be <= --{name}-p99")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if len(set(args.rates)) != len(args.rates):
        ap.error(f"--rates has a repeated rate: {args.rates}")
    args.profile = None                      # bench_serve.start_server's option: no cProfile here
    return args


def body(req, base_name: str, i: int) -> dict:
    return {"model": req.adapter or base_name, "prompt": list(req.prompt), "max_tokens": req.output_len,
            "ignore_eos": True, "stream": True, **openai_fields(SAMPLING, req.output_len, i)}


async def one_request(client, payload: dict) -> dict:
    """One streaming completion: send time, TTFT, the token-bearing chunks' times and token counts, and the error
    (None when it brought every token asked for). Times are ``time.perf_counter()`` seconds."""
    sent = time.perf_counter()
    r = {"sent": sent, "ttft": None, "times": [], "counts": [], "tokens": 0, "error": None}
    try:
        async for now, n, _ in stream_chunks(client, payload):
            if n:
                if r["ttft"] is None:
                    r["ttft"] = now - sent
                r["times"].append(now)
                r["counts"].append(n)
                r["tokens"] += n
        if r["tokens"] != payload["max_tokens"]:
            raise RuntimeError(f"{r['tokens']} tokens, asked for {payload['max_tokens']} (ignore_eos)")
    except Exception as e:                  # recorded: the rate goes on, the request counts as failed
        r["error"] = f"{type(e).__name__}: {e}"
    return r


async def run_rate(client, trace, base_name: str, drain_timeout: float) -> tuple[list[dict], int, float]:
    """Sends every request of ``trace`` at its arrival time, waits for them up to ``drain_timeout`` after the last
    arrival; returns (the finished or failed requests' records, the number cancelled, the start time)."""
    t0 = time.perf_counter()
    tasks = []
    for i, req in enumerate(trace):
        delay = t0 + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_request(client, body(req, base_name, i))))
    if not tasks:
        return [], 0, t0
    done, pending = await asyncio.wait(tasks, timeout=drain_timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in done], len(pending), t0


def rate_metrics(rate: float, duration: float, trace, runs: list[dict], cancelled: int, t0: float,
                 slo_ttft_s: float, slo_itl_ms: float) -> dict:
    ok = [r for r in runs if r["error"] is None]
    errors = [r["error"] for r in runs if r["error"] is not None]
    ttfts = [r["ttft"] for r in ok]
    gaps = [g for r in ok for g in chunk_gaps(r["times"], r["counts"])]
    ends = [r["times"][-1] for r in runs if r["times"]]
    start = min((r["sent"] for r in runs), default=t0)
    tokens = sum(r["tokens"] for r in runs)
    ms = lambda x: None if x is None else 1e3 * x  # noqa: E731
    m = {"rate": rate, "sent": len(trace), "finished": len(ok), "errors": len(errors), "cancelled": cancelled,
         "achieved_rate": len(trace) / duration, "base_requests": sum(q.adapter is None for q in trace),
         "prompt_tokens": sum(len(q.prompt) for q in trace), "output_tokens": tokens,
         "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
         "itl_p50_ms": ms(percentile(gaps, 50)), "itl_p99_ms": ms(percentile(gaps, 99)),
         "output_tok_s": tokens / (max(ends) - start) if ends else 0.0, "first_errors": errors[:5]}
    m["meets_slo"] = (m["finished"] == m["sent"] > 0 and m["ttft_p99_ms"] <= 1e3 * slo_ttft_s
                      and (m["itl_p99_ms"] is None or m["itl_p99_ms"] <= slo_itl_ms))
    return m


SERVER_COUNTS = {"vlora_iterations_total": "path", "vlora_mode_switches_total": None,
                 "vlora_adapter_loads_total": None, "vlora_adapter_evictions_total": None}


async def server_counts(client) -> dict[str, float]:
    """The server's counters a rate's record keeps the change of (from /metrics): forwards by how they ran
    (``iterations_<path>``), mode switches, adapter loads and evictions."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERVER_COUNTS:
                label = SERVER_COUNTS[sample.name]
                key = sample.name.removeprefix("vlora_").removesuffix("_total")
                out[f"{key}_{sample.labels[label]}" if label else key] = sample.value
    return out


def slo_rate(rates: list[dict]) -> float | None:
    """The highest rate that meets the SLO with every lower rate of the sweep meeting it too, or None. A rate
    held above one missed is luck of its draw (each rate's trace has its own lengths), not a rate to promise."""
    held = None
    for r in sorted(rates, key=lambda r: r["rate"]):
        if not r["meets_slo"]:
            break
        held = r["rate"]
    return held


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(res: dict) -> list[str]:
    lines = ["| rate (req/s) | sent | finished | failed | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) "
             "| output tok/s | SLO | forwards: decode graph / mixed graph / eager | mode switches | adapter loads |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|"]
    for r in res["rates"]:
        lines.append(f"| {r['rate']:g} | {r['sent']} | {r['finished']} | {r['errors'] + r['cancelled']} | "
                     f"{fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} | {fmt(r['itl_p50_ms'], 1)} | "
                     f"{fmt(r['itl_p99_ms'], 1)} | {r['output_tok_s']:.0f} | {'yes' if r['meets_slo'] else 'no'} | "
                     + " | ".join(server_cells(r.get("server", {}))) + " |")
    return lines


def server_cells(c: dict) -> list[str]:
    """The table's cells of a rate's server counts (- where the record has none)."""
    n = lambda k: "-" if k not in c else f"{c[k]:.0f}"  # noqa: E731
    return [" / ".join(n(f"iterations_{p}") for p in ("decode_graph", "mixed_graph", "eager")),
            n("mode_switches"), n("adapter_loads")]


def write_md(res: dict, path: Path) -> None:
    a = res["args"]
    slo = res["slo_rate"]
    text = [f"# Traffic: {res['model']} on {res['device']}, {a['adapters']} adapters", "",
            f"{res['date']}; `vlora serve` {a['serve_args'] or 'defaults'}; seed {a['seed']}; {a['duration']:g} s of "
            f"Poisson arrivals per rate; prompts log-normal median {a['prompt_median']:g} / p99 {a['prompt_p99']:g}, "
            f"outputs median {a['output_median']:g} / p99 {a['output_p99']:g} tokens (context "
            f"{res['max_model_len']}); adapters of ranks {','.join(map(str, a['ranks']))}"
            + (f" over {a['distinct']} weight sets" if a.get("distinct") else "")
            + (", loaded on first request" + (f" (at most {a['max_loaded_adapters']} kept)"
                                              if a.get("max_loaded_adapters") else "") if a.get("on_demand") else
               ", all given at start") + f", Zipf-{a['zipf']:g}, "
            f"{100 * a['base_share']:g}% base; sampled decoding.", "",
            *table(res), "",
            f"SLO (TTFT p99 <= {a['slo_ttft_s']:g} s, inter-token p99 <= {a['slo_itl_ms']:g} ms, none failed): "
            + (f"highest rate meeting it with every lower rate meeting it too: {slo:g} req/s." if slo is not None
               else "the lowest rate misses it."), ""]
    path.write_text("\n".join(text))


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, rows = res["args"], res["rates"]
    x = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, unit, bound in ((axes[0], "ttft", "TTFT (ms)", 1e3 * a["slo_ttft_s"]),
                                 (axes[1], "itl", "inter-token latency (ms)", a["slo_itl_ms"])):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [r[f"{key}_{q}_ms"] if r[f"{key}_{q}_ms"] is not None else float("nan") for r in rows],
                    style, label=q)
        ax.axhline(bound, color="red", lw=1, ls=":", label=f"SLO p99 <= {bound:g} ms")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(unit)
        ax.legend()
        ax.grid(alpha=0.3)
    axes[2].plot(x, [r["output_tok_s"] for r in rows], "o-")
    axes[2].set_xlabel("arrival rate (req/s)")
    axes[2].set_ylabel("output tok/s")
    axes[2].grid(alpha=0.3)
    slo = res["slo_rate"]
    for ax in axes:
        if slo is not None:
            ax.axvline(slo, color="green", lw=1, ls=":")
    fig.suptitle(f"Traffic: {res['model']}, {a['adapters']} adapters, {res['device']} (SLO rate: "
                 f"{'none' if slo is None else f'{slo:g} req/s'})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(res: dict, out: Path, tag: str) -> None:
    res["slo_rate"] = slo_rate(res["rates"])
    (out / f"traffic-{tag}.json").write_text(json.dumps(res, indent=2))
    write_md(res, out / f"traffic-{tag}.md")
    plot(res, out / f"traffic-{tag}.png")


def write_traffic_adapters(args, root: Path) -> dict[str, str]:
    """``--adapters`` adapter directories under ``root`` (a0, a1, ...): the first ``--distinct`` with random
    weights of their own in bf16, each later one links to the files of ``a{j mod distinct}``."""
    import torch

    n = min(args.distinct or args.adapters, args.adapters)
    # write_adapters prints its progress line on stdout: kept on stderr with the others
    with contextlib.redirect_stdout(sys.stderr):
        dirs, _ = write_adapters(argparse.Namespace(**{**vars(args), "adapters": n, "requests": 0}), root,
                                 torch.bfloat16)
    for j in range(n, args.adapters):
        src, d = Path(dirs[f"a{j % n}"]), root / f"a{j}"
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).symlink_to(f)
        dirs[f"a{j}"] = str(d)
    return dirs


async def sweep(args, adapter_dirs: dict[str, str], names: list[str], res: dict, tag: str) -> None:
    import httpx

    port = free_port()
    proc = start_server(args, adapter_dirs, port)
    try:
        # no pool limit: an open-loop client never queues a request behind another one
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                     timeout=httpx.Timeout(args.request_timeout)) as client:
            t = time.perf_counter()
            await wait_healthy(client, proc, args.start_timeout)
            res["start_s"] = time.perf_counter() - t
            cards = (await client.get("/v1/models")).json()["data"]
            base_name = next(c["id"] for c in cards if not c.get("parent"))
            res["max_model_len"] = max_len = cards[0]["max_model_len"]
            log(f"server healthy after {res['start_s']:.1f} s: base {base_name}, context {max_len}")
            vocab = RANDOM_PRESETS[args.model.removeprefix("random:")]["vocab_size"]
            if args.warmup:           # alternately an adapter and the base model, all at once, 4 tokens each
                payloads = [{"model": names[i // 2 % len(names)] if i % 2 == 0 else base_name,
                             "prompt": list(range(3, 19)), "max_tokens": 4, "ignore_eos": True, "stream": True,
                             **openai_fields(SAMPLING, 4, i)} for i in range(args.warmup)]
                runs = await asyncio.gather(*(one_request(client, p) for p in payloads))
                bad = [r["error"] for r in runs if r["error"]]
                if bad:
                    raise RuntimeError(f"warm-up failed: {bad[0]}")
            for rate in args.rates:
                trace = traffic_trace(rate, args.duration, names, args.seed, max_model_len=max_len, vocab_size=vocab,
                                      prompt_median=args.prompt_median, prompt_p99=args.prompt_p99,
                                      output_median=args.output_median, output_p99=args.output_p99,
                                      base_share=args.base_share, alpha=args.zipf)
                log(f"rate {rate:g} req/s: {len(trace)} requests over {args.duration:g} s, "
                    f"{sum(len(q.prompt) for q in trace)} prompt / {sum(q.output_len for q in trace)} output tokens")
                before = await server_counts(client)
                runs, cancelled, t0 = await run_rate(client, trace, base_name, args.drain_timeout)
                m = rate_metrics(rate, args.duration, trace, runs, cancelled, t0, args.slo_ttft_s, args.slo_itl_ms)
                after = await server_counts(client)
                m["server"] = {k: after[k] - before.get(k, 0) for k in after}
                res["rates"].append(m)
                write_results(res, args.out, tag)
                log(f"rate {rate:g}: {m['finished']}/{m['sent']} finished, {m['errors']} failed, {cancelled} "
                    f"cancelled; TTFT p50 {fmt(m['ttft_p50_ms'])} / p99 {fmt(m['ttft_p99_ms'])} ms, inter-token "
                    f"p50 {fmt(m['itl_p50_ms'], 1)} / p99 {fmt(m['itl_p99_ms'], 1)} ms, {m['output_tok_s']:.0f} "
                    f"output tok/s; SLO {'met' if m['meets_slo'] else 'missed'}")
                if m["first_errors"]:
                    log(f"  first error: {m['first_errors'][0]}")
    finally:
        stop_server(proc)


def commit() -> str | None:
    """The commit measured: $VLORA_COMMIT where the checkout's history is not the code's (a copied tree), else
    git's."""
    import os
    import subprocess

    if os.environ.get("VLORA_COMMIT"):
        return os.environ["VLORA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    if cuda:
        import torch
        device = torch.cuda.get_device_name(torch.device(args.device))
    else:
        device = "cpu"
    tag = device.lower().replace(" ", "-")
    res = dict(date=dt.date.today().isoformat(), device=device, commit=commit(), model=args.model,
               sampling=openai_fields(SAMPLING, 1, 0),
               args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "profile"},
               max_model_len=None, rates=[], slo_rate=None)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dirs = write_traffic_adapters(args, Path(tmp))
        names = list(adapter_dirs)             # a0, a1, ...: the Zipf order, a0 the most popular
        if args.on_demand:                     # the server finds them in the folder, on first request
            extra = f" --adapter-dir {shlex.quote(tmp)}" + (f" --max-loaded-adapters {args.max_loaded_adapters}"
                                                            if args.max_loaded_adapters else "")
            server = argparse.Namespace(**{**vars(args), "serve_args": args.serve_args + extra})
            asyncio.run(sweep(server, {}, names, res, tag))
        else:
            asyncio.run(sweep(args, adapter_dirs, names, res, tag))
    for line in table(res):
        log(line)
    slo = res["slo_rate"]
    log(f"SLO rate: {'none' if slo is None else f'{slo:g} req/s'}; wrote {args.out}/traffic-{tag}.{{json,md,png}}")
    return res


if __name__ == "__main__":
    main()
