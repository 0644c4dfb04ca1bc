"""Serving workloads of ``../shared/BENCHMARKS.md``: request arrival processes, adapter popularity, the
V-LoRA application profiles, dynamic popularity, multi-turn sessions, and trace files.

A workload is a list of :class:`RequestSpec` sorted by arrival time (seconds
from the start). Lengths are in tokens. Visual tokens are counted as prompt
tokens (``image_tokens`` says how many of them are an image's) until the vision
models serve real images. A multi-turn session's turn ``k > 0`` carries
``after_s``: it is sent that long after turn ``k - 1`` finished (its prompt is
the whole history plus the new tokens), so its arrival is decided at run time.
Every generator is seeded and pure.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float
    adapter: str | None
    input_len: int
    output_len: int
    session: int | None = None        # multi-turn: session id
    turn: int = 0
    after_s: float = 0.0              # turn > 0: think time after the previous turn finished
    image_tokens: int = 0             # of input_len, the visual tokens (retrieval / video profiles)


def adapter_names(n: int) -> list[str]:
    return [f"a{i}" for i in range(n)]


def power_law_rates(n: int, alpha: float, total_rate: float) -> list[float]:
    """lambda_i proportional to (i + 1)^-alpha, summing to ``total_rate`` (S-LoRA §7.2)."""
    w = [(i + 1) ** -alpha for i in range(n)]
    s = sum(w)
    return [total_rate * x / s for x in w]


def skewed_shares(n: int, skewness: float) -> list[float]:
    """The most popular adapter gets ``skewness`` of the requests, the others share the rest evenly (V-LoRA §6)."""
    if not 0 < skewness <= 1:
        raise ValueError(f"skewness must be in (0, 1], got {skewness}")
    if n == 1:
        return [1.0]
    return [skewness] + [(1 - skewness) / (n - 1)] * (n - 1)


def popularity_shares(n: int, kind: str) -> list[float]:
    """Punica's distributions: distinct (every request its own adapter: uniform over n), uniform, skewed
    (Zipf-1.5), identical (one adapter)."""
    if kind in ("uniform", "distinct"):
        return [1.0 / n] * n
    if kind == "skewed":
        w = [(i + 1) ** -1.5 for i in range(n)]
        return [x / sum(w) for x in w]
    if kind == "identical":
        return [1.0] + [0.0] * (n - 1)
    raise ValueError(f"unknown popularity {kind!r} (distinct, uniform, skewed, identical)")


def gamma_arrivals(rng: random.Random, rate: float, cv: float, duration_s: float) -> list[float]:
    """Arrival times of a Gamma renewal process of mean rate ``rate`` and coefficient of variation ``cv``
    (cv = 1: Poisson)."""
    if rate <= 0:
        return []
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    t, out = 0.0, []
    while True:
        t += rng.gammavariate(shape, scale)
        if t >= duration_s:
            return out
        out.append(t)


def synthetic(num_adapters: int = 200, alpha: float = 1.0, cv: float = 1.0, rate: float = 2.0,
              duration_s: float = 300.0, input_range=(8, 512), output_range=(8, 512), seed: int = 0,
              shares: list[float] | None = None) -> list[RequestSpec]:
    """S-LoRA §7.2: adapter i's requests a Gamma process of rate lambda_i (power law of exponent ``alpha``, or
    ``shares`` of the total rate if given), lengths uniform in the given ranges."""
    rng = random.Random(seed)
    names = adapter_names(num_adapters)
    rates = power_law_rates(num_adapters, alpha, rate) if shares is None else [rate * s for s in shares]
    out = []
    for name, lam in zip(names, rates):
        for t in gamma_arrivals(rng, lam, cv, duration_s):
            out.append(RequestSpec(t, name, rng.randint(*input_range), rng.randint(*output_range)))
    return sorted(out, key=lambda r: r.arrival_s)


def visual_retrieval(rate: float, duration_s: float, num_adapters: int = 8, skewness: float | None = None,
                     seed: int = 0) -> list[RequestSpec]:
    """V-LoRA §6.1 visual retrieval: one image (256-576 visual tokens) + a short question (8-32 tokens),
    200-256 output tokens, Poisson arrivals."""
    rng = random.Random(seed)
    names = adapter_names(num_adapters)
    shares = skewed_shares(num_adapters, skewness) if skewness else [1 / num_adapters] * num_adapters
    out = []
    for t in gamma_arrivals(rng, rate, 1.0, duration_s):
        img = rng.randint(256, 576)
        out.append(RequestSpec(t, rng.choices(names, shares)[0], img + rng.randint(8, 32), rng.randint(200, 256),
                               image_tokens=img))
    return out


def video_analytics(streams: int, duration_s: float, num_adapters: int = 8, frames: int = 6,
                    tokens_per_frame: int = 256, seed: int = 0) -> list[RequestSpec]:
    """V-LoRA §6.1 video analytics: each stream sends one chunk a second (``frames`` frames of
    ``tokens_per_frame`` visual tokens + a short question) to its task's adapter; 5-10 output tokens."""
    rng = random.Random(seed)
    names = adapter_names(num_adapters)
    out = []
    for s in range(streams):
        phase = rng.random()
        adapter = names[s % num_adapters]
        for k in range(int(duration_s)):
            if k + phase >= duration_s:
                break
            img = frames * tokens_per_frame
            out.append(RequestSpec(k + phase, adapter, img + rng.randint(8, 16), rng.randint(5, 10),
                                   image_tokens=img))
    return sorted(out, key=lambda r: r.arrival_s)


