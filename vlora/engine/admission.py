"""Latency targets and early-abort admission control (S-LoRA Appendix B).

An adapter (an application) or a single request may declare an :class:`SLO`: a
time-to-first-token target, an end-to-end latency target, or both. Before a
request is first served, every iteration checks whether it can still meet its
targets: the time it has already waited plus the estimated time to prefill it
behind the prompt tokens ahead of it (the unprefilled rest of the running
requests', then the waiting requests' before it) and, for the latency target,
to decode its ``max_tokens`` must fit. Where the scheduler bounds the prompt
tokens beside running decodes (``max_prefill_tokens_with_decodes``, and at
most 8 prompt chunks where mixed CUDA graphs replay them), those tokens go a
chunk per iteration and each iteration is also a decode step: the estimate
counts both. A request that cannot is rejected at once, with
the numbers in its reason, rather than served late and holding memory others
could use. Requests already being served are never aborted.

Estimates come from this machine: :class:`ServiceEstimator` keeps running means
of the decode-iteration time and of the time per prefill token, fed by the
engine after every iteration. With no measurement yet only the waiting time
counts, so nothing is rejected on a guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlora.engine.sequence import Sequence


class SLOError(ValueError):
    """An SLO value is not a positive finite number of seconds."""


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    """Time to first token, seconds (from arrival)."""
    latency_s: float | None = None
    """End-to-end latency, seconds (from arrival to the last token)."""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "latency_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise SLOError(f"{name} must be a positive number of seconds, got {v!r}")


class ServiceEstimator:
    """Running means of what an iteration costs here: a decode iteration, and each prefill token on top."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.decode_step_s = 0.0
        self.prefill_token_s = 0.0

    def _mix(self, old: float, new: float) -> float:
        return new if old == 0.0 else (1 - self.weight) * old + self.weight * new

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        if prefill_tokens == 0:
            if decodes:
                self.decode_step_s = self._mix(self.decode_step_s, seconds)
            return
        per_token = max(0.0, seconds - (self.decode_step_s if decodes else 0.0)) / prefill_tokens
        self.prefill_token_s = self._mix(self.prefill_token_s, per_token)

    def prefill_s(self, tokens: int, chunk: int | None = None, first: int | None = None, prompts: int = 1,
                  per_iteration: int | None = None) -> float:
        """Seconds to prefill ``tokens`` prompt tokens of ``prompts`` prompts: their own time, plus, where they
        go at most ``chunk`` tokens and ``per_iteration`` prompts per iteration beside decodes, a decode step per
        iteration. ``first``: tokens the passes before anything decodes take (whole token budgets; None: decodes
        run already, every iteration is bounded)."""
        own = tokens * self.prefill_token_s
        if chunk is None or tokens <= 0:
            return own
        rest = tokens if first is None else max(0, tokens - first)
        steps = -(-rest // chunk)
        if per_iteration and rest:
            steps = max(steps, -(-max(prompts, 1) // per_iteration))
        return own + steps * self.decode_step_s


class Admission:
    def __init__(self):
        self.adapter_slos: dict[str | None, SLO] = {}      # None: requests for the base model
        self.num_rejected = 0

    def set_slo(self, adapter: str | None, slo: SLO | None) -> None:
        if slo is None:
            self.adapter_slos.pop(adapter, None)
        else:
            self.adapter_slos[adapter] = slo

    def slo_for(self, seq: Sequence) -> SLO | None:
        return seq.slo if seq.slo is not None else self.adapter_slos.get(seq.adapter_name)

    def reject(self, waiting: list[Sequence], now: float, est: ServiceEstimator, running: list[Sequence] = (),
               chunk: int | None = None, budget: int | None = None,
               per_iteration: int | None = None) -> list[tuple[Sequence, str]]:
        """The not-yet-served requests of ``waiting`` (in queue order) that can no longer meet their SLO.
        ``running``: the requests being served (their prompt tokens left are prefilled first; any decoding makes
        every iteration a bounded one); ``chunk`` and ``per_iteration``: the prompt tokens and prompts an
        iteration takes beside decodes (None: not counted); ``budget``: the tokens an iteration takes when nothing
        decodes (until the first prompt in line ends, its sequence then decoding)."""
        if not self.adapter_slos and all(s.slo is None for s in waiting):
            return []               # every iteration asks: without targets, the running batch is not walked
        out = []
        left = [n for n in (s.num_tokens - s.num_computed for s in running) if n > 1]
        tokens_ahead, prompts_ahead = sum(left), len(left)
        decoding = any(s.num_tokens - s.num_computed == 1 for s in running)
        first = None                # nothing decodes: the passes until the first prompt in line ends are unbounded
        if not decoding and chunk is not None and budget:
            lead = left[0] if left else (waiting[0].num_tokens - waiting[0].num_computed if waiting else 0)
            first = max(1, -(-lead // budget)) * budget
            prompts_ahead -= 1      # the lead prompt ends in those passes
        for seq in waiting:
            need = seq.num_tokens - seq.num_computed
            slo = self.slo_for(seq)
            fresh = not seq.output_token_ids and seq.num_computed == 0 and seq.num_preemptions == 0
            if slo is not None and fresh:
                waited = now - seq.arrival_time
                to_first = est.prefill_s(tokens_ahead + need, chunk, first, prompts_ahead + 1, per_iteration)
                if slo.ttft_s is not None and waited + to_first > slo.ttft_s:
                    out.append((seq, f"rejected early: cannot meet its TTFT SLO of {slo.ttft_s:g} s (waited "
                                     f"{waited:.3f} s, about {to_first:.3f} s more to prefill)"))
                    continue
                total = to_first + seq.params.max_tokens * est.decode_step_s
                if slo.latency_s is not None and waited + total > slo.latency_s:
                    out.append((seq, f"rejected early: cannot meet its latency SLO of {slo.latency_s:g} s (waited "
                                     f"{waited:.3f} s, about {total:.3f} s more to serve)"))
                    continue
            tokens_ahead += need
            prompts_ahead += 1
        self.num_rejected += len(out)
        return out
