"""Cost tables: what one replica's engine iterations cost on a GPU, measured by `benchmarks/cluster_costs.py`.

The simulator (:mod:`vlora.cluster.sim`) reads time from these tables instead of running a model, as Vidur
does with its profiled operators; here the unit profiled is the whole engine iteration, since that is what
the scheduler sees. An iteration's time is a function of its prefill tokens, its decode batch, the distinct
adapters in the batch (their ranks as the table's adapters had them) and the decodes' context:

    t = grid(prefill, decodes, adapters) + kv_s_per_token * max(0, context - decodes * grid_context)

with ``grid`` measured at each decode's context ``grid_context`` and interpolated linearly between grid
points (clamped at the grid's edges). Loading an adapter into the pool adds ``adapter_load_s`` for its rank
to the iteration that needs it; a migration adds ``migration_s`` (cancel and re-add through the front)
before the request reaches its new replica, whose recompute is an ordinary prefill.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ReplicaLimits:
    """The engine settings a replica runs with (the engine's sizing on the measured GPU)."""
    num_pages: int                     # pool pages (KV and resident adapters)
    page_tokens: int                   # tokens per page
    max_num_seqs: int
    max_num_batched_tokens: int        # chunked-prefill budget per iteration (prefill + decode tokens)
    adapter_pages: dict[int, int] = field(default_factory=dict)   # pool pages one adapter of each rank takes


@dataclass
class CostTable:
    limits: ReplicaLimits
    prefill: list[int]                 # grid axes
    decode: list[int]
    adapters: list[int]
    step_s: list[list[list[float]]]    # [prefill][decode][adapters] seconds of one iteration
    grid_context: int = 0              # each decode's context (tokens) while the grid was timed
    kv_s_per_token: float = 0.0        # extra seconds per decode context token beyond the grid's
    adapter_load_s: dict[int, float] = field(default_factory=dict)   # rank -> seconds to load into the pool
    migration_s: float = 0.0
    mode: str = "unmerged"
    meta: dict = field(default_factory=dict)   # device, model, dtype, adapter ranks, date: what was measured

    def __post_init__(self) -> None:
        shape = (len(self.prefill), len(self.decode), len(self.adapters))
        got = (len(self.step_s), len(self.step_s[0]) if self.step_s else 0,
               len(self.step_s[0][0]) if self.step_s and self.step_s[0] else 0)
        if shape != got:
            raise ValueError(f"step_s has shape {got}, the axes say {shape}")
        for axis in (self.prefill, self.decode, self.adapters):
            if axis != sorted(set(axis)):
                raise ValueError(f"a grid axis must be strictly increasing, got {axis}")

    def step(self, prefill: int, decodes: int, adapters: int, context: int = 0) -> float:
        """Seconds of one iteration with ``prefill`` prompt tokens, ``decodes`` decoding sequences holding
        ``context`` tokens of KV between them, and ``adapters`` distinct adapters in the batch."""
        t = _interp3(self.prefill, self.decode, self.adapters, self.step_s, prefill, decodes, adapters)
        return t + self.kv_s_per_token * max(0, context - decodes * self.grid_context)

    def load_s(self, rank: int) -> float:
        """Seconds to bring an adapter of ``rank`` into the pool (the nearest measured rank at or above it)."""
        if not self.adapter_load_s:
            return 0.0
        ranks = sorted(self.adapter_load_s)
        return self.adapter_load_s[next((r for r in ranks if r >= rank), ranks[-1])]

    def adapter_pages(self, rank: int) -> int:
        pages = self.limits.adapter_pages
        if not pages:
            return 0
        ranks = sorted(pages)
        return pages[next((r for r in ranks if r >= rank), ranks[-1])]

    # -- JSON ---------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d["limits"]["adapter_pages"] = {str(k): v for k, v in self.limits.adapter_pages.items()}
        d["adapter_load_s"] = {str(k): v for k, v in self.adapter_load_s.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> CostTable:
        d = dict(d)
        lim = dict(d.pop("limits"))
        lim["adapter_pages"] = {int(k): int(v) for k, v in lim.get("adapter_pages", {}).items()}
        d["adapter_load_s"] = {int(k): float(v) for k, v in d.get("adapter_load_s", {}).items()}
        return cls(limits=ReplicaLimits(**lim), **d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_json(json.loads(Path(path).read_text()))


def _bracket(axis: list[int], x: float) -> tuple[int, int, float]:
    """Indices (i, j) around ``x`` on ``axis`` and the weight of j; clamped at the edges."""
    if x <= axis[0] or len(axis) == 1:
        return 0, 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, len(axis) - 1, 0.0
    j = bisect.bisect_right(axis, x)
    i = j - 1
    return i, j, (x - axis[i]) / (axis[j] - axis[i])


def _interp3(ax, ay, az, v, x, y, z) -> float:
    i0, i1, wx = _bracket(ax, x)
    j0, j1, wy = _bracket(ay, y)
    k0, k1, wz = _bracket(az, z)
    out = 0.0
    for i, a in ((i0, 1 - wx), (i1, wx)):
        for j, b in ((j0, 1 - wy), (j1, wy)):
            for k, c in ((k0, 1 - wz), (k1, wz)):
                w = a * b * c
                if w:
                    out += w * v[i][j][k]
    return out


def linear_table(limits: ReplicaLimits, base_s: float, prefill_token_s: float, decode_s: float,
                 adapter_s: float, prefill=(0, 4096), decode=(0, 256), adapters=(0, 64), **kw) -> CostTable:
    """A table whose iteration time is ``base_s + prefill_token_s * P + decode_s * D + adapter_s * A``
    (exact under the linear interpolation): constructed costs for tests and for developing the simulator,
    never a measurement."""
    grid = [[[base_s + prefill_token_s * p + decode_s * d + adapter_s * a for a in adapters] for d in decode]
            for p in prefill]
    return CostTable(limits, list(prefill), list(decode), list(adapters), grid, **kw)