def dynamic_popularity(phases: list[tuple[float, int]], num_adapters: int, rate: float, alpha: float = 1.0,
                       cv: float = 1.0, input_range=(8, 512), output_range=(8, 256), seed: int = 0
                       ) -> list[RequestSpec]:
    """FastLibra §6.2: the hot set shifts. ``phases`` = [(duration_s, active adapters), ...]; each phase draws
    a fresh random set of that many active adapters, power-law popular, at total ``rate``."""
    rng = random.Random(seed)
    names = adapter_names(num_adapters)
    out, t0 = [], 0.0
    for duration, active in phases:
        hot = rng.sample(names, min(active, num_adapters))
        for name, lam in zip(hot, power_law_rates(len(hot), alpha, rate)):
            for t in gamma_arrivals(rng, lam, cv, duration):
                out.append(RequestSpec(t0 + t, name, rng.randint(*input_range), rng.randint(*output_range)))
        t0 += duration
    return sorted(out, key=lambda r: r.arrival_s)


def multi_turn(sessions: int, turns: int, rate: float, num_adapters: int = 8, think_s: tuple = (0.5, 2.0),
               first_range=(64, 256), next_range=(16, 64), output_range=(16, 128), seed: int = 0
               ) -> list[RequestSpec]:
    """Chat sessions: first turns arrive as a Poisson process; each later turn adds ``next_range`` new tokens
    to the whole history and is sent ``think_s`` after the previous answer."""
    rng = random.Random(seed)
    names = adapter_names(num_adapters)
    out = []
    for sid, t in enumerate(gamma_arrivals(rng, rate, 1.0, sessions / rate * 10)[:sessions]):
        adapter = rng.choice(names)
        history = rng.randint(*first_range)
        for k in range(turns):
            if k:
                history += rng.randint(*next_range)
            n_out = rng.randint(*output_range)
            out.append(RequestSpec(t if k == 0 else math.inf, adapter, history, n_out, session=sid, turn=k,
                                   after_s=0.0 if k == 0 else rng.uniform(*think_s)))
            history += n_out
    return sorted(out, key=lambda r: (r.arrival_s, r.session or 0, r.turn))


def dynamic_multi_turn(phases: list[tuple[float, int]], num_adapters: int, session_rate: float, turns: int,
                       alpha: float = 1.0, think_s: tuple = (0.5, 2.0), first_range=(256, 1024),
                       next_range=(32, 128), output_range=(16, 96), seed: int = 0) -> list[RequestSpec]:
    """FastLibra's setting: multi-turn chat sessions whose adapters come from a hot set that shifts. ``phases`` =
    [(duration_s, active adapters), ...]; sessions start as a Poisson process at ``session_rate``, each on an
    adapter drawn power-law (``alpha``) from its phase's hot set; later turns as in :func:`multi_turn`."""
    rng = random.Random(seed)
    names = adapter_names(num_adapters)
    out, t0, sid = [], 0.0, 0
    for duration, active in phases:
        hot = rng.sample(names, min(active, num_adapters))
        weights = power_law_rates(len(hot), alpha, 1.0)
        for t in gamma_arrivals(rng, session_rate, 1.0, duration):
            adapter = rng.choices(hot, weights)[0]
            history = rng.randint(*first_range)
            for k in range(turns):
                if k:
                    history += rng.randint(*next_range)
                n_out = rng.randint(*output_range)
                out.append(RequestSpec(t0 + t if k == 0 else math.inf, adapter, history, n_out, session=sid,
                                       turn=k, after_s=0.0 if k == 0 else rng.uniform(*think_s)))
                history += n_out
            sid += 1
        t0 += duration
    return sorted(out, key=lambda r: (r.arrival_s, r.session or 0, r.turn))


# -- trace files ---------------------------------------------------------------------------------
TRACE_FIELDS = [f.name for f in fields(RequestSpec)]


def save_trace(specs: list[RequestSpec], path: str | Path) -> None:
    """CSV with a header (``timestamp`` = arrival_s) or JSON lines, by the file's suffix."""
    path = Path(path)
    rows = [asdict(s) for s in specs]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, ["timestamp"] + TRACE_FIELDS[1:])
        w.writeheader()
        for r in rows:
            r["timestamp"] = r.pop("arrival_s")
            r["adapter"] = "" if r["adapter"] is None else r["adapter"]
            w.writerow(r)


def load_trace(path: str | Path) -> list[RequestSpec]:
    """A trace of (timestamp, adapter, input_len, output_len[, session, turn, after_s, image_tokens]) rows,
    CSV with a header or JSON lines; timestamps are seconds and are shifted to start at 0."""
    path = Path(path)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    specs = []
    for i, r in enumerate(rows, 1):
        try:
            ts = float(r.get("timestamp", r.get("arrival_s")))
            adapter = r.get("adapter") or None
            session = r.get("session")
            specs.append(RequestSpec(ts, adapter, int(r["input_len"]), int(r["output_len"]),
                                     None if session in (None, "", "None") else int(session),
                                     int(r.get("turn") or 0), float(r.get("after_s") or 0.0),
                                     int(r.get("image_tokens") or 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: row {i} is not (timestamp, adapter, input_len, output_len): {e}") from None
        if specs[-1].input_len < 1 or specs[-1].output_len < 1:
            raise ValueError(f"{path}: row {i} has a length below 1")
    finite = [s.arrival_s for s in specs if math.isfinite(s.arrival_s)]
    t0 = min(finite, default=0.0)
    specs = [RequestSpec(s.arrival_s - t0, *list(asdict(s).values())[1:]) if math.isfinite(s.arrival_s) else s
             for s in specs]
    return sorted(specs, key=lambda r: (r.arrival_s, r.session or 0, r.turn))
