"""How a cluster of engine replicas is laid out and watched (``vlora serve --replicas N``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlora.cluster.costs import CostTable, profiled_batch_cap
from vlora.cluster.policy import POLICIES
from vlora.config import ConfigError


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 1
    """Engine replicas, each a Ray actor with its own GPU(s); above 1 (or with --ray-address) the server is the
    front of a cluster (docs/cluster.md)."""
    cluster_policy: str = "round_robin"
    """How the cluster places requests on replicas (a vlora.cluster.policy name)."""
    ray_address: str | None = None
    """Ray cluster to join ("auto", "ray://host:10001"); default: start a local one on this machine."""
    ray_num_cpus: int | None = None
    """CPUs of the local Ray cluster (default: all of this machine's)."""
    gpus_per_replica: float | None = None
    """GPUs each replica holds (default: tensor_parallel_size when CUDA is visible here, else 0)."""
    cpus_per_replica: float = 1.0
    """CPUs each replica holds (the replica's torch threads follow it)."""
    batch_cap: int | None = None
    """Batch size a replica reports as full to the placement policy (Punica's consolidation fills a replica up to
    it); default: profiled from --cost-table when given, else the engine's max_num_seqs."""
    cost_table: str | None = None
    """Cost table of this model and GPU (benchmarks/cluster_costs.py) to profile the batch cap from: the decode
    batch beyond which a larger batch slows each token more than it raises throughput."""
    report_interval_s: float = 0.05
    """Seconds between two reports a replica gives the placement policy (load, free KV pages, adapters)."""
    max_restarts: int = 4
    """Times Ray restarts a replica that dies (-1: without limit); its requests rerun elsewhere meanwhile."""
    unreachable_s: float = 120.0
    """The cluster gives up (the server exits) when no replica has answered for this many seconds."""

    def __post_init__(self):
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.cluster_policy not in POLICIES:
            raise ConfigError(f"unknown cluster_policy {self.cluster_policy!r}; choose from {sorted(POLICIES)}")
        for name in ("report_interval_s", "cpus_per_replica", "unreachable_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.batch_cap is not None and self.batch_cap < 1:
            raise ConfigError(f"batch_cap must be >= 1, got {self.batch_cap}")
        if self.cost_table is not None and not Path(self.cost_table).is_file():
            raise ConfigError(f"cost_table {self.cost_table!r} is not a file")
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise ConfigError(f"gpus_per_replica must be >= 0, got {self.gpus_per_replica}")

    @property
    def enabled(self) -> bool:
        """Whether to serve through a cluster front rather than one engine in this process."""
        return self.replicas > 1 or self.ray_address is not None

    def profiled_batch_cap(self) -> int | None:
        """The batch cap replicas report: ``batch_cap``, else profiled from ``cost_table``, else None (the
        engine's max_num_seqs)."""
        if self.batch_cap is not None or self.cost_table is None:
            return self.batch_cap
        return profiled_batch_cap(CostTable.load(self.cost_table))
