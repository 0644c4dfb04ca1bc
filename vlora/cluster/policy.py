"""What the cluster scheduler sees and decides: replica reports in, placements and migrations out.

The same policy objects drive the real cluster (`vlora.cluster.front`) and the simulator
(`vlora.cluster.sim`), so a policy measured in simulation is the policy served. A policy sees only
the periodic reports replicas publish (not a call per request), plus the requests it placed since the
last report, which it counts itself through `placed`.

The policies (one component, the policy a setting of :func:`make_policy`):

* ``consolidate`` (Punica §5.1): a new request goes to the busiest live replica still under its
  profiled batch cap with KV room for the request, that is room for its KV without falling short
  (below); ties: the highest replica id; when none has
  room the request stays queued at the front. It migrates (Punica §5.3) the newest requests of a
  replica short of KV, and drains a lightly used replica when its requests fit on busier ones,
  which frees that GPU entirely.
* ``affinity``: among live replicas with KV room, one where the request's adapter is resident (unless its load
  exceeds the least load by more than ``slack`` of its batch cap: a popular adapter's requests then spread),
  then the least loaded (ties: the lowest id); when none has KV room, the least loaded live replica (the
  replica queues it). The batch cap only scales the slack: affinity is a routing rule, not consolidation, so
  a replica past its cap still takes requests (its engine batches up to max_num_seqs) rather than the front
  holding them while the replicas' queues could run them. ``capped=True`` also keeps requests at the front
  while every replica is at its cap. Migrates off replicas short of KV.
* ``least_loaded``: the live replica with the fewest requests (ties: the lowest id), room or not
  (the replica queues it); migrates off replicas short of KV.
* ``round_robin``: each request to the next live replica in turn; never migrates.

A replica is *short of KV* when its free pages (less those taken by requests placed since its report)
are fewer than its running requests: the next decode step may need a new page for each of them. Free
pages are those KV can have: a replica reports the pool's free pages plus what it could reclaim (idle
adapters, cached prefixes).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Protocol, Sequence


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's state as of its last periodic report."""
    replica_id: int
    running: int                 # sequences in the running batch
    waiting: int                 # admitted but not yet running
    free_kv_pages: int
    total_kv_pages: int
    page_tokens: int             # tokens per KV page
    resident_adapters: frozenset[str] = frozenset()
    batch_cap: int = 64          # profiled batch size beyond which throughput stops growing
    alive: bool = True
    seq: int = 0                 # report number, increasing per replica (0: unnumbered, see `Placements`)

    @property
    def load(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class RequestInfo:
    """What placement needs to know about a request."""
    request_id: str
    adapter: str | None
    prompt_tokens: int
    max_tokens: int
    generated_tokens: int = 0    # tokens already sent (a migrated or failed-over request)

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the replica must hold to resume this request."""
        return self.prompt_tokens + self.generated_tokens


@dataclass(frozen=True)
class Migration:
    """Move `request_id` off `source` (it resumes elsewhere by recompute)."""
    request_id: str
    source: int


class Policy(Protocol):
    name: str

    def place(self, request: RequestInfo, replicas: Sequence[ReplicaReport]) -> int | None:
        """The replica id to run `request` on, or None to keep it queued at the front."""

    def placed(self, request: RequestInfo, replica_id: int) -> None:
        """Told after each placement, so the policy can count load between reports."""

    def rebalance(self, replicas: Sequence[ReplicaReport],
                  running: Mapping[int, Sequence[RequestInfo]]) -> list[Migration]:
        """Migrations to make now (e.g. consolidation freeing a whole replica); may be empty.
        ``running[replica_id]``: the requests on that replica, oldest first (a policy reads it only for the
        replicas it considers moving requests off)."""


def pages_for(request: RequestInfo, page_tokens: int) -> int:
    """KV pages a replica needs to take `request` (its prompt, tokens already sent, and the next token)."""
    return -(-(request.kv_tokens + 1) // page_tokens)


@dataclass
class Placements:
    """Requests placed on each replica since its last report, so that reports a period old are not read as
    if nothing had happened since. A replica's count starts again when a newer report of it comes: a higher
    ``seq``, or for unnumbered reports (seq 0) a different report object."""
    # replica id -> (the report last seen, KV tokens of each request placed since, their adapters)
    _since: dict[int, tuple[ReplicaReport | None, list[int], frozenset]] = field(default_factory=dict)

    def add(self, request: RequestInfo, replica_id: int) -> None:
        report, kv, adapters = self._since.get(replica_id, (None, [], frozenset()))
        if request.adapter is not None and request.adapter not in adapters:
            adapters = adapters | {request.adapter}
        self._since[replica_id] = (report, kv + [request.kv_tokens], adapters)

    def view(self, replicas: Sequence[ReplicaReport]) -> list[ReplicaReport]:
        """The reports with the requests placed since each one added: in ``waiting``, out of ``free_kv_pages``
        and (their adapters) into ``resident_adapters``."""
        out = []
        since = self._since
        for r in replicas:
            seen, kv, adapters = since.get(r.replica_id, (None, [], frozenset()))
            if seen is not r:
                if seen is not None and _newer(r, seen):
                    kv, adapters = [], frozenset()
                since[r.replica_id] = (r, kv, adapters)
            if kv:
                pages = sum(-(-(k + 1) // r.page_tokens) for k in kv)
                r = replace(r, waiting=r.waiting + len(kv), free_kv_pages=r.free_kv_pages - pages,
                            resident_adapters=r.resident_adapters | adapters)
            out.append(r)
        return out


def _newer(report: ReplicaReport, seen: ReplicaReport) -> bool:
    if report.seq or seen.seq:
        return report.seq > seen.seq
    return report is not seen


def _has_room(r: ReplicaReport, request: RequestInfo) -> bool:
    """Under the batch cap, with KV for the request that leaves the replica not short (so that the placement is
    not migrated straight back out)."""
    return r.load < r.batch_cap and _has_kv_room(r, request)


def _has_kv_room(r: ReplicaReport, request: RequestInfo) -> bool:
    """Live, with KV for the request that leaves the replica not short."""
    return r.alive and _kv_after(r, request) > r.load


def _kv_after(r: ReplicaReport, request: RequestInfo) -> int:
    return r.free_kv_pages - pages_for(request, r.page_tokens)


def _take(r: ReplicaReport, request: RequestInfo) -> ReplicaReport:
    """`r` after it takes `request` (for planning several moves on one snapshot)."""
    adapters = r.resident_adapters | ({request.adapter} if request.adapter is not None else set())
    return replace(r, waiting=r.waiting + 1, free_kv_pages=r.free_kv_pages - pages_for(request, r.page_tokens),
                   resident_adapters=adapters)


def _give(r: ReplicaReport, request: RequestInfo) -> ReplicaReport:
    """`r` after `request` leaves it."""
    if r.running:
        r = replace(r, running=r.running - 1)
    elif r.waiting:
        r = replace(r, waiting=r.waiting - 1)
    return replace(r, free_kv_pages=r.free_kv_pages + -(-request.kv_tokens // r.page_tokens))


@dataclass
class _Stateful:
    """Placement on reports plus own placements, and Punica's migration off replicas short of KV."""
    migrate: bool = True
    _placements: Placements = field(default_factory=Placements, repr=False)

    def choose(self, request: RequestInfo, replicas: Sequence[ReplicaReport]) -> int | None:
        raise NotImplementedError

    def place(self, request: RequestInfo, replicas: Sequence[ReplicaReport]) -> int | None:
        return self.choose(request, self._placements.view(replicas))

    def placed(self, request: RequestInfo, replica_id: int) -> None:
        self._placements.add(request, replica_id)

    def rebalance(self, replicas: Sequence[ReplicaReport],
                  running: dict[int, Sequence[RequestInfo]]) -> list[Migration]:
        if not self.migrate:
            return []
        view = {r.replica_id: r for r in self._placements.view(replicas)}
        return self._relieve(view, running) + self._extra(view, running)

    def _extra(self, view: dict[int, ReplicaReport], running) -> list[Migration]:
        return []

    def _relieve(self, view: dict[int, ReplicaReport], running) -> list[Migration]:
        """Punica §5.3: a replica short of KV gives up its newest requests while another replica would take
        each without falling short itself (else the replica's own preemption handles it, with no move)."""
        out = []
        for rid in sorted(view):
            src = view[rid]
            if not (src.alive and src.free_kv_pages < src.running):
                continue
            reqs = list(running.get(rid, ()))
            while reqs and src.free_kv_pages < src.running:
                victim = reqs.pop()
                others = [r for r in view.values() if r.replica_id != rid and _kv_after(r, victim) > r.load]
                target = self.choose(victim, others)
                if target is None:
                    break
                out.append(Migration(victim.request_id, rid))
                view[target] = _take(view[target], victim)
                view[rid] = src = _give(src, victim)
        return out


@dataclass
class Consolidate(_Stateful):
    """Punica's consolidation: the busiest replica with room; drain lightly used replicas onto busier ones."""
    name: str = "consolidate"
    drain_below: float = 0.25    # a replica whose load is under this share of its batch cap is lightly used

    def choose(self, request: RequestInfo, replicas: Sequence[ReplicaReport]) -> int | None:
        fits = [r for r in replicas if _has_room(r, request)]
        if not fits:
            return None
        return max(fits, key=lambda r: (r.load, r.replica_id)).replica_id

    def _extra(self, view: dict[int, ReplicaReport], running) -> list[Migration]:
        """Move every request off a lightly used replica when they all fit on busier ones (by (load, id)), the
        lightest first; a replica receiving requests is not drained in the same call."""
        out = []
        receivers: set[int] = set()
        for src in sorted(view.values(), key=lambda r: (r.load, r.replica_id)):
            if (not src.alive or src.replica_id in receivers or not src.load
                    or src.load >= self.drain_below * src.batch_cap):
                continue
            reqs = list(running.get(src.replica_id, ()))
            if len(reqs) != src.load:       # requests placed since the report are not seen there yet
                continue
            trial = dict(view)
            moves = []
            for q in reqs:
                busier = [r for r in trial.values() if (r.load, r.replica_id) > (src.load, src.replica_id)
                          and r.replica_id != src.replica_id]
                target = self.choose(q, busier)
                if target is None:
                    break
                moves.append((q, target))
                trial[target] = _take(trial[target], q)
            else:
                for q, target in moves:
                    out.append(Migration(q.request_id, src.replica_id))
                    receivers.add(target)
                view.update(trial)
                view[src.replica_id] = replace(src, running=0, waiting=0,
                                               free_kv_pages=src.total_kv_pages)
        return out


@dataclass
class Affinity(_Stateful):
    """Prefer a replica where the request's adapter is resident, then the least loaded."""
    name: str = "affinity"
    slack: float = 0.25          # a resident replica is preferred while its load is at most the least load
    #                              plus this share of its batch cap (beyond, the adapter's load spreads out)
    capped: bool = False         # hold requests at the front while every replica is at its batch cap

    def choose(self, request: RequestInfo, replicas: Sequence[ReplicaReport]) -> int | None:
        fits = [r for r in replicas if (_has_room if self.capped else _has_kv_room)(r, request)]
        if not fits:
            if self.capped:
                return None
            live = [r for r in replicas if r.alive]
            return min(live, key=lambda r: (r.load, r.replica_id)).replica_id if live else None
        least = min(r.load for r in fits)
        return min(fits, key=lambda r: (not (request.adapter in r.resident_adapters
                                              and r.load <= least + self.slack * r.batch_cap),
                                        r.load, r.replica_id)).replica_id


@dataclass
class LeastLoaded(_Stateful):
    """The live replica with the fewest requests, room or not."""
    name: str = "least_loaded"

    def choose(self, request: RequestInfo, replicas: Sequence[ReplicaReport]) -> int | None:
        live = [r for r in replicas if r.alive]
        if not live:
            return None
        return min(live, key=lambda r: (r.load, r.replica_id)).replica_id


@dataclass
class RoundRobin:
    """Each request to the next live replica in turn: the baseline that ignores state."""
    name: str = "round_robin"
    _next: int = field(default=0, repr=False)

    def place(self, request: RequestInfo, replicas: Sequence[ReplicaReport]) -> int | None:
        live = sorted((r for r in replicas if r.alive), key=lambda r: r.replica_id)
        if not live:
            return None
        choice = live[self._next % len(live)].replica_id
        self._next += 1
        return choice

    def placed(self, request: RequestInfo, replica_id: int) -> None:
        pass

    def rebalance(self, replicas, running) -> list[Migration]:
        return []


# the baseline first: a comparison that runs "every policy" starts from it
POLICIES: dict[str, type] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "affinity": Affinity,
                             "consolidate": Consolidate}


def make_policy(name: str, **kwargs) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cluster policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(**kwargs)
