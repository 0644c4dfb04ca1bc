"""Drive an engine with a workload in real time and record what happened.

:func:`run_workload` sends each request when its arrival time comes (multi-turn
follow-ups after the previous answer plus the think time), steps the engine
while there is work and sleeps until the next arrival when there is none. It
records per request the arrival, admission, first-token and finish times (TTFT,
its wait to be scheduled, TPOT, end-to-end latency) and per iteration the inference mode and batch size, and
every mode switch with its measured time. :class:`RunResult` turns that into
the metrics of ``../shared/BENCHMARKS.md``.

A request's clock starts when it is due (its trace arrival; a follow-up turn: the previous answer plus its think
time), not when the loop gets to send it: the engine steps in this thread, so a request due during a long
iteration is sent after it, and that wait is the user's too. How late each was sent is recorded (``late``), as
are the run's garbage-collector pauses; the collector runs over a frozen heap (everything alive before the run is
moved out of its generations), so that a full collection's cost does not depend on what earlier runs left.

Outputs have fixed lengths (``ignore_eos``), so every policy does the same work.
Prompts are seeded random token ids; a session's later turn is its previous
prompt and answer plus new tokens, so it shares their prefix.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from vlora.bench.workloads import RequestSpec
from vlora.engine.admission import SLO
from vlora.engine.engine import Engine
from vlora.sampling_params import SamplingParams


@dataclass
class RequestRecord:
    spec: RequestSpec
    request_id: str
    arrival: float                    # seconds from the start of the run, when it was due
    sent: float | None = None         # when the harness handed it to the engine (>= arrival)
    first_token: float | None = None
    admitted: float | None = None     # start of the first iteration that scheduled it (its wait ends there)
    finish: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queued(self) -> float | None:
        """Seconds from arrival to the iteration that first scheduled it (a prefix copy it waited for counts)."""
        return None if self.admitted is None else self.admitted - self.arrival

    @property
    def late(self) -> float | None:
        """Seconds it was sent after it was due (the iteration in progress when it came due)."""
        return None if self.sent is None else self.sent - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.tokens - 1)


@dataclass
class RunResult:
    records: list[RequestRecord]
    iterations: list[tuple[float, str, int]] = field(default_factory=list)   # (time, mode, batch size)
    switches: list[tuple[float, float]] = field(default_factory=list)        # (time, seconds taken)
    duration_s: float = 0.0
    label: dict = field(default_factory=dict)
    gc_pauses: list[tuple[int, float]] = field(default_factory=list)     # (generation, seconds) of each collection

    def metrics(self, ttft_slo_s: float | None = None) -> dict:
        done = [r for r in self.records if r.finish_reason in ("length", "stop")]
        ttfts = [r.ttft for r in done if r.ttft is not None]
        tpots = [r.tpot for r in done if r.tpot is not None]
        lats = [r.latency for r in done]
        tokens = sum(r.tokens for r in done)
        modes = [m for _, m, _ in self.iterations]
        out = dict(self.label)
        out.update(
            requests=len(self.records), finished=len(done), tokens=tokens,
            rejected=sum(r.finish_reason == "rejected" for r in self.records),
            unfinished=sum(r.finish is None for r in self.records),
            avg_token_latency_s=sum(lats) / tokens if tokens else None,
            # timed from when the loop sent each request instead of when it was due (what runs measured before)
            avg_token_latency_from_send_s=(sum(r.finish - r.sent for r in done if r.sent is not None) / tokens
                                           if tokens else None),
            throughput_req_s=len(done) / self.duration_s if self.duration_s else None,
            throughput_tok_s=tokens / self.duration_s if self.duration_s else None,
            duration_s=self.duration_s, iterations=len(modes),
            mode_share={m: modes.count(m) / len(modes) for m in sorted(set(modes))} if modes else {},
            switches=len(self.switches),
            switch_ms_mean=1e3 * statistics.mean(s for _, s in self.switches) if self.switches else None,
            switch_ms_max=1e3 * max(s for _, s in self.switches) if self.switches else None,
        )
        for name, xs in (("ttft", ttfts), ("tpot", tpots), ("latency", lats)):
            out.update(_stats(name, xs))
        # TTFT = the wait to be scheduled + the iterations from then to the first token (the prompt's chunks)
        out.update(_stats("queued", [r.queued for r in done if r.queued is not None]))
        out.update(_stats("late", [r.late for r in self.records if r.late is not None]))
        out.update(gc_collections=len(self.gc_pauses), gc_pause_s=sum(p for _, p in self.gc_pauses),
                   gc_full_collections=sum(g == 2 for g, _ in self.gc_pauses))
        out.update(_stats("ttft_scheduled", [r.first_token - r.admitted for r in done
                                             if r.first_token is not None and r.admitted is not None]))
        if any(r.spec.session is not None for r in done):    # multi-turn: a first turn has no history to reuse
            for part, keep in (("first_turn", lambda r: r.spec.turn == 0), ("later_turns", lambda r: r.spec.turn > 0)):
                rs = [r for r in done if keep(r)]
                out.update(_stats(f"ttft_{part}", [r.ttft for r in rs if r.ttft is not None]))
                out.update(_stats(f"queued_{part}", [r.queued for r in rs if r.queued is not None]))
        if ttft_slo_s is not None:
            out["slo_attainment"] = (sum(1 for r in self.records if r.ttft is not None and r.ttft <= ttft_slo_s)
                                     / len(self.records)) if self.records else None
        return out


def _stats(name: str, xs: list[float]) -> dict:
    if not xs:
        return {f"{name}_mean_s": None, f"{name}_p50_s": None, f"{name}_p90_s": None, f"{name}_p99_s": None}
    s = sorted(xs)
    q = lambda p: s[min(len(s) - 1, int(math.ceil(p * len(s))) - 1)]   # noqa: E731
    return {f"{name}_mean_s": statistics.mean(s), f"{name}_p50_s": q(0.5), f"{name}_p90_s": q(0.9),
            f"{name}_p99_s": q(0.99)}


def run_workload(engine: Engine, specs: list[RequestSpec], seed: int = 0, slo: SLO | None = None,
                 max_wall_s: float | None = None, progress: bool = False, freeze_gc: bool = True,
                 sampling: dict | None = None) -> RunResult:
    """Serve ``specs`` on ``engine`` in real time; returns the records. ``slo`` applies to every request;
    ``max_wall_s`` stops sending and serving after that long (unfinished requests are counted as such);
    ``freeze_gc``: collect and freeze the heap first (False: the collector as it is, to measure its effect);
    ``sampling``: :class:`SamplingParams` fields of every request (temperature, top_p, top_k; None: greedy)."""
    if freeze_gc:
        gc.collect()
        gc.freeze()
    watch = _GCWatch()
    gc.callbacks.append(watch)
    try:
        result = _serve(engine, specs, seed, slo, max_wall_s, progress, sampling or {})
    finally:
        gc.callbacks.remove(watch)
        if freeze_gc:
            gc.unfreeze()
    result.gc_pauses = watch.pauses
    return result


class _GCWatch:
    """gc.callbacks hook: the generation and duration of every collection."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info.get("generation", -1), time.perf_counter() - self._t0))


