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
more than half a full batch waits on one adapter, and the policy stays
unmerged even when one adapter has most of the requests and merged iterations
are the fastest (docs/decisions.md, 'Light-load rule'). But a light load also
has nobody to displace, so no request should wait for a merge. The light-load
rule (:func:`_light_load`):

* the adapter merged now keeps at least ``keep_share`` of the requests: it
  stays (no switch: leaving and re-merging whenever a request of another
  adapter comes and goes cost two switches each time), unless that means
  MIXED iterations slower than unmerged ones, for longer than leaving and
  merging back would cost (:func:`stay_pays`: in decode a mixed iteration
  reads the adapter bytes of an unmerged one plus the merged adapter's, in
  the same launches, so it may cost more);
* else the most requested adapter has more than ``merge_share`` of them: it
  is merged, if the switch pays for itself (the iterations its requests may
  still run times the measured per-iteration saving of the mode it would
  run in over unmerged must exceed a merge plus the later unmerge);
* the mode is MERGED when all requests are that adapter's, else MIXED (the
  others add their adapter and subtract the merged one: on prefill rows that
  saves the merged adapter's LoRA work; on decode rows it reads as many
  bytes as unmerged or a little more, so the measured costs decide);
* otherwise -> UNMERGED.

Heavy load is Alg. 1 as written, with the same pay-for-itself test on a
switch.

