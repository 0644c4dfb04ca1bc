"""V-LoRA's scheduling policy (Alg. 1): which requests run next, and in which inference mode.

Each request earns a credit: the time it has waited, plus the execution time of
an iteration in the mode it would run in, plus the mode-switch time if getting
there needs a switch. Requests whose credit passes the threshold θ starve.

    starving = [r for r in R if credit(r) > θ];  room = max_bs - |starving|
    R_merge  = requests of the most requested adapter;  cap = min(max_bs, |R|)
    if |starving| <= cap/2 and |R_merge| > cap/2 and the switch pays for itself:
        no one starves -> MERGED with R_merge's adapter, batch R_merge[:max_bs]
        else           -> MIXED  with R_merge's adapter, batch starving + (R_merge - starving)[:room]
    else               -> UNMERGED, batch starving + (R - starving)[:room]

Under light load — every pending request fits one batch — the algorithm
would merge nothing: it takes shares of ``max_bs``, so nothing merges until
more than half a full batch waits on one adapter. On an H100 (2026-11-21,
``benchmarks/results/policies-10s-nvidia-h100``) the policy then never left
unmerged mode, although merged iterations were the fastest (8 ms against
14–15 ms per token at skewness 0.7–0.9). But a light load also
has nobody to displace, so no request should wait for a merge. The light-load
rule (:func:`_light_load`):

* the adapter merged now keeps at least ``keep_share`` of the requests: it
  stays (no switch: leaving and re-merging whenever a request of another
  adapter comes and goes cost two switches each time), unless that means
  MIXED iterations and those are measured slower than unmerged ones
  (:func:`stay_pays`; on an H200, 2026-11-22, they were, by 1.3–2 ms at
  every batch size: medians of that run's iteration timeline);
* else the most requested adapter has more than ``merge_share`` of them: it
  is merged, if the switch pays for itself (the iterations its requests may
  still run times the measured per-iteration saving of the mode it would
  run in over unmerged must exceed a merge plus the later unmerge);
* the mode is MERGED when all requests are that adapter's, else MIXED (the
  others add their adapter and subtract the merged one: on prefill rows that
  saves the merged adapter's LoRA work; on decode rows it reads the same
  bytes as unmerged, so the measured costs decide);
* otherwise -> UNMERGED.

Heavy load is Alg. 1 as written, with the same pay-for-itself test on a
switch.

Costs are not constants: the engine measures iteration times per mode and the
switch time on the running hardware and feeds them in as :class:`Costs`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from vlora.engine.modes import Mode, ModeSwitcher
from vlora.engine.sequence import Sequence


@dataclass(frozen=True)
class Pending:
    """A request as the policy sees it."""

    request_id: str
    adapter: str | None          # None = base model (never merged)
    waiting_s: float             # time since it last made progress
    remaining: int | None = None  # output tokens it may still produce (None: unknown, counted as many)


@dataclass(frozen=True)
class Costs:
    """Measured costs, seconds: one iteration in each mode, and one mode switch."""

    step_s: dict[Mode, float]
    switch_s: float


@dataclass(frozen=True)
class Decision:
    mode: Mode
    merged: str | None           # adapter to have merged (MERGED / MIXED); None for UNMERGED
    batch: tuple[str, ...]       # request ids, starving ones first


def credit(req: Pending, mode: Mode, merged_now: str | None, costs: Costs) -> float:
    """Alg. 1 line 2: waiting time + an iteration in the current mode + the switch its service needs
    (in MERGED mode only the merged adapter's requests run without one)."""
    needs_switch = mode is Mode.MERGED and req.adapter != merged_now
    return req.waiting_s + costs.step_s[mode] + (costs.switch_s if needs_switch else 0.0)


def switch_pays(r_merge: list[Pending], costs: Costs, mode: Mode = Mode.MERGED) -> bool:
    """Whether merging ``r_merge``'s adapter to run in ``mode`` (MERGED, or MIXED beside other requests) saves
    more than it costs: the iterations its requests may still run × (unmerged − ``mode`` iteration time, as
    measured) against two measured switches (this merge and the unmerge after it; unmerging an adapter merged
    now is paid whether or not this one comes in). Unmeasured costs (a cold start) count as worth it, so they
    get measured."""
    mode_s, unmerged_s = costs.step_s.get(mode, 0.0), costs.step_s.get(Mode.UNMERGED, 0.0)
    if min(costs.switch_s, mode_s, unmerged_s) <= 0.0:
        return True
    gain = unmerged_s - mode_s
    if any(r.remaining is None for r in r_merge):
        return gain > 0.0
    return max(r.remaining for r in r_merge) * gain > 2 * costs.switch_s


def stay_pays(costs: Costs) -> bool:
    """Whether the adapter merged now may stay merged while other requests (other adapters', the base model's)
    run beside it, i.e. in MIXED mode: only while a mixed iteration costs no more than an unmerged one, as
    measured. A mixed iteration runs a second LoRA pass over the other rows (their adapter, minus the merged
    one), and it can cost more: on an H200 (2026-11-22,
    ``benchmarks/results/h200-2026-11-22-run1/policies-skew-high``) a mixed decode iteration took 1.3–2 ms
    more than an unmerged one of the same batch size (medians of the gaps in its iteration timeline: 8.0
    against 6.7 ms at 2–4 requests). Leaving costs an unmerge now; merging back
    later must pay for itself (:func:`switch_pays`). The extra is not weighed against the switches saved over
    the others' remaining tokens: more of them may arrive while it stays, and the decode-only costs leave out
    prefill rows, which in that run cost more in mixed iterations still. Unmeasured costs get measured: mixed
    unmeasured -> stay (it runs), unmerged unmeasured -> leave (it runs)."""
    mixed_s, unmerged_s = costs.step_s.get(Mode.MIXED, 0.0), costs.step_s.get(Mode.UNMERGED, 0.0)
    if mixed_s <= 0.0:
        return True
    return 0.0 < unmerged_s and mixed_s <= unmerged_s


def _light_load(reqs: list[Pending], counts: Counter, merged_now: str | None, costs: Costs, merge_share: float,
                keep_share: float, mixed: bool) -> Decision:
    """Every pending request fits one batch: all of them run, in the mode that serves them fastest."""
    ids = tuple(r.request_id for r in reqs)
    if not counts:
        return Decision(Mode.UNMERGED, None, ids)
    top = max(counts, key=lambda a: (counts[a], a == merged_now))
    keep = merged_now is not None and counts.get(merged_now, 0) >= keep_share * len(reqs)
    chosen = merged_now if keep else top if counts[top] > merge_share * len(reqs) else None
    if chosen is not None:
        pure = counts[chosen] == len(reqs)                  # no other adapter's and no base-model request
        mode = Mode.MERGED if pure else Mode.MIXED
        if chosen == merged_now:                            # staying: free when pure, else it must pay
            go = pure or (mixed and stay_pays(costs))
        else:
            go = (pure or mixed) and switch_pays([r for r in reqs if r.adapter == chosen], costs, mode)
        if go:
            return Decision(mode, chosen, ids)
    return Decision(Mode.UNMERGED, None, ids)


def schedule(reqs: list[Pending], mode: Mode, merged_now: str | None, max_bs: int, theta: float, costs: Costs,
             merge_share: float = 0.5, keep_share: float = 0.25, mixed: bool = True,
             starved: set[str] | frozenset[str] = frozenset()) -> Decision:
    """Alg. 1 over the pending requests (in arrival order), from the current ``mode``; the light-load rule when
    they all fit one batch. ``mixed=False``: no mixed mode (the dLoRA-style baseline: starving -> unmerged).
    ``starved``: requests whose credit passed θ before; they stay starving (served first) until they finish.
    Otherwise one mixed iteration would reset a starving request's wait, and it would make one step per θ."""
    counts = Counter(r.adapter for r in reqs if r.adapter is not None)
    if len(reqs) <= max_bs:
        return _light_load(reqs, counts, merged_now, costs, merge_share, keep_share, mixed)
    top = max(counts, key=lambda a: (counts[a], a == merged_now)) if counts else None
    if merged_now is not None and counts.get(merged_now, 0) > merge_share * max_bs:
        top = merged_now                # it keeps the merge while it holds more than its share (no flapping on
    r_merge = [r for r in reqs if top is not None and r.adapter == top]          # a lead of one request)
    starving = [r for r in reqs if r.request_id in starved or credit(r, mode, merged_now, costs) > theta]
    starving_ids = {r.request_id for r in starving}
    others = [r for r in starving if r.adapter != top]      # only they need the mixed mode; the merged
    room = max(0, max_bs - len(starving))                   # adapter's own starving requests run merged
    if top is not None and len(others) <= merge_share * max_bs and len(r_merge) > merge_share * max_bs:
        target = Mode.MIXED if others else Mode.MERGED
        if (target is Mode.MERGED or mixed) and (top == merged_now or switch_pays(r_merge, costs, target)):
            rest = [r for r in r_merge if r.request_id not in starving_ids]
            if target is Mode.MERGED:
                return Decision(Mode.MERGED, top, tuple(r.request_id for r in starving + rest)[:max_bs])
            return Decision(Mode.MIXED, top, tuple(r.request_id for r in starving + rest[:room])[:max_bs])
    rest = [r for r in reqs if r.request_id not in starving_ids][:room]
    return Decision(Mode.UNMERGED, None, tuple(r.request_id for r in (starving + rest)[:max_bs]))


class Orchestrator:
    """Runs a mode policy each iteration with costs measured on this machine (running means)."""

    def __init__(self, policy: str, theta: float, max_bs: int):
        self.policy = policy
        self.theta = theta
        self.max_bs = max_bs
        self.step_s = {m: 0.0 for m in Mode}
        self.mode = Mode.UNMERGED
        self.mode_iterations = Counter()     # iterations run per mode (as measured)
        self.starved: set[str] = set()       # requests whose credit passed θ (until they finish)
        self.decisions = Counter()           # decisions taken per mode

    def plan(self, seqs: list[Sequence], modes: ModeSwitcher, registry) -> Decision | None:
        """The decision for the next iteration (None: plain continuous batching, nothing merged)."""
        if self.policy == "unmerged" or not seqs:
            return None
        now = time.monotonic()
        reqs = [Pending(s.request_id, s.adapter_name, now - s.last_progress,
                        s.params.max_tokens - len(s.output_token_ids)) for s in seqs]
        merged_now = None if modes.merged is None else modes.merged.name
        costs = Costs(dict(self.step_s), modes.last_switch_s)
        self.starved = {r.request_id for r in reqs
                        if r.request_id in self.starved or credit(r, self.mode, merged_now, costs) > self.theta}
        if self.policy in ("vlora", "dlora"):   # dlora: Alg. 1 without the mixed mode (starvation -> unmerged)
            return schedule(reqs, self.mode, merged_now, self.max_bs, self.theta, costs,
                            mixed=self.policy == "vlora", starved=self.starved)
        counts = Counter(r.adapter for r in reqs if r.adapter is not None)   # merged-only
        if not counts:
            return Decision(Mode.UNMERGED, None, tuple(r.request_id for r in reqs[:self.max_bs]))
        top = max(counts, key=lambda a: (counts[a], a == merged_now))
        return Decision(Mode.MERGED, top, tuple(r.request_id for r in reqs if r.adapter == top)[:self.max_bs])

    def apply(self, decision: Decision | None, modes: ModeSwitcher, registry) -> None:
        """Make the weights match the decision (exact swift merge/unmerge)."""
        if decision is None:
            return
        if decision.merged is None:
            modes.unmerge()
        else:
            modes.merge(registry.get(decision.merged))
        self.mode = decision.mode
        self.decisions[decision.mode] += 1

    def observe(self, mode: Mode, seconds: float, decode_only: bool = True) -> None:
        """Fold one measured iteration time into the running estimate of that mode's cost. Only decode-only
        iterations count: one prefill chunk costs as much as many decode steps, and the policy compares modes
        per decode step (a merged mean that caught prefills would read as slower than unmerged and stop merging
        for good)."""
        self.mode_iterations[mode] += 1
        if not decode_only:
            return
        prev = self.step_s[mode]
        self.step_s[mode] = seconds if prev == 0.0 else 0.8 * prev + 0.2 * seconds
