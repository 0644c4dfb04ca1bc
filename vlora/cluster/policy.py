"""What the cluster scheduler sees and decides: replica reports in, placements and migrations out.

The same policy objects drive the real cluster (`vlora.cluster.front`) and the simulator
(`vlora.cluster.sim`), so a policy measured in simulation is the policy served. A policy sees only
the periodic reports replicas publish (not a call per request), plus the requests it placed since the
last report, which it counts itself through `placed`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


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
                  running: dict[int, Sequence[RequestInfo]]) -> list[Migration]:
        """Migrations to make now (e.g. consolidation freeing a whole replica); may be empty."""


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


POLICIES: dict[str, type] = {"round_robin": RoundRobin}


def make_policy(name: str, **kwargs) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cluster policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(**kwargs)
