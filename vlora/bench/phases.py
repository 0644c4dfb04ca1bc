"""Where an engine step's host time goes, phase by phase, and how long the GPU waits between decode forwards
(benchmarks: ``bench_e2e.py``, ``profile_step.py``, ``host_step.py``).

:class:`PhaseTimer` wraps the engine's phase methods for as long as it is open (nothing in the engine pays for it
otherwise). Each phase's time is its own, without the phases it calls; ``wait`` is the time the host blocks on
sampled tokens (with async scheduling the next forward is already queued by then); ``runner`` is the runner's
own time (the whole eager forward of an iteration no graph replays; a mixed graph's replay, prompt chunks
beside decodes, counts as ``inputs`` and ``stage+replay`` as a decode graph's does); ``other`` is the step's own
(the lookahead's checks, counting queued tokens). On CUDA it also records an
event pair around every graph replay, decode or mixed; ``gpu_gaps_ms`` are the times between one replay's end and the next one's
start on the GPU (sampling, the token copy and the GPU's idle time between forwards).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from vlora.engine import sampler

PHASES = ("schedule", "memory.prepare", "inputs", "stage+replay", "sample", "wait", "runner", "finish",
          "memory.after", "other")


class PhaseTimer:
    def __init__(self, engine):
        self.engine = engine
        self.steps: list[dict] = []          # per step: phase -> seconds, "batch", "decode_only", "wall"
        self._stack: list[list] = []         # [phase, start, time spent in nested phases]
        self._undo: list = []
        self._events: list = []              # (start, end) CUDA events around each graph replay
        self._event_steps: list[int] = []    # the step each pair belongs to
        runner = engine.runner
        self._wrap(engine, "step", "other", self._around_step)
        self._wrap(engine, "_schedule", "schedule")
        self._wrap(engine.memory, "prepare", "memory.prepare")
        self._wrap(runner, "_replay", "inputs")
        self._wrap(runner, "_replay_mixed", "inputs")       # prompt chunks beside decodes, from a mixed graph
        self._wrap(runner, "run", "runner")
        self._wrap(runner, "launch", "runner")
        self._wrap(engine, "_finish", "finish")
        self._wrap(engine.memory, "after", "memory.after")
        self._wrap(runner.sampler, "sample", "sample")
        self._wrap(sampler.Sampled, "result", "wait")
        if runner.graphs is not None:
            self._wrap(runner.graphs, "run", "stage+replay", self._around_replay)
            self._wrap(runner.graphs, "run_mixed", "stage+replay", self._around_replay)

    def _wrap(self, obj, name: str, phase: str, around=None) -> None:
        had = name in vars(obj)
        orig = getattr(obj, name)
        timed = self._timed(orig, phase)
        setattr(obj, name, around(timed) if around else timed)
        self._undo.append((obj, name, orig if had else None))

    def _timed(self, fn, phase: str):
        stack = self._stack

        def timed(*args, **kw):
            stack.append([phase, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kw)
            finally:
                ph, t0, nested = stack.pop()
                spent = time.perf_counter() - t0
                if stack:
                    stack[-1][2] += spent
                if self._cur is not None:
                    self._cur[ph] += spent - nested
        return timed

    _cur: dict | None = None

    def _around_step(self, timed_step):
        def step():
            sched = self.engine.scheduler
            before = {s.request_id: s.num_computed for s in sched.unfinished()}
            self._cur = defaultdict(float)
            t0 = time.perf_counter()
            out = timed_step()
            wall = time.perf_counter() - t0
            decode_only = all(s.num_computed - before.get(s.request_id, s.num_computed) <= 1
                              for s in sched.unfinished())
            self._cur.update(batch=len(before), decode_only=decode_only and bool(out), wall=wall)
            self.steps.append(dict(self._cur))
            self._cur = None
            return out
        return step

    def _around_replay(self, timed_run):
        cuda = self.engine.device.type == "cuda"

        def run(*args, **kw):
            if not cuda:
                return timed_run(*args, **kw)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = timed_run(*args, **kw)
            end.record()
            if out is not None:              # None: no graph replayed (the eager forward follows)
                self._events.append((start, end))
                self._event_steps.append(len(self.steps))
            return out
        return run

    def close(self) -> None:
        for obj, name, orig in reversed(self._undo):
            if orig is None:
                delattr(obj, name)
            else:
                setattr(obj, name, orig)
        self._undo = []

    def summary(self, batch: int) -> dict:
        """Medians over the decode-only steps of ``batch`` sequences: microseconds per phase, the step's wall
        time, its host time (wall less the wait for tokens) and, on CUDA, the GPU's time between forwards."""
        picked = [i for i, s in enumerate(self.steps) if s["decode_only"] and s["batch"] == batch]
        if not picked:
            return {}
        med = lambda xs: 1e6 * statistics.median(xs)          # noqa: E731
        out = {f"{p}_us": med([self.steps[i].get(p, 0.0) for i in picked]) for p in PHASES}
        out["wall_us"] = med([self.steps[i]["wall"] for i in picked])
        out["host_us"] = med([self.steps[i]["wall"] - self.steps[i].get("wait", 0.0) for i in picked])
        out["steps"] = len(picked)
        gaps = self.gpu_gaps_ms(set(picked))
        if gaps:
            out["gpu_gap_us"] = 1e3 * statistics.median(gaps)
        return out

    def gpu_gaps_ms(self, steps: set[int] | None = None) -> list[float]:
        """GPU time from the end of each graph replay to the start of the next (replays of the given steps)."""
        if not self._events:
            return []
        self._events[-1][1].synchronize()
        out = []
        for k in range(1, len(self._events)):
            if steps is None or self._event_steps[k] in steps:
                out.append(self._events[k - 1][1].elapsed_time(self._events[k][0]))
        return out


def format_summary(s: dict) -> str:
    """One line of :meth:`PhaseTimer.summary`: microseconds per phase (median step)."""
    if not s:
        return "no decode-only steps of that batch"
    parts = ", ".join(f"{p} {s[p + '_us']:.0f}" for p in PHASES if s[p + "_us"] >= 0.5)
    line = f"step {s['wall_us']:.0f} us, host {s['host_us']:.0f} us ({parts})"
    if "gpu_gap_us" in s:
        line += f"; GPU between forwards {s['gpu_gap_us']:.0f} us"
    return line
