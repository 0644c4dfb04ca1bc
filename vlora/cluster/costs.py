"""Cost tables: what one replica's engine iterations cost on a GPU, measured by `benchmarks/cluster_costs.py`.

The simulator (:mod:`vlora.cluster.sim`) reads time from these tables instead of running a model, as Vidur
does with its profiled operators; here the unit profiled is the whole engine iteration, since that is what
the scheduler sees. An iteration's time is a function of its prefill tokens, its decode batch, the distinct
adapters in the batch (their ranks as the table's adapters had them) and the decodes' context:

    t = grid(prefill, decodes, adapters) + kv_s_per_token * max(0, context - decodes * grid_context)

with ``grid`` measured at each decode's context ``grid_context`` and interpolated linearly between grid
points (clamped at the grid's edges), times ``step_scale`` (one factor for decode-only iterations, one for
those with a prefill; 1 on the GPU the table was measured on, see ``CostTable.scaled``). Loading an adapter
into the pool adds ``adapter_load_s`` for its rank to the iteration that needs it; a migration adds ``migration_s`` (cancel and re-add through the front)
before the request reaches its new replica, whose recompute is an ordinary prefill.

Serving reads one thing from a table: Punica's profiled batch cap (:func:`profiled_batch_cap`), the batch a
replica reports as full to the placement policy.

The grid times ``Engine.step`` alone. A served replica does more per iteration: the async engine's thread
hands each output to the actor's event loop, the actor streams them through Ray, and the front forwards them,
all in the same processes and under the same interpreter locks as the next step's host work. Those terms
are :class:`ServedCosts` (zero: the bare engine): a cost per iteration, a cost per sequence in it (its
output's way out), the delay from a request's arrival at the front until its replica's engine can schedule
it, and the delay from an iteration's end until the client holds its tokens.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class ReplicaLimits:
    """The engine settings a replica runs with (the engine's sizing on the measured GPU)."""
    num_pages: int                     # pool pages (KV and resident adapters)
    page_tokens: int                   # tokens per page
    max_num_seqs: int
    max_num_batched_tokens: int        # chunked-prefill budget per iteration (prefill + decode tokens)
    adapter_pages: dict[int, int] = field(default_factory=dict)   # pool pages one adapter of each rank takes
    max_prefill_tokens_with_decodes: int | None = None   # prompt tokens beside decodes (None: the whole budget)
    max_chunks_with_decodes: int | None = None           # prompt chunks beside decodes (None: no bound)


@dataclass(frozen=True)
class ServedCosts:
    """What serving through the cluster adds to the engine's own iterations (zeros: the bare engine)."""
    iteration_s: float = 0.0           # per iteration (the async engine's loop around Engine.step)
    seq_s: float = 0.0                 # per sequence in an iteration (its output: async engine, actor, Ray, front)
    submit_s: float = 0.0              # from arrival at the front until the replica's engine can schedule it
    stream_s: float = 0.0              # from an iteration's end until the client holds its tokens
    source: str = ""                   # how the values were obtained (measured by ..., fitted on ...)


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
    served: ServedCosts = field(default_factory=ServedCosts)
    step_scale: tuple[float, float] = (1.0, 1.0)   # (decode-only, with a prefill): see `scaled`

    def __post_init__(self) -> None:
        shape = (len(self.prefill), len(self.decode), len(self.adapters))
        got = (len(self.step_s), len(self.step_s[0]) if self.step_s else 0,
               len(self.step_s[0][0]) if self.step_s and self.step_s[0] else 0)
        if shape != got:
            raise ValueError(f"step_s has shape {got}, the axes say {shape}")
        for axis in (self.prefill, self.decode, self.adapters):
            if axis != sorted(set(axis)):
                raise ValueError(f"a grid axis must be strictly increasing, got {axis}")

    def step(self, prefill: int, decodes: int, adapters: int, context: int = 0, seqs: int | None = None) -> float:
        """Seconds of one served iteration with ``prefill`` prompt tokens, ``decodes`` decoding sequences
        holding ``context`` tokens of KV between them, ``adapters`` distinct adapters in the batch and ``seqs``
        sequences in all (default: the decodes; a prefill chunk is one more)."""
        t = _interp3(self.prefill, self.decode, self.adapters, self.step_s, prefill, decodes, adapters)
        px = self.prefill
        if 0 < prefill < px[1] and len(px) > 2 and px[0] == 0:
            # decode-only iterations replay CUDA graphs, any prefill runs eagerly: the first segment of the
            # prefill axis crosses that step, so a small prefill costs what the two smallest prefill points
            # extrapolate to (never below the decode-only cost)
            t1 = _interp3(px, self.decode, self.adapters, self.step_s, px[1], decodes, adapters)
            t2 = _interp3(px, self.decode, self.adapters, self.step_s, px[2], decodes, adapters)
            t0 = _interp3(px, self.decode, self.adapters, self.step_s, 0, decodes, adapters)
            t = max(t0, t1 - max(0.0, (t2 - t1) / (px[2] - px[1])) * (px[1] - prefill))
        t += self.kv_s_per_token * max(0, context - decodes * self.grid_context)
        t *= self.step_scale[1] if prefill else self.step_scale[0]
        sv = self.served
        if sv.iteration_s or sv.seq_s:
            t += sv.iteration_s + sv.seq_s * (decodes if seqs is None else seqs)
        return t

    def with_served(self, served: ServedCosts) -> CostTable:
        """This table with the served path's costs ``served``."""
        return replace(self, served=served)

    def scaled(self, decode: float, prefill: float | None = None, note: str = "") -> CostTable:
        """This table with its engine iterations (grid and KV term) taking ``decode`` times as long where the
        iteration has no prefill (the CUDA-graph replay) and ``prefill`` (default: ``decode``) times as long where
        it has one (the eager forward): a table of one GPU carried over to another from step times measured
        there. ``note`` says where the factors come from (``meta["step_scale"]``); served costs are kept."""
        prefill = decode if prefill is None else prefill
        meta = dict(self.meta, step_scale=dict(decode=decode, prefill=prefill, note=note))
        d0, p0 = self.step_scale
        return replace(self, step_scale=(d0 * decode, p0 * prefill), meta=meta)

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
        d["served"] = ServedCosts(**d.get("served", {}))
        d["step_scale"] = tuple(d.get("step_scale", (1.0, 1.0)))
        return cls(limits=ReplicaLimits(**lim), **d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_json(json.loads(Path(path).read_text()))


def profiled_batch_cap(costs: CostTable, latency_s: float | None = None) -> int:
    """Punica's profiled batch cap: the decode batch beyond which a larger batch slows each token more than it
    raises throughput. With the decode step a line ``s(d) = a + b d`` (least squares over the table's decode
    points, served costs included, one adapter per request up to the table's largest count), doubling the batch
    multiplies throughput by ``2 s(d) / s(2d)`` and each token's latency by ``s(2d) / s(d)``; the second is the
    larger from ``d = a / (sqrt(2) b)`` on, which is the cap. ``latency_s``: also keep the decode step at most
    this long. Between 1 and the engine's max_num_seqs (that, when the step does not grow with the batch)."""
    top = costs.limits.max_num_seqs
    pts = [(d, costs.step(0, d, min(d, costs.adapters[-1]), d * costs.grid_context))
           for d in costs.decode if 0 < d <= top]
    cap = top
    if len(pts) >= 2:
        mx = statistics.fmean(d for d, _ in pts)
        my = statistics.fmean(t for _, t in pts)
        var = sum((d - mx) ** 2 for d, _ in pts)
        b = sum((d - mx) * (t - my) for d, t in pts) / var
        a = my - b * mx
        if b > 0 and a > 0:
            cap = math.ceil(a / (math.sqrt(2) * b))
    if latency_s is not None:
        step = lambda d: costs.step(0, d, min(d, costs.adapters[-1]), d * costs.grid_context)  # noqa: E731
        cap = min(cap, max((d for d in range(1, top + 1) if step(d) <= latency_s), default=1))
    return max(1, min(top, cap))


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
