"""Adapters loaded on first request, over HTTP: do the other streams pause while one loads?

``vlora serve --adapter-dir DIR`` (started as ``bench_serve.py`` starts it) with ``--running`` random adapters
given at start. Per configuration (the streams' ``--settings``, greedy and sampled, by ``--load-ranks``, the rank of the
adapters loaded on request):

1. ``--streams`` streaming ``/v1/completions`` on the adapters given at start (token-id prompts of
   ``--input-len`` tokens, greedy or sampled: ``--settings``, ignore_eos; each chunk carries its token ids), every
   chunk's arrival time recorded;
2. once every stream has ``--warm`` tokens, a load and a control not recorded (a batch size's first graph capture,
   the rank's first load), then one after another: a request naming an adapter of DIR not loaded yet
   (a load: a 4-token prompt, 1 output token), ``--spacing`` seconds of quiet, a like request on the adapter of
   the same rank that the unrecorded load brought in (a control: what a new request on an adapter of that rank
   costs the streams), ``--spacing`` seconds; ``--loads`` times;
3. the streams are closed.

Reported per configuration: the streams' gaps between chunks (inter-token latency, ITL) that overlap a load (from
its request's sending to its answer), a control, or neither (median, p99, max); and what a load costs the streams.
A window's delay is how far behind the streams fell during it: its length less the tokens a stream received in it
times the streams' inter-token time then (a line fitted over the configuration to the quiet stretches between
windows), averaged over the streams. (Measured against a configuration-wide median gap, or by summing the gaps
that overlap a window, the streams' growing contexts and skewed gaps would count as delay in the longest
windows.) A load's own request is a new request like a control's (a prefill joins the
decodes), so the pause the load itself adds is the mean delay of the loads less that of the controls; it is
reported over the load's duration (how much slower the streams ran while it loaded: the target is at most 5 %),
with its standard error (the windows' delays vary by tens of ms: a figure needs enough ``--loads``), and over
the median ITL (in inter-token times). Load times: the client's latency, and the mean of the server's
``vlora_adapter_load_seconds`` (all adapters together). Writes ``adapter-load-<device>.json`` after each
configuration and ``adapter-load-<device>.md`` (a summary) at the end.

    python benchmarks/bench_adapter_load.py --device cpu --out /tmp/adapter-load            # embedded model, CPU
    python benchmarks/bench_adapter_load.py --device cuda --out benchmarks/results/<dir>     # random:llama-2-7b
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from bench_e2e import log  # noqa: E402
from bench_serve import free_port, start_server, stop_server, stream_chunks, wait_healthy  # noqa: E402

from vlora.lora.random_adapter import write_random_adapter  # noqa: E402
from vlora.models.loader import RANDOM_PRESETS, lora_shape, resolve_model_dir  # noqa: E402

TARGET = 0.05          # the pause a load may add to the streams, as a fraction of the time it takes


async def stream(client, body: dict, times: list[float], stop: asyncio.Event) -> None:
    """One streaming completion; each chunk that carries tokens appends its arrival time, until ``stop``."""
    async with contextlib.aclosing(stream_chunks(client, body)) as chunks:    # closed when ``stop`` ends it early
        async for now, n, _ in chunks:
            if n:
                times.append(now)
            if stop.is_set():
                return


async def one_request(client, model: str, prompt: list[int]) -> tuple[float, float]:
    """(sent, answered) times of a 1-token completion on ``model``."""
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
    if r.status_code != 200:
        raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
    return t0, time.perf_counter()


def gap_stats(gaps: list[float]) -> dict | None:
    if not gaps:
        return None
    s = sorted(gaps)
    return {"n": len(s), "median_s": statistics.median(s), "p99_s": s[min(len(s) - 1, int(0.99 * len(s)))],
            "max_s": s[-1]}


def classify(times: list[list[float]], warm: int, windows: dict[str, list[tuple[float, float]]]) -> dict:
    """Every stream's gaps between chunks after its first ``warm``, by the kind of window they overlap (a gap
    overlapping none is ``outside``)."""
    out: dict[str, list[float]] = {kind: [] for kind in (*windows, "outside")}
    for t in times:
        for a, b in zip(t[warm:], t[warm + 1:]):
            kind = next((k for k, spans in windows.items() if any(a < end and b > start for start, end in spans)),
                        "outside")
            out[kind].append(b - a)
    return out


def progress(t: list[float], at: float) -> float:
    """How many tokens stream ``t`` (its chunks' arrival times) had at time ``at``, counting the token under way
    in proportion to the part of its gap gone by: a window's tokens then do not jump by one as its edges move."""
    i = bisect.bisect_right(t, at)
    if i == 0 or i == len(t):
        return float(i)
    return i - 1 + (at - t[i - 1]) / (t[i] - t[i - 1])


def arrivals(times: list[list[float]], warm: int, start: float, end: float) -> float:
    """Tokens the streams received in [start, end) (:func:`progress`), mean over the streams (those after each
    one's first ``warm``)."""
    return statistics.fmean(progress(t[warm:], end) - progress(t[warm:], start) for t in times)


def itl_trend(times: list[list[float]], warm: int, windows: list[tuple[float, float]]):
    """The streams' inter-token time as a line over time, fitted to the quiet stretches between consecutive
    windows (each stretch's length over the tokens received in it, weighted by those tokens): a function of the
    time, or None where fewer than two stretches received tokens. A line: the streams' gaps grow as their
    contexts do; fitted to every stretch rather than to a window's neighbours alone, whose few tokens (a CPU
    server's dozen a second) would leave the baseline uncertain by more than the pause it is to show."""
    edges = sorted(windows)
    stretches = [(e1, s2) for (_, e1), (s2, _) in zip(edges, edges[1:]) if s2 > e1]
    points = [((lo + hi) / 2, (hi - lo) / n, n) for lo, hi in stretches if (n := arrivals(times, warm, lo, hi)) > 0]
    if len(points) < 2:
        return None
    w = sum(n for _, _, n in points)
    mx = sum(x * n for x, _, n in points) / w
    my = sum(y * n for _, y, n in points) / w
    var = sum(n * (x - mx) ** 2 for x, _, n in points)
    slope = sum(n * (x - mx) * (y - my) for x, y, n in points) / var if var > 0 else 0.0
    return lambda x: my + slope * (x - mx)


def delays(times: list[list[float]], warm: int, spans: list[tuple[float, float]], itl: float,
           windows: list[tuple[float, float]]) -> list[float]:
    """Per window of ``spans``: how far behind the streams fell during it, in seconds: its length less the
    tokens they received in it times their inter-token time then (:func:`itl_trend` over every window; ``itl``
    where it has no line), mean over the streams. Counting tokens in the window rather than summing the gaps
    that overlap it: a gap that straddles a window's edge is more likely a long one, and gaps are skewed (a CPU
    server's p99 is twice its median), so summed gaps would gather delay with no pause."""
    trend = itl_trend(times, warm, windows)
    return [(end - start) - arrivals(times, warm, start, end) * (trend((start + end) / 2) if trend else itl)
            for start, end in spans]


def server_load_seconds(text: str) -> tuple[float, float]:
    """(sum, count) of the server's ``vlora_adapter_load_seconds``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vlora_adapter_load_seconds_sum", "vlora_adapter_load_seconds_count"):
                out[s.name] = s.value
    return out.get("vlora_adapter_load_seconds_sum", 0.0), out.get("vlora_adapter_load_seconds_count", 0.0)


SETTINGS = {"greedy": {}, "sampled": {"temperature": 0.8, "top_p": 0.95}}
"""The streams' decoding (BENCHMARKS.md: greedy and sampled)."""


def load_names(setting: str, rank: int, loads: int) -> tuple[str, list[str]]:
    """The adapters of DIR a configuration loads: one not recorded, then the measured ones."""
    return f"{setting[0]}w{rank}", [f"{setting[0]}r{rank}-{j}" for j in range(loads)]


async def configuration(args, client, setting: str, rank: int, prompts: list[list[int]],
                        running: list[str]) -> dict:
    warm_name, names = load_names(setting, rank, args.loads)
    stop = asyncio.Event()
    times: list[list[float]] = [[] for _ in prompts]
    bodies = [{"model": running[i % len(running)], "prompt": p, "max_tokens": args.max_stream_tokens,
               "ignore_eos": True, "stream": True, "seed": i, **SETTINGS[setting]} for i, p in enumerate(prompts)]
    tasks = [asyncio.ensure_future(stream(client, b, t, stop)) for b, t in zip(bodies, times)]
    short = prompts[0][:4]
    windows: dict[str, list[tuple[float, float]]] = {"load": [], "control": []}
    before = server_load_seconds((await client.get("/metrics")).text)
    try:
        while min(len(t) for t in times) < args.warm:
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        # not recorded: the first new request among the streams (a batch size's first use captures its decode
        # graph), the first load of this rank
        await one_request(client, warm_name, short)
        await one_request(client, warm_name, short)
        for name in names:
            if any(t.done() for t in tasks):             # a stream ended (its limit): no more windows to measure
                break
            await asyncio.sleep(args.spacing)
            windows["load"].append(await one_request(client, name, short))
            await asyncio.sleep(args.spacing)
            # the control: a like request on an adapter of the load's rank, loaded already (the configuration's
            # first load), so that what the load's request costs beyond it is the load, not its adapter's rank
            windows["control"].append(await one_request(client, warm_name, short))
        await asyncio.sleep(args.spacing)
    finally:
        stop.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [d for d in done if isinstance(d, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} streams failed, the first: {failed[0]!r}")
    # a window counts while every stream runs on through the quiet stretch after it
    alive = min(t[-1] for t in times)
    dropped = sum(end + args.spacing > alive for spans in windows.values() for _, end in spans)
    windows = {kind: [w for w in spans if w[1] + args.spacing <= alive] for kind, spans in windows.items()}
    if not windows["load"] or not windows["control"]:
        raise RuntimeError(f"the streams ended before a load and a control were measured: raise --max-stream-tokens "
                           f"({args.max_stream_tokens}; at most the model's context less --input-len)")
    gaps = classify(times, args.warm, windows)
    stats = {kind: gap_stats(g) for kind, g in gaps.items()}
    itl = stats["outside"]["median_s"]
    every = [w for spans in windows.values() for w in spans]
    delay = {kind: delays(times, args.warm, spans, itl, every) for kind, spans in windows.items()}
    pause = statistics.fmean(delay["load"]) - statistics.fmean(delay["control"])
    pause_se = standard_error(delay["load"], delay["control"])
    load_s = statistics.fmean(end - start for start, end in windows["load"])
    after = server_load_seconds((await client.get("/metrics")).text)
    loads = after[1] - before[1]
    res = {"setting": setting, "load_rank": rank, "loads": names, "windows_measured": {k: len(v) for k, v in
           windows.items()}, "windows_dropped": dropped, "gaps": stats, "delay_s": delay, "load_pause_s": pause,
           "load_pause_over_load_time": pause / load_s, "load_pause_over_median_itl": pause / itl,
           "load_pause_se_s": pause_se, "load_pause_se_over_load_time": pause_se / load_s,
           "within_target": pause / load_s <= TARGET,
           "load_latency_client_s": [end - start for start, end in windows["load"]],
           "control_latency_client_s": [end - start for start, end in windows["control"]],
           "load_seconds_server_mean": (after[0] - before[0]) / loads if loads else None,
           "tokens_per_stream": [len(t) for t in times]}
    return res


def standard_error(a: list[float], b: list[float]) -> float:
    """The standard error of mean(a) - mean(b), the two samples independent (0 where one has fewer than 2)."""
    if min(len(a), len(b)) < 2:
        return 0.0
    return (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5


def summary_lines(res: dict) -> list[str]:
    lines = [f"# Adapters loaded on first request: {res['device']}, {res['model']}", "",
             f"{res['streams']} streams on {res['running']} adapters given at start (rank {res['running_rank']}), "
             f"{res['loads']} loads per configuration. Gaps between a stream's chunks in ms, median / p99 / max, "
             f"outside any window, during a control request, during a load. Delay: how far behind the streams fell "
             f"during a window (its length less its tokens times the inter-token time then, fitted to the quiet "
             f"stretches), mean over windows. Pause of a load: its delay less a control's, "
             f"over the load's time (target <= {TARGET:.0%}; ± its standard error over the loads and controls) and in "
             f"inter-token times.", "",
             "| streams | load rank | gaps outside | gaps during controls | gaps during loads | delay: control / load (ms) "
             "| pause of a load: over its time, in ITLs | load time, server mean (client) |",
             "|---|---|---|---|---|---|---|---|"]
    for c in res["configurations"]:
        g = c["gaps"]
        cells = ["-" if g[k] is None else " / ".join(f"{1e3 * g[k][q]:.0f}" for q in ("median_s", "p99_s", "max_s"))
                 for k in ("outside", "control", "load")]
        server = c["load_seconds_server_mean"]
        lines.append(f"| {c['setting']} | {c['load_rank']} | " + " | ".join(cells) + " | "
                     + " / ".join(f"{1e3 * statistics.fmean(c['delay_s'][k]):.1f}" for k in ("control", "load"))
                     + f" | {100 * c['load_pause_over_load_time']:.1f} ± "
                       f"{100 * c.get('load_pause_se_over_load_time', float('nan')):.1f} %, "
                       f"{c['load_pause_over_median_itl']:.2f} ({c.get('windows_measured', {}).get('load', '?')} loads) "
                     + f"| {1e3 * server if server is not None else float('nan'):.0f} ms "
                       f"({1e3 * statistics.fmean(c['load_latency_client_s']):.0f} ms) |")
    return lines


async def run(args, res: dict, path: Path, adapter_dir: Path, running: dict[str, str]) -> None:
    import httpx

    port = free_port()
    args.serve_args = f"--adapter-dir {adapter_dir} {args.serve_args}"
    proc = start_server(args, running, port)
    g = torch.Generator().manual_seed(0)
    preset = RANDOM_PRESETS.get(args.model.removeprefix("random:")) if args.model.startswith("random:") else None
    high = min(1000, preset["vocab_size"]) if preset else 1000     # ids every model's vocabulary holds
    prompts = torch.randint(3, high, (args.streams, args.input_len), generator=g).tolist()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=args.request_timeout,
                                     limits=httpx.Limits(max_connections=args.streams + 8)) as client:
            t = time.perf_counter()
            await wait_healthy(client, proc, args.start_timeout)
            res["start_s"] = time.perf_counter() - t
            log(f"server healthy after {res['start_s']:.1f} s")
            context = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
            if context <= args.input_len:
                raise RuntimeError(f"--input-len {args.input_len} leaves no room in the served context {context}")
            if args.max_stream_tokens > context - args.input_len:      # a small model's context (CPU runs)
                args.max_stream_tokens = context - args.input_len
                log(f"streams of at most {args.max_stream_tokens} tokens (context {context})")
            res["max_stream_tokens"] = args.max_stream_tokens
            await one_request(client, "warm-0", prompts[0][:4])              # the first load's one-time costs
            for name in running:
                await one_request(client, name, prompts[0][:4])
            for setting, rank in [(s, r) for s in args.settings for r in args.load_ranks]:
                c = await configuration(args, client, setting, rank, prompts, list(running))
                res["configurations"].append(c)
                path.write_text(json.dumps(res, indent=2))
                g = c["gaps"]
                log(f"{setting}, rank {rank}: median ITL {1e3 * g['outside']['median_s']:.1f} ms; a load's pause "
                    f"{1e3 * c['load_pause_s']:.1f} ms = {100 * c['load_pause_over_load_time']:.1f} ± "
                    f"{100 * c['load_pause_se_over_load_time']:.1f} % of its time "
                    f"(target <= {TARGET:.0%}), {c['load_pause_over_median_itl']:.2f} ITLs; max gap during loads "
                    f"{1e3 * g['load']['max_s']:.1f} ms, controls {1e3 * g['control']['max_s']:.1f} ms, outside "
                    f"{1e3 * g['outside']['max_s']:.1f} ms; loads {c['load_seconds_server_mean']} s (server mean)")
    finally:
        stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: random:llama-2-7b on CUDA, the embedded SmolLM2 on CPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", type=int, default=None, help="concurrent streams (default 16 on CUDA, 4 on CPU)")
    ap.add_argument("--running", type=int, default=4, help="adapters given at start, the streams' adapters")
    ap.add_argument("--running-rank", type=int, default=16)
    ap.add_argument("--load-ranks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="one configuration per rank of the adapters loaded (default 16,64 on CUDA, 8,64 on CPU)")
    ap.add_argument("--loads", type=int, default=None, help="loads per configuration (default 4 on CUDA, 3 on CPU)")
    ap.add_argument("--input-len", type=int, default=None, help="stream prompt tokens (default 128 on CUDA, 16 on CPU)")
    ap.add_argument("--settings", type=lambda s: s.split(","), default=list(SETTINGS),
                    help="the streams' decoding, one configuration each per load rank: greedy, sampled "
                         "(temperature 0.8, top_p 0.95)")
    ap.add_argument("--warm", type=int, default=8, help="tokens every stream has before the first load")
    ap.add_argument("--spacing", type=float, default=None,
                    help="seconds of quiet around each load and control (default 0.5 on CUDA, 1.0 on CPU)")
    ap.add_argument("--max-stream-tokens", type=int, default=3800,
                    help="a stream's limit: loads stop once a stream reaches it, and windows after a stream ended "
                         "are not measured (the context must hold --input-len plus this)")
    ap.add_argument("--serve-args", default="", help="extra `vlora serve` options")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("random:llama-2-7b" if cuda else str(resolve_model_dir(None)))
    args.streams = args.streams or (16 if cuda else 4)
    args.load_ranks = args.load_ranks or ([16, 64] if cuda else [8, 64])
    args.loads = args.loads or (4 if cuda else 3)
    args.input_len = args.input_len or (128 if cuda else 16)
    args.spacing = args.spacing if args.spacing is not None else (0.5 if cuda else 1.0)
    args.profile = None                         # start_server's cProfile option, unused here
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    tag = gpu.lower().replace(" ", "-")
    path = args.out / f"adapter-load-{tag}.json"
    shape = lora_shape(args.model)
    res = dict(date=dt.date.today().isoformat(), device=gpu, model=shape.name, streams=args.streams,
               running=args.running, running_rank=args.running_rank, loads=args.loads, input_len=args.input_len,
               spacing_s=args.spacing, warm_tokens=args.warm, serve_args=args.serve_args, torch=torch.__version__,
               target_pause_over_load_time=TARGET, configurations=[])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        log(f"writing adapters for {shape.name}")
        running = {f"run-{j}": str(write_random_adapter(tmp / "start" / f"run-{j}", shape, args.running_rank, j))
                   for j in range(args.running)}
        write_random_adapter(tmp / "dir" / "warm-0", shape, min(args.load_ranks), 99)
        for i, (setting, rank) in enumerate((s, r) for s in args.settings for r in args.load_ranks):
            warm_name, names = load_names(setting, rank, args.loads)
            for j, name in enumerate([warm_name, *names]):
                write_random_adapter(tmp / "dir" / name, shape, rank, 100 * (i + 1) + j)
        asyncio.run(run(args, res, path, tmp / "dir", running))
    lines = summary_lines(res)
    (args.out / f"adapter-load-{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