Costs are not constants. When the engine has profiled its modes
(:meth:`Engine.profile_modes`, :mod:`vlora.engine.mode_costs`), the policy reads
the replay time of a decode iteration for the batch at hand in each mode, and
the switch that applies: a first merge, an unmerge, or a merge that reuses the
restore record of the adapter unmerged last, which writes only the weights and
costs a fraction of a first merge (docs/decisions.md, 'Reused merges priced
apart'). Without a profile it uses running means of the iterations and switches
as they happen. Running means can leave a mode unmeasured: a few slow mixed
iterations keep the policy out of mixed mode for good. They also mix first and
reused merges.

Merged copies (``cache.merged_copy``, :mod:`vlora.lora.merge_copy`). When the
pool keeps a merged copy of an adapter, switching to and from it is a pointer
change, priced at its measured cost (about nothing); staying merged beside
other adapters' requests then rarely pays, since leaving and coming back cost
nothing. A merge asks for a copy when the pool's free pages, less the copy,
would still cover the KV the pending requests may need to finish plus
``COPY_HEADROOM`` of the pool; making one costs about a first merge and a
copy of the touched weights, after which its unmerge is free. The pool drops
the copy when KV needs its pages.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace

from vlora.engine.mode_costs import ModeCosts
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
    """Measured costs, seconds: one iteration of the batch at hand in each mode, and the switches. ``switch_s``
    is a first merge of an adapter (weights and restore record written); ``unmerge_s`` and ``reuse_s`` (a merge
    of ``kept``, the adapter unmerged last, whose record is reused) default to it."""

    step_s: dict[Mode, float]
    switch_s: float
    unmerge_s: float | None = None
    reuse_s: float | None = None
    kept: str | None = None
    copied: str | None = None        # the adapter whose merged copy is resident: its switches are pointer changes
    copy_s: float = 0.0              # a switch to or from a resident copy
    make_s: float | None = None      # making a copy (default: a first merge)
    can_copy: bool = False           # the pool has room for a copy: a merge now makes one

    def merge_cost(self, adapter: str | None) -> float:
        """Seconds to merge ``adapter``: a pointer change to its resident copy, making a copy when there is room,
        else in place, its record reused when it is the adapter unmerged last."""
        if adapter is not None and adapter == self.copied:
            return self.copy_s
        if self.can_copy:
            return self.switch_s if self.make_s is None else self.make_s
        return self.reuse_cost if adapter is not None and adapter == self.kept else self.switch_s

    def unmerge_cost_of(self, adapter: str | None) -> float:
        """Seconds to unmerge ``adapter``, merged now: a pointer change from its copy, else in place."""
        return self.copy_s if adapter is not None and adapter == self.copied else self.unmerge_cost

    def round_trip(self, adapter: str | None) -> float:
        """Seconds to merge ``adapter`` now (:meth:`merge_cost`) and to unmerge it later: from a copy (resident,
        or made by this merge) a pointer change."""
        on_copy = adapter is not None and (adapter == self.copied or self.can_copy)
        return self.merge_cost(adapter) + (self.copy_s if on_copy else self.unmerge_cost)

    def back_cost(self, adapter: str | None) -> float:
        """Seconds to merge ``adapter`` again after unmerging it now: its copy, or its record reused."""
        return self.copy_s if adapter is not None and adapter == self.copied else self.reuse_cost

    @property
    def reuse_cost(self) -> float:
        return self.switch_s if self.reuse_s is None else self.reuse_s

    @property
    def unmerge_cost(self) -> float:
        return self.switch_s if self.unmerge_s is None else self.unmerge_s


@dataclass(frozen=True)
class Decision:
    mode: Mode
    merged: str | None           # adapter to have merged (MERGED / MIXED); None for UNMERGED
    batch: tuple[str, ...]       # request ids, starving ones first
    copy_keep_free: int | None = None    # merge into a copy if it leaves this many pool pages free (None: in place)


def credit(req: Pending, mode: Mode, merged_now: str | None, costs: Costs) -> float:
    """Alg. 1 line 2: waiting time + an iteration in the current mode + the switch its service needs
    (in MERGED mode only the merged adapter's requests run without one)."""
    needs_switch = mode is Mode.MERGED and req.adapter != merged_now
    switch = costs.copy_s if merged_now is not None and merged_now == costs.copied else costs.switch_s
    return req.waiting_s + costs.step_s[mode] + (switch if needs_switch else 0.0)


def switch_pays(r_merge: list[Pending], costs: Costs, mode: Mode = Mode.MERGED) -> bool:
    """Whether merging ``r_merge``'s adapter to run in ``mode`` (MERGED, or MIXED beside other requests) saves
    more than it costs: the iterations its requests may still run × (unmerged − ``mode`` iteration time, as
    measured) against this merge and the unmerge after it (unmerging an adapter merged now is paid whether or
    not this one comes in). Unmeasured costs (a cold start) count as worth it, so they get measured."""
    mode_s, unmerged_s = costs.step_s.get(mode, 0.0), costs.step_s.get(Mode.UNMERGED, 0.0)
    if min(costs.switch_s, mode_s, unmerged_s) <= 0.0:
        return True
    gain = unmerged_s - mode_s
    if any(r.remaining is None for r in r_merge):
        return gain > 0.0
    adapter = r_merge[0].adapter if r_merge else None
    return max(r.remaining for r in r_merge) * gain > costs.round_trip(adapter)


def stay_pays(costs: Costs, merged: list[Pending] = (), others: list[Pending] = (), name: str | None = None) -> bool:
    """Whether the adapter merged now may stay merged while ``others`` (other adapters' and the base model's
    requests) run beside its requests ``merged``, i.e. in MIXED mode. A mixed iteration gives the other rows
    their adapter and the merged one subtracted (one launch: docs/decisions.md, 'Mixed mode in one launch') and
    may cost more than an unmerged one (docs/decisions.md, 'Mixed mode counted as a cost'). Staying pays that
    extra for as long as the others run
    (the most tokens one of them may still produce); leaving pays an unmerge now and, if the merged adapter's
    requests outlive the others, the merge back (its record reused). Stay when the first is no more than the
    second; a mixed iteration no slower than an unmerged one always stays. Unknown lengths weigh nothing but the
    iteration times. Unmeasured costs get measured: mixed unmeasured -> stay (it runs), unmerged unmeasured ->
    leave (it runs). ``name``: the merged adapter (a resident copy makes leaving and coming back pointer
    changes)."""
    mixed_s, unmerged_s = costs.step_s.get(Mode.MIXED, 0.0), costs.step_s.get(Mode.UNMERGED, 0.0)
    if mixed_s <= 0.0:
        return True
    if unmerged_s <= 0.0:
        return False
    extra = mixed_s - unmerged_s
    if extra <= 0.0:
        return True
    lengths = [r.remaining for r in others]
    if not others or any(n is None for n in lengths):
        return False
    left = max(lengths)
    mine = [r.remaining for r in merged]
    back = bool(mine) and any(n is None or n > left for n in mine)     # its requests outlive the others
    leave = costs.unmerge_cost_of(name) + (costs.back_cost(name) if back else 0.0)   # its record or copy reused
    return extra * left <= leave


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
            go = pure or (mixed and stay_pays(costs, [r for r in reqs if r.adapter == chosen],
                                              [r for r in reqs if r.adapter != chosen], chosen))
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


COPY_HEADROOM = 1 / 8      # share of the pool a merged copy leaves free beyond the pending requests' KV


def copy_keep_free(seqs: list[Sequence], pool) -> int:
    """Pool pages a merged copy must leave free: the KV pages ``seqs`` may still take to finish (each up to its
    prompt plus max_tokens), plus ``COPY_HEADROOM`` of the pool, so that arrivals and growth take free pages
    rather than drop the copy at once."""
    bs, cap = pool.page_shape[2], pool.num_pages
    demand = sum(min(cap, max(0, -(-(len(s.prompt_token_ids) + s.params.max_tokens) // bs) - len(s.blocks)))
                 for s in seqs)
    return demand + int(COPY_HEADROOM * pool.num_pages)


class Orchestrator:
    """Runs a mode policy each iteration. Its costs: ``profile``, measured at start-up on this GPU
    (:mod:`vlora.engine.mode_costs`: iteration times per mode and batch size, each kind of switch), when there is
    one; else running means of the iterations and switches as they happen."""

    def __init__(self, policy: str, theta: float, max_bs: int, profile: ModeCosts | None = None):
        self.policy = policy
        self.theta = theta
        self.max_bs = max_bs
        self.profile = profile
        self.step_s = {m: 0.0 for m in Mode}
        self.mode = Mode.UNMERGED
        self.mode_iterations = Counter()     # iterations run per mode (as measured)
        self.starved: set[str] = set()       # requests whose credit passed θ (until they finish)
        self.decisions = Counter()           # decisions taken per mode

    def costs(self, n: int, modes: ModeSwitcher, keep_free: int | None = None) -> Costs:
        """The costs of an iteration of ``n`` requests in each mode and of the switches, as known now.
        ``keep_free``: pool pages a merged copy must leave free (None: no copy is made)."""
        kept = None if modes.kept is None else modes.kept.adapter.name
        copies = getattr(modes, "copies", None)
        copy = {}
        if copies is not None:
            copy = dict(copied=None if copies.copy is None else copies.copy.adapter.name,
                        can_copy=keep_free is not None and copies.fits(modes.weights, keep_free))
        p = self.profile
        if p is None:
            switch_s = getattr(modes, "last_device_switch_s", modes.last_switch_s)   # pointer changes apart
            return Costs(dict(self.step_s), switch_s, kept=kept,
                         copy_s=getattr(modes, "last_copy_switch_s", 0.0), **copy)
        return Costs({m: p.step(m, n) for m in Mode}, p.merge_s, p.unmerge_s, p.reuse_s, kept, copy_s=p.copy_s,
                     make_s=p.make_s or None, **copy)

    def plan(self, seqs: list[Sequence], modes: ModeSwitcher, registry) -> Decision | None:
        """The decision for the next iteration (None: plain continuous batching, nothing merged)."""
        if self.policy == "unmerged" or not seqs:
            return None
        now = time.monotonic()
        reqs = [Pending(s.request_id, s.adapter_name, now - s.last_progress,
                        s.params.max_tokens - len(s.output_token_ids)) for s in seqs]
        merged_now = None if modes.merged is None else modes.merged.name
        copies = getattr(modes, "copies", None)
        keep_free = None if copies is None else copy_keep_free(seqs, copies.pool)
        costs = self.costs(min(len(reqs), self.max_bs), modes, keep_free)
        self.starved = {r.request_id for r in reqs
                        if r.request_id in self.starved or credit(r, self.mode, merged_now, costs) > self.theta}
        decision = self._decide(reqs, merged_now, costs)
        if keep_free is not None and decision.merged is not None:
            decision = replace(decision, copy_keep_free=keep_free)
        return decision

    def _decide(self, reqs: list[Pending], merged_now: str | None, costs: Costs) -> Decision:
        if self.policy in ("vlora", "dlora"):   # dlora: Alg. 1 without the mixed mode (starvation -> unmerged)
            return schedule(reqs, self.mode, merged_now, self.max_bs, self.theta, costs,
                            mixed=self.policy == "vlora", starved=self.starved)
        counts = Counter(r.adapter for r in reqs if r.adapter is not None)   # merged-only
        if not counts:
            return Decision(Mode.UNMERGED, None, tuple(r.request_id for r in reqs[:self.max_bs]))
        top = max(counts, key=lambda a: (counts[a], a == merged_now))
        return Decision(Mode.MERGED, top, tuple(r.request_id for r in reqs if r.adapter == top)[:self.max_bs])

    def apply(self, decision: Decision | None, modes: ModeSwitcher, registry) -> None:
        """Make the weights match the decision (exact swift merge/unmerge, or a pointer change to and from a
        merged copy)."""
        if decision is None:
            return
        if decision.merged is None:
            modes.unmerge()
        elif decision.copy_keep_free is None:
            modes.merge(registry.get(decision.merged))
        else:
            modes.merge(registry.get(decision.merged), copy_keep_free=decision.copy_keep_free)
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