def _serve(engine: Engine, specs: list[RequestSpec], seed: int, slo: SLO | None, max_wall_s: float | None,
           progress: bool, sampling: dict) -> RunResult:
    rng = random.Random(seed)
    vocab = engine.model.cfg.vocab_size
    limit = engine.max_model_len - 1
    timed = sorted((s for s in specs if math.isfinite(s.arrival_s)), key=lambda s: s.arrival_s)
    follow: dict[int, list[RequestSpec]] = {}
    for s in specs:
        if not math.isfinite(s.arrival_s):
            follow.setdefault(s.session, []).append(s)
    for turns in follow.values():
        turns.sort(key=lambda s: s.turn)
    history: dict[int, list[int]] = {}
    records: dict[str, RequestRecord] = {}
    upcoming: list[tuple[float, RequestSpec]] = [(s.arrival_s, s) for s in timed]
    modes = engine.runner.modes
    switches_seen = modes.num_switches
    result = RunResult([])
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc="requests", unit="req")
    t0 = time.monotonic()

    def send(spec: RequestSpec, due: float, now: float) -> None:
        prev = history.get(spec.session, []) if spec.session is not None else []
        n_in = max(1, min(spec.input_len, limit - spec.output_len))
        prompt = (prev + [rng.randrange(3, vocab) for _ in range(max(0, n_in - len(prev)))])[-n_in:]
        out_len = max(1, min(spec.output_len, limit - len(prompt)))
        sp = SamplingParams(max_tokens=out_len, ignore_eos=True, seed=rng.randrange(2**31), **sampling)
        rid = engine.add_request(prompt, spec.adapter, sp, slo=slo)
        records[rid] = RequestRecord(spec, rid, due, sent=now)
        if spec.session is not None:
            history[spec.session] = prompt

    while True:
        now = time.monotonic() - t0
        if max_wall_s is not None and now > max_wall_s:
            break
        upcoming.sort(key=lambda x: x[0])
        while upcoming and upcoming[0][0] <= now:
            due, spec = upcoming.pop(0)
            send(spec, due, now)
        if not engine.has_unfinished():
            if not upcoming:
                break
            time.sleep(max(0.0, min(upcoming[0][0] - now, 0.05)))
            continue
        began = now
        outs = engine.step()
        now = time.monotonic() - t0
        for seq in engine.scheduler.running:          # scheduled by this step for the first time: admitted
            rec = records.get(seq.request_id)
            if rec is not None and rec.admitted is None:
                rec.admitted = began
        if engine.last_mode is not None:
            result.iterations.append((now, engine.last_mode.value, len(engine.scheduler.running)))
        if modes.num_switches != switches_seen:
            result.switches.append((now, modes.last_switch_s))
            switches_seen = modes.num_switches
        for o in outs:
            rec = records.get(o.request_id)
            if rec is None:
                continue
            if (o.delta_token_ids or o.finished) and rec.admitted is None and o.finish_reason != "rejected":
                rec.admitted = began                  # answered (or finished: a task head) by the step that admitted it
            if o.delta_token_ids and rec.first_token is None:
                rec.first_token = now
            rec.tokens = len(o.token_ids)
            if o.finished:
                rec.finish, rec.finish_reason, rec.error = now, o.finish_reason, o.error
                if bar is not None:
                    bar.update(1)
                s = rec.spec
                if s.session is not None and o.finish_reason != "rejected":
                    history[s.session] = list(o.prompt_token_ids) + list(o.token_ids)
                    nxt = [t for t in follow.get(s.session, []) if t.turn == s.turn + 1]
                    if nxt:
                        upcoming.append((now + nxt[0].after_s, nxt[0]))
    for rid, rec in records.items():                  # stopped by max_wall_s: free what is left
        if rec.finish is None:
            engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    if bar is not None:
        bar.close()
    result.records = list(records.values())
    result.duration_s = time.monotonic() - t0
    return result
