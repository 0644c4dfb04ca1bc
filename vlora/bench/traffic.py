"""The Traffic workload of ``benchmarks/bench_traffic.py``: Poisson arrivals at one rate, log-normal prompt and
output lengths given by their median and p99, Zipf popularity over the adapters, a share of requests on the base
model, and the latency statistics the benchmark reports.

A trace is a pure function of its arguments (the seed among them): the same call gives the same requests, prompt
token ids included, on any machine and Python version (``random.Random`` seeded with a string hashes it with
SHA-512, not with Python's per-process string hash).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass

Z_P99 = 2.326
"""The standard normal's 99th percentile: a log-normal's p99 is ``median * exp(Z_P99 * sigma)``."""


@dataclass(frozen=True)
class TrafficRequest:
    arrival_s: float           # seconds from the start of the rate's arrivals
    adapter: str | None        # None: the base model
    prompt: tuple[int, ...]    # token ids
    output_len: int            # max_tokens, with ignore_eos


def lognormal_sigma(median: float, p99: float) -> float:
    """The sigma of the log-normal with this median and p99."""
    if not 0 < median <= p99:
        raise ValueError(f"need 0 < median <= p99, got median {median}, p99 {p99}")
    return math.log(p99 / median) / Z_P99


def zipf_shares(n: int, alpha: float = 1.0) -> list[float]:
    """Adapter ``i``'s share of the adapter requests, proportional to (i + 1)^-alpha."""
    w = [(i + 1) ** -alpha for i in range(n)]
    s = sum(w)
    return [x / s for x in w]


def traffic_trace(rate: float, duration_s: float, adapters: list[str], seed: int, *, max_model_len: int,
                  vocab_size: int, prompt_median: float = 256, prompt_p99: float = 2048, output_median: float = 128,
                  output_p99: float = 1024, base_share: float = 0.1, alpha: float = 1.0) -> list[TrafficRequest]:
    """The requests arriving in ``duration_s`` seconds of a Poisson process at ``rate`` per second, sorted by
    arrival. Each is on the base model with probability ``base_share``, else on an adapter drawn by
    ``zipf_shares(len(adapters), alpha)`` (``adapters[0]`` the most popular). Lengths are rounded log-normal
    draws, the prompt clipped to [1, max_model_len - 1] and the output to [1, max_model_len - prompt], so that
    every request fits the context. Prompt token ids are uniform over [3, vocab_size) (past the usual special
    tokens). The stream of draws depends on ``seed`` and ``rate``, so that each rate of a sweep has its own
    trace and a rerun of one rate repeats it."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate}, {duration_s}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if not 0 <= base_share <= 1 or (not adapters and base_share < 1):
        raise ValueError(f"base_share must be in [0, 1] (1 without adapters), got {base_share}")
    rng = random.Random(f"traffic:{seed}:{rate!r}")
    mu_p, sigma_p = math.log(prompt_median), lognormal_sigma(prompt_median, prompt_p99)
    mu_o, sigma_o = math.log(output_median), lognormal_sigma(output_median, output_p99)
    cum = list(itertools.accumulate(zipf_shares(len(adapters), alpha))) if adapters else []
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        adapter = None
        if rng.random() >= base_share:
            # clamped: the last cumulative share may round just below 1.0
            adapter = adapters[min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(adapters) - 1)]
        prompt_len = min(max(1, round(rng.lognormvariate(mu_p, sigma_p))), max_model_len - 1)
        output_len = min(max(1, round(rng.lognormvariate(mu_o, sigma_o))), max_model_len - prompt_len)
        prompt = tuple(rng.randrange(3, vocab_size) for _ in range(prompt_len))
        out.append(TrafficRequest(t, adapter, prompt, output_len))


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by nearest rank; None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def chunk_gaps(times: list[float], counts: list[int]) -> list[float]:
    """The inter-token gaps of one stream from its token-bearing chunks (arrival times, tokens in each): a chunk of
    k tokens gives one gap since the previous chunk and k - 1 gaps of zero (its tokens came together); the first
    chunk's first token is the time to first token, not a gap. A stream of n tokens gives n - 1 gaps."""
    gaps: list[float] = []
    for j, (t, k) in enumerate(zip(times, counts)):
        if j:
            gaps.append(t - times[j - 1])
        gaps.extend([0.0] * (k - 1))
    return gaps
