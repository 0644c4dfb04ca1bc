"""ATMM vs baselines on the kernel grid of BENCHMARKS.md: the batched LoRA delta y += s·(x·A_i)·B_i.

One slice (in = K, out = N), bf16. For every case, in one run:

1. ATMM with the tuned table (``TilingTable.load()`` for this GPU, heuristic for missing keys;
   the source is reported per op and case),
2. ATMM with static tiling: the one (shrink, expand) config pair with the lowest geometric-mean
   time over the grid, picked from a small candidate set (Punica/S-LoRA-like fixed tiles plus the
   configs the table chooses most often); every candidate is timed alone on every case (shrink
   alone, expand alone), the best pair is then timed as one op next to the tuned ATMM,
3. a torch loop over segments (``y[s:e].addmm_(x[s:e] @ A_i^T, B_i, alpha=s_i)``),
4. torch gather-bmm (dLoRA / Einsum style: ranks padded to r_max, per-token A and B gathered with
   ``index_select``, two ``bmm``; skipped when the gathered tensors exceed 4 GiB),
5. the floor: (read x + read/write y + read every active adapter's A and B once) / copy bandwidth
   (a 1 GiB device-to-device copy timed in the same run, bytes read + written).

On Hopper the expand is launched as a programmatic dependent of the shrink (``vlora.kernels.atmm.pdl``); the
tuned pair is then also timed with PDL off (``atmm_no_pdl``), one kernel after the other.

Timing: each op is captured into a CUDA graph with static inputs (metadata built outside), 8 times
on 8 copies of its data (x, y, weights), as a decode step's graph runs its launches back to back;
the median of timed replays, each after a read-only L2 flush (see ``cold_l2_us``), divided by 8.
gather-bmm, whose gathered stacks are large, is captured once.
Correctness first: every system's output (y poisoned with random values, weight buffer gaps NaN)
against the float64 reference, ‖out−ref‖/‖ref‖ ≤ 1e-2 (also relative to the delta alone);
any violation exits non-zero after the report.

    python benchmarks/bench_lora_kernels.py                 # full grid (GPU)
    python benchmarks/bench_lora_kernels.py --quick         # reduced grid
    TRITON_INTERPRET=1 python benchmarks/bench_lora_kernels.py --cpu-smoke   # 2 tiny cases on CPU
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:                     # the interpreter must be chosen before triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import datetime as dt  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlora.kernels import atmm  # noqa: E402
from vlora.kernels.atmm import TileConfig, lora_expand, lora_shrink  # noqa: E402
from vlora.kernels.reference import lora_expand_ref, lora_shrink_ref  # noqa: E402
from vlora.kernels.segments import SegmentMeta  # noqa: E402
from vlora.kernels.tuning import CONFIG_DIR, TilingTable, cold_l2_us, gpu_name, shape_key  # noqa: E402

TOL = 1e-2                                        # bf16 relative error bound (BENCHMARKS.md)
GATHER_CAP_BYTES = 4 << 30                         # gather-bmm: gathered A and B above this -> skipped
MIXED_RANKS = (8, 16, 32, 64)
ZIPF_ALPHA = 1.5

# Static tilings in the spirit of Punica / S-LoRA: one tile for every shape.
STATIC_SHRINK = [TileConfig(16, 16, 64, 1, 4, 2),       # narrow N tile, no split (S-LoRA / Punica BGMV-like)
                 TileConfig(16, 16, 64, 4, 4, 2),       # same with split-K (Punica SGMV shrink-like)
                 TileConfig(32, 64, 64, 1, 4, 3)]       # a mid-size one-size-fits-all tile
STATIC_EXPAND = [TileConfig(16, 64, 16, 1, 4, 2),       # Punica / S-LoRA-like expand
                 TileConfig(32, 128, 16, 1, 4, 2),
                 TileConfig(64, 128, 32, 1, 4, 2)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cfg_str(c: TileConfig | None) -> str:
    return "-" if c is None else "x".join(map(str, c.as_list()))


def geomean(xs) -> float | None:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


# ----------------------------------------------------------------------------- the grid


@dataclass
class CaseSpec:
    name: str
    kind: str                     # "prefill" | "decode"
    k: int                        # in features
    n: int                        # out features
    size: int                     # T (prefill) or B (decode) = number of tokens
    ranks: list[int]              # rank of every adapter of the pool
    token_adapter: list[int]      # adapter of every token, sorted (segments = runs)

    @property
    def label(self) -> str:
        return f"{self.k}>{self.n} {self.name}"

    def segments(self) -> list[tuple[int, int, int]]:
        """(start, len, adapter) runs of the sorted token -> adapter list."""
        segs: list[tuple[int, int, int]] = []
        for t, a in enumerate(self.token_adapter):
            if segs and segs[-1][2] == a:
                s, n, _ = segs[-1]
                segs[-1] = (s, n + 1, a)
            else:
                segs.append((t, 1, a))
        return segs

    @property
    def active(self) -> list[int]:
        return sorted(set(self.token_adapter))

    @property
    def r_max(self) -> int:
        return max(self.ranks[a] for a in self.active)


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def prefill_specs(k: int, n: int, t: int, which: str = "abcd") -> list[CaseSpec]:
    quarter = [i * 4 // t for i in range(t)]
    out = {"a": CaseSpec(f"pf-1x64 T{t}", "prefill", k, n, t, [64], [0] * t),
           "b": CaseSpec(f"pf-4x16 T{t}", "prefill", k, n, t, [16] * 4, quarter),
           "c": CaseSpec(f"pf-4x64 T{t}", "prefill", k, n, t, [64] * 4, quarter),
           "d": CaseSpec(f"pf-4xmix T{t}", "prefill", k, n, t, list(MIXED_RANKS), quarter),
           "e": CaseSpec(f"pf-4x128 T{t}", "prefill", k, n, t, [128] * 4, quarter),
           "g": CaseSpec(f"pf-4x256 T{t}", "prefill", k, n, t, [256] * 4, quarter)}
    return [out[c] for c in which]


def decode_specs(k: int, n: int, b: int, which: tuple[str, ...] = ("d16", "d64", "z64", "zmix")) -> list[CaseSpec]:
    specs = []
    nd = min(b, 64)
    distinct = sorted(i % nd for i in range(b))                 # round-robin, then grouped by adapter
    weights = [1 / (i + 1) ** ZIPF_ALPHA for i in range(32)]
    for w in which:
        if w.startswith("d"):                                  # d<rank>: distinct adapters of that rank
            r = int(w[1:])
            specs.append(CaseSpec(f"dec-distinct-r{r} B{b}", "decode", k, n, b, [r] * nd, distinct))
        else:
            name = f"dec-zipf-{'r64' if w == 'z64' else 'mix'} B{b}"
            rng = random.Random(_seed(f"{k}:{n}:{name}"))
            toks = sorted(rng.choices(range(32), weights, k=b))
            ranks = [64] * 32 if w == "z64" else [MIXED_RANKS[i % 4] for i in range(32)]
            specs.append(CaseSpec(name, "decode", k, n, b, ranks, toks))
    return specs


def build_grid(mode: str) -> list[CaseSpec]:
    if mode == "cpu-smoke":
        return prefill_specs(64, 64, 16, "d") + decode_specs(64, 64, 16, ("zmix",))
    if mode == "quick":
        return (prefill_specs(4096, 4096, 1024, "acdg") + prefill_specs(4096, 4096, 4096, "d")
                + decode_specs(4096, 4096, 16, ("d16", "zmix")) + decode_specs(4096, 4096, 64, ("d64", "d256"))
                + prefill_specs(5120, 5120, 1024, "c") + decode_specs(4096, 11008, 64, ("d64",)))
    grid = []
    for t in (256, 1024, 4096, 8192):
        grid += prefill_specs(4096, 4096, t)
    for b in (1, 16, 64, 256):
        grid += decode_specs(4096, 4096, b)
    for k, n in ((5120, 5120), (4096, 11008), (11008, 4096)):
        grid += prefill_specs(k, n, 1024, "c") + decode_specs(k, n, 64, ("d64",))
    # ranks 128 and 256 (summarised apart, so that the ranks 8-64 figures keep comparing across runs)
    for t in (1024, 4096):
        grid += prefill_specs(4096, 4096, t, "eg")
    for b in (16, 64):
        grid += decode_specs(4096, 4096, b, ("d128", "d256"))
    grid += prefill_specs(11008, 4096, 1024, "g") + decode_specs(11008, 4096, 64, ("d256",))
    return grid


# ----------------------------------------------------------------------------- one case's tensors


@dataclass
class Case:
    spec: CaseSpec
    x: torch.Tensor
    y0: torch.Tensor              # the poisoned initial output (random)
    y: torch.Tensor               # static output buffer every captured op writes
    w: torch.Tensor               # flat weight buffer (gaps NaN)
    a_offs: list[int]             # per adapter of the pool
    b_offs: list[int]
    scales: list[float]
    segs: list[tuple[int, int, int]]
    meta: SegmentMeta
    a_off_t: torch.Tensor         # per segment
    rtot_t: torch.Tensor
    b_off_t: torch.Tensor
    vcol_t: torch.Tensor
    v_ref32: torch.Tensor = None
    y_ref32: torch.Tensor = None
    delta_norm: float = 0.0
    ref_norm: float = 0.0
    floor_bytes: int = 0

    @property
    def S(self) -> int:
        return len(self.segs)


REPLICAS = 8                                      # copies of a case's data captured in one graph (GPU)


def replicas(c: Case, make, n: int | None = None) -> list:
    """``make(case)`` for ``c`` and for copies of it with their own x, y, weights and v (metadata shared):
    captured together, every call reads data no other call left in L2, and a graph launch's fixed cost is
    shared by ``n`` calls instead of being charged to one."""
    n = n if n is not None else (REPLICAS if c.x.is_cuda else 1)
    if not hasattr(c, "_replicas"):
        c._replicas = []
    while len(c._replicas) < n - 1:
        c._replicas.append(dataclasses.replace(c, x=c.x.clone(), y=c.y.clone(), w=c.w.clone(),
                                               v_ref32=c.v_ref32.clone()))
    return [make(c)] + [make(r) for r in c._replicas[:n - 1]]


def build_case(spec: CaseSpec, dtype: torch.dtype, dev: torch.device) -> Case:
    g = torch.Generator(device=dev).manual_seed(_seed(spec.label))
    rng = random.Random(_seed(spec.label))
    k, n = spec.k, spec.n
    a_offs, b_offs, off = [], [], 0
    for r in spec.ranks:                                   # each adapter: A [r, K] then B [r, N], 128-B aligned
        off = -(-off // 64) * 64 + 64                      # a gap before every adapter (NaN: overreads show)
        a_offs.append(off)
        b_offs.append(off + r * k)
        off += r * (k + n)
    w = torch.full((off + 64,), float("nan"), dtype=dtype, device=dev)
    for r, ao, bo in zip(spec.ranks, a_offs, b_offs):
        w[ao:ao + r * k] = (torch.randn(r * k, generator=g, device=dev) / math.sqrt(k)).to(dtype)
        w[bo:bo + r * n] = (torch.randn(r * n, generator=g, device=dev) / math.sqrt(r)).to(dtype)
    scales = [rng.uniform(1.0, 2.0) for _ in spec.ranks]
    x = torch.randn(spec.size, k, generator=g, device=dev).to(dtype)
    y0 = torch.randn(spec.size, n, generator=g, device=dev).to(dtype)
    segs = spec.segments()
    i32 = dict(dtype=torch.int32, device=dev)
    meta = SegmentMeta(starts=torch.tensor([s for s, _, _ in segs], **i32),
                       lens=torch.tensor([m for _, m, _ in segs], **i32),
                       ranks=torch.tensor([spec.ranks[a] for _, _, a in segs], **i32),
                       scales=torch.tensor([scales[a] for _, _, a in segs], dtype=torch.float32, device=dev),
                       max_len=max(m for _, m, _ in segs), num_rows=sum(m for _, m, _ in segs))
    case = Case(spec, x, y0, y0.clone(), w, a_offs, b_offs, scales, segs, meta,
                a_off_t=torch.tensor([a_offs[a] for _, _, a in segs], dtype=torch.int64, device=dev),
                rtot_t=torch.tensor([spec.ranks[a] for _, _, a in segs], **i32),
                b_off_t=torch.tensor([[b_offs[a]] for _, _, a in segs], dtype=torch.int64, device=dev),
                vcol_t=torch.zeros(len(segs), 1, **i32))
    # float64 oracle (vlora.kernels.reference), kept as float32
    starts, lens = meta.starts.tolist(), meta.lens.tolist()
    v_ref = lora_shrink_ref(x, w, case.a_off_t.tolist(), case.rtot_t.tolist(), starts, lens, spec.r_max)
    y_ref = lora_expand_ref(y0, v_ref, w, case.b_off_t.tolist(), case.vcol_t.tolist(), (n,), starts, lens,
                            meta.ranks.tolist(), meta.scales.tolist())
    case.delta_norm = float((y_ref - y0.double()).norm())
    case.ref_norm = float(y_ref.norm())
    case.v_ref32, case.y_ref32 = v_ref.float(), y_ref.float()
    del v_ref, y_ref
    es = x.element_size()
    case.floor_bytes = (spec.size * k * es + 2 * spec.size * n * es
                        + sum(spec.ranks[a] * (k + n) * es for a in spec.active))
    return case


# ----------------------------------------------------------------------------- capture and timing


class Op:
    """One op with static inputs: a CUDA graph on the GPU (warm-up on a side stream first, so Triton
    compiles outside the capture), the plain function on the CPU. ``op()`` runs it and returns its output.

    ``fn`` may be a list: the same op on distinct copies of its data (:func:`replicas`), captured one after
    another in one graph and timed per call, as a decode step runs its launches back to back; the first
    one's output is what ``op()`` returns and the checks see."""

    def __init__(self, fn, dev: torch.device, bench: dict):
        fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
        self.fn, self.fns, self.bench, self.graph, self.out = fns[0], fns, bench, None, None
        if dev.type == "cuda":
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    for f in fns:
                        f()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                outs = [f() for f in fns]
            self.out = outs[0]
            torch.cuda.synchronize()
        else:
            self.out = self.fn()

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
            torch.cuda.synchronize()
            return self.out
        self.out = self.fn()
        return self.out

    def time_us(self) -> float:
        if self.graph is not None:
            return cold_l2_us(self.graph.replay, self.bench["warmup_ms"], self.bench["rep_ms"], 20) / len(self.fns)
        times = []
        for _ in range(self.bench["cpu_reps"]):
            t0 = time.perf_counter()
            self.fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    def close(self) -> None:
        self.graph = self.out = self.fn = self.fns = None


def copy_bandwidth(dev: torch.device, bench: dict) -> tuple[float, int]:
    """Bytes/s of a large device-to-device copy (bytes read + written)."""
    nbytes = (1 << 30) if dev.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    if dev.type == "cuda":
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
        sec = ms / 1e3
    else:
        dst.copy_(src)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t0)
        sec = statistics.median(ts)
    del src, dst
    return 2 * nbytes / sec, nbytes


# ----------------------------------------------------------------------------- the systems


def atmm_fn(c: Case, cs: TileConfig, ce: TileConfig, pdl: bool = True):
    spec = c.spec

    def fn():
        v = lora_shrink(c.x, c.w, c.a_off_t, c.rtot_t, c.meta, spec.r_max, cs, aligned=True, pdl=pdl)
        return lora_expand(c.y, v, c.w, c.b_off_t, c.vcol_t, (spec.n,), c.meta, ce, aligned=True,
                           max_rank=spec.r_max, pdl=pdl)
    return fn


def expand_key(cfg: TileConfig, planes: int) -> str:
    """An expand candidate's key in ``cand_us``: its config, and the planes of v it reads when more than one."""
    return cfg_str(cfg) if planes == 1 else f"{cfg_str(cfg)}@{planes}p"


def with_planes(v: torch.Tensor, planes: int) -> torch.Tensor:
    """v as ``planes`` planes of a split-K shrink: v, then zeros."""
    return torch.cat([v.unsqueeze(0), v.new_zeros(planes - 1, *v.shape)])


def shrink_fn(c: Case, cs: TileConfig):
    return lambda: lora_shrink(c.x, c.w, c.a_off_t, c.rtot_t, c.meta, c.spec.r_max, cs, aligned=True)


def expand_fn(c: Case, ce: TileConfig, v_in: torch.Tensor):
    return lambda: lora_expand(c.y, v_in, c.w, c.b_off_t, c.vcol_t, (c.spec.n,), c.meta, ce, aligned=True,
                               max_rank=c.spec.r_max)


def loop_fn(c: Case):
    k, n = c.spec.k, c.spec.n
    views = []
    for s, m, a in c.segs:
        r = c.spec.ranks[a]
        views.append((s, m, c.w[c.a_offs[a]:c.a_offs[a] + r * k].view(r, k),
                      c.w[c.b_offs[a]:c.b_offs[a] + r * n].view(r, n), c.scales[a]))

    def fn():
        for s, m, a, b, sc in views:
            c.y[s:s + m].addmm_(c.x[s:s + m] @ a.t(), b, alpha=sc)
        return c.y
    return fn


def gather_bytes(c: Case) -> int:
    return c.spec.size * c.spec.r_max * (c.spec.k + c.spec.n) * c.x.element_size()


def gather_fn(c: Case):
    """dLoRA / Einsum style: per-token weights gathered from rank-padded stacks, then two bmm."""
    spec, k, n, rm = c.spec, c.spec.k, c.spec.n, c.spec.r_max
    dev, dt_ = c.x.device, c.x.dtype
    a_pad = torch.zeros(len(spec.ranks), k, rm, dtype=dt_, device=dev)
    b_pad = torch.zeros(len(spec.ranks), rm, n, dtype=dt_, device=dev)
    for i, r in enumerate(spec.ranks):
        if r <= rm:
            a_pad[i, :, :r] = c.w[c.a_offs[i]:c.a_offs[i] + r * k].view(r, k).t()
            b_pad[i, :r] = c.w[c.b_offs[i]:c.b_offs[i] + r * n].view(r, n)
    idx = torch.tensor(spec.token_adapter, dtype=torch.int64, device=dev)
    sc = torch.tensor(c.scales, dtype=torch.float32, device=dev)[idx].to(dt_).view(-1, 1, 1)

    def fn():
        v = torch.bmm(c.x.unsqueeze(1), a_pad.index_select(0, idx))        # [T, 1, r_max]
        v.mul_(sc)
        c.y.add_(torch.bmm(v, b_pad.index_select(0, idx)).squeeze(1))     # [T, N]
        return c.y
    return fn


# ----------------------------------------------------------------------------- checks


class Checker:
    def __init__(self):
        self.failures: list[str] = []

    def y(self, c: Case, out: torch.Tensor, what: str) -> dict:
        diff = float((out.float() - c.y_ref32).norm())
        err = {"rel": diff / max(c.ref_norm, 1e-30), "rel_delta": diff / max(c.delta_norm, 1e-30)}
        self._judge(c, err, what)
        return err

    def v(self, c: Case, v: torch.Tensor, what: str) -> dict:
        # the shrink returns one plane (its split-K parts summed); only segment rows and R_s columns are defined
        vv = v.float().sum(0) if v.dim() == 3 else v.float()
        got = torch.zeros_like(c.v_ref32)
        for s0, n, r in zip(c.meta.starts.tolist(), c.meta.lens.tolist(), c.rtot_t.tolist()):
            got[s0:s0 + n, :r] = vv[s0:s0 + n, :r]
        diff = float((got - c.v_ref32).norm())
        err = {"rel": diff / max(float(c.v_ref32.norm()), 1e-30)}
        self._judge(c, err, what)
        return err

    def _judge(self, c: Case, err: dict, what: str) -> None:
        bad = [f"{k}={e:.3g}" for k, e in err.items() if not (e <= TOL)]     # NaN fails too
        if bad:
            msg = f"CORRECTNESS FAILURE {c.spec.label} [{what}]: {' '.join(bad)} (tol {TOL})"
            self.failures.append(msg)
            log(msg)


def run_y_op(c: Case, fn, dev, bench, chk: Checker, what: str) -> tuple[float, dict]:
    """Capture, check the captured op on a poisoned y, time it."""
    op = Op(fn, dev, bench)
    try:
        c.y.copy_(c.y0)
        err = chk.y(c, op(), what)
        return op.time_us(), err
    finally:
        op.close()


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a reduced grid and fewer static candidates")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="2 tiny cases on the CPU (Triton interpreter), perf_counter timing, json to a temp dir")
    p.add_argument("--table", type=Path, default=None, help="tiling table json (default: this GPU's table)")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory (default benchmarks/results; a temp dir with --cpu-smoke)")
    p.add_argument("--only", default=None, help="regex: run only the cases whose label matches")
    p.add_argument("--max-candidates", type=int, default=None, help="static candidates per op (default 8)")
    return p.parse_args()


def load_table(path: Path | None) -> tuple[TilingTable, str, bool]:
    if path is None:
        default = CONFIG_DIR / f"{gpu_name()}.json"
        return TilingTable.load(), str(default), default.is_file()
    if not path.is_file():
        raise SystemExit(f"--table {path}: no such file")
    data = json.loads(path.read_text())
    return TilingTable(data["entries"], {k: v for k, v in data.items() if k != "entries"}), str(path), True


def tuned_configs(table: TilingTable, spec: CaseSpec) -> dict:
    t, s, r = spec.size, len(spec.segments()), spec.r_max
    out = {}
    for op, dim in (("shrink", spec.k), ("expand", spec.n)):
        key = shape_key(op, t, s, dim, r)
        out[op] = (table.get(op, t, s, dim, r), key, "table" if key in table.entries else "heuristic")
    return out


def candidates(statics: list[TileConfig], tuned: list[TileConfig], cap: int) -> list[TileConfig]:
    """The fixed tilings first, then the configs the table picks most often, at most ``cap`` in all."""
    out = list(dict.fromkeys(statics))[:cap]
    for cfg, _ in collections.Counter(tuned).most_common():
        if len(out) >= cap:
            break
        if cfg not in out:
            out.append(cfg)
    return out


def main() -> None:
    args = parse_args()
    mode = "cpu-smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    t_start = time.perf_counter()
    if mode == "cpu-smoke":
        dev, dtype = torch.device("cpu"), torch.float16     # the Triton CPU interpreter mis-handles bf16
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="bench_lora_kernels-"))
        bench = {"cpu_reps": 3}
        cap = args.max_candidates or 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --cpu-smoke (with TRITON_INTERPRET=1) on a CPU machine")
        dev, dtype = torch.device("cuda"), torch.bfloat16
        out_dir = args.out or ROOT / "benchmarks" / "results"
        bench = {"warmup_ms": 5, "rep_ms": 20} if mode == "quick" else {"warmup_ms": 10, "rep_ms": 40}
        cap = args.max_candidates or (5 if mode == "quick" else 8)
    gname = gpu_name()
    specs = build_grid(mode)
    if args.only:
        specs = [s for s in specs if re.search(args.only, s.label)]
        if not specs:
            raise SystemExit(f"--only {args.only!r}: no case matches")
    table, table_path, table_found = load_table(args.table)
    tuned = {s.label: tuned_configs(table, s) for s in specs}
    n_static = 1 if mode == "cpu-smoke" else 3
    cand_s = candidates(STATIC_SHRINK[:n_static], [t["shrink"][0] for t in tuned.values()], cap)
    cand_e = candidates(STATIC_EXPAND[:n_static], [t["expand"][0] for t in tuned.values()], cap)
    log(f"{mode}: {len(specs)} cases on {gname} ({dtype}); table {table_path} "
        f"({'found' if table_found else 'absent -> heuristic'}); "
        f"static candidates: {len(cand_s)} shrink, {len(cand_e)} expand")

    bw, copy_bytes = copy_bandwidth(dev, bench)
    log(f"copy bandwidth {bw / 1e9:.1f} GB/s ({copy_bytes >> 20} MiB copy, read + write)")

    chk = Checker()
    cases: list[Case] = []
    recs: list[dict] = []
    for i, spec in enumerate(specs):
        c = build_case(spec, dtype, dev)
        cs, ce = tuned[spec.label]["shrink"][0], tuned[spec.label]["expand"][0]
        rec = {"label": spec.label, "name": spec.name, "kind": spec.kind, "in": spec.k, "out": spec.n,
               "tokens": spec.size, "segments": c.S, "adapters_active": len(spec.active),
               "ranks_active": [spec.ranks[a] for a in spec.active], "r_max": spec.r_max,
               "floor_bytes": c.floor_bytes, "floor_us": 1e6 * c.floor_bytes / bw,
               "tuned": {op: {"config": t[0].as_list(), "key": t[1], "source": t[2]}
                         for op, t in tuned[spec.label].items()},
               "us": {}, "err": {}, "cand_us": {"shrink": {}, "expand": {}}}
        # 1. ATMM, tuned
        rec["us"]["atmm_pass1"], rec["err"]["atmm"] = run_y_op(c, replicas(c, lambda r: atmm_fn(r, cs, ce)), dev,
                                                               bench, chk, "atmm tuned")
        # 2. static candidates, each op alone
        for cfg in cand_s:
            try:
                op = Op(replicas(c, lambda r: shrink_fn(r, cfg)), dev, bench)
            except Exception as e:                          # e.g. out of shared memory: not a candidate
                log(f"  shrink {cfg_str(cfg)} unavailable: {type(e).__name__}: {str(e)[:120]}")
                rec["cand_us"]["shrink"][cfg_str(cfg)] = None
                continue
            err = chk.v(c, op(), f"shrink candidate {cfg_str(cfg)}")
            rec["cand_us"]["shrink"][cfg_str(cfg)] = op.time_us() if err["rel"] <= TOL else None
            op.close()
        for cfg, planes in itertools.product(cand_e, sorted({s_.planes for s_ in cand_s})):
            # as after a shrink handing over this many planes (their sum: v, then zeros)
            try:
                t_us, err = run_y_op(c, replicas(c, lambda r: expand_fn(r, cfg, with_planes(r.v_ref32, planes))),
                                     dev, bench, chk, f"expand candidate {expand_key(cfg, planes)}")
            except Exception as e:
                log(f"  expand {cfg_str(cfg)} unavailable: {type(e).__name__}: {str(e)[:120]}")
                t_us, err = None, {"rel": float("nan")}
            rec["cand_us"]["expand"][expand_key(cfg, planes)] = t_us if err["rel"] <= TOL else None
        # 3. torch loop over segments
        rec["us"]["loop"], rec["err"]["loop"] = run_y_op(c, replicas(c, loop_fn), dev, bench, chk, "torch loop")
        # 4. torch gather-bmm
        gb = gather_bytes(c)
        rec["gather_bytes"] = gb
        if gb > GATHER_CAP_BYTES:
            rec["us"]["gather"], rec["gather_status"] = None, "oom/skipped"
        else:
            try:
                rec["us"]["gather"], rec["err"]["gather"] = run_y_op(c, gather_fn(c), dev, bench, chk, "gather-bmm")
                rec["gather_status"] = "ok"
            except torch.cuda.OutOfMemoryError:
                rec["us"]["gather"], rec["gather_status"] = None, "oom/skipped"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        cases.append(c)
        recs.append(rec)
        log(f"{i + 1}/{len(specs)} {spec.label}: S={c.S} floor {rec['floor_us']:.1f}us "
            f"atmm {rec['us']['atmm_pass1']:.1f}us loop {rec['us']['loop']:.1f}us "
            f"gather {rec['us']['gather'] if rec['us']['gather'] is None else round(rec['us']['gather'], 1)}")

    # the static pair: lowest geometric mean of (shrink alone + expand alone) over the grid
    ok_s = [cfg for cfg in cand_s if all(r["cand_us"]["shrink"].get(cfg_str(cfg)) for r in recs)]
    ok_e = [cfg for cfg in cand_e if all(r["cand_us"]["expand"].get(expand_key(cfg, s_.planes))
                                         for r in recs for s_ in ok_s)]
    if not ok_s or not ok_e:
        die("no static candidate ran correctly on every case", chk)
    pairs = {(s_, e_): geomean([r["cand_us"]["shrink"][cfg_str(s_)] + r["cand_us"]["expand"][expand_key(e_, s_.planes)]
                                for r in recs]) for s_ in ok_s for e_ in ok_e}
    static_s, static_e = min(pairs, key=pairs.get)
    log(f"static tiling: shrink {cfg_str(static_s)} expand {cfg_str(static_e)} "
        f"(geomean of separate timings {pairs[(static_s, static_e)]:.1f}us)")

    # pass 2: the static pair and the tuned ATMM as whole ops, side by side (and, where the expand is a
    # programmatic dependent of the shrink, the tuned pair without that)
    pdl_on = atmm.pdl(dev)
    for c, rec in zip(cases, recs):
        cs, ce = tuned[c.spec.label]["shrink"][0], tuned[c.spec.label]["expand"][0]
        static_fns = replicas(c, lambda r: atmm_fn(r, static_s, static_e))
        rec["us"]["static"], rec["err"]["static"] = run_y_op(c, static_fns, dev, bench, chk, "atmm static")
        rec["us"]["atmm"], _ = run_y_op(c, replicas(c, lambda r: atmm_fn(r, cs, ce)), dev, bench, chk,
                                        "atmm tuned (pass 2)")
        if pdl_on:                              # the same pair launched one kernel after the other
            rec["us"]["atmm_no_pdl"], _ = run_y_op(c, replicas(c, lambda r: atmm_fn(r, cs, ce, pdl=False)), dev,
                                                   bench, chk, "atmm tuned, no PDL")
        us = rec["us"]
        rec["ratio"] = {"atmm_floor": us["atmm"] / rec["floor_us"],
                        "static_floor": us["static"] / rec["floor_us"],
                        "loop_floor": us["loop"] / rec["floor_us"],
                        "gather_floor": us["gather"] / rec["floor_us"] if us["gather"] else None,
                        "static_atmm": us["static"] / us["atmm"],
                        "loop_atmm": us["loop"] / us["atmm"],
                        "gather_atmm": us["gather"] / us["atmm"] if us["gather"] else None}
    del cases

    low = [r for r in recs if r["r_max"] <= 64]                 # the grid of ranks 8-64
    high = [r for r in recs if r["r_max"] > 64]                 # ranks 128 and 256
    pf = [r["ratio"]["atmm_floor"] for r in low if r["kind"] == "prefill" and r["tokens"] >= 1024]
    dc = [r["ratio"]["atmm_floor"] for r in low if r["kind"] == "decode" and r["tokens"] >= 16]
    summary = {
        "prefill_T>=1024_atmm_over_floor_geomean": {"value": geomean(pf), "target": "<= 1.25", "cases": len(pf)},
        "decode_B>=16_atmm_over_floor_geomean": {"value": geomean(dc), "target": "<= 1.8", "cases": len(dc)},
        "static_over_tuned_geomean": {"value": geomean(r["ratio"]["static_atmm"] for r in low),
                                      "target": ">= 1.2", "cases": len(low)},
        "loop_over_atmm_geomean": {"value": geomean(r["ratio"]["loop_atmm"] for r in low)},
        "gather_over_atmm_geomean": {"value": geomean(r["ratio"]["gather_atmm"] for r in low),
                                     "cases": sum(r["ratio"]["gather_atmm"] is not None for r in low)},
        # every case, ranks 128 and 256 too: where the tuned ATMM is not the fastest
        "cases_static_faster": {"value": [r["label"] for r in recs if r["ratio"]["static_atmm"] < 1], "target": "none"},
        "cases_loop_faster": {"value": [r["label"] for r in recs if r["ratio"]["loop_atmm"] < 1], "target": "none"},
    }
    if high:
        summary["ranks_128_256_atmm_over_floor_geomean"] = {
            "value": geomean(r["ratio"]["atmm_floor"] for r in high), "cases": len(high)}
        summary["ranks_128_256_static_over_tuned_geomean"] = {
            "value": geomean(r["ratio"]["static_atmm"] for r in high), "cases": len(high)}
        summary["ranks_128_256_loop_over_atmm_geomean"] = {
            "value": geomean(r["ratio"]["loop_atmm"] for r in high), "cases": len(high)}
    if pdl_on:
        summary["no_pdl_over_pdl_geomean"] = {"value": geomean(r["us"]["atmm_no_pdl"] / r["us"]["atmm"] for r in low)}
        for name, sel in (("prefill_T>=1024", lambda r: r["kind"] == "prefill" and r["tokens"] >= 1024),
                          ("decode_B>=16", lambda r: r["kind"] == "decode" and r["tokens"] >= 16)):
            summary[f"{name}_no_pdl_over_floor_geomean"] = {
                "value": geomean(r["us"]["atmm_no_pdl"] / r["floor_us"] for r in low if sel(r))}
    for k, fn_ in (("prefill_T>=1024_atmm_over_floor_geomean", lambda v: v <= 1.25),
                   ("decode_B>=16_atmm_over_floor_geomean", lambda v: v <= 1.8),
                   ("static_over_tuned_geomean", lambda v: v >= 1.2),
                   ("cases_static_faster", lambda v: not v), ("cases_loop_faster", lambda v: not v)):
        v = summary[k]["value"]
        summary[k]["met"] = None if v is None else bool(fn_(v))

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"lora_kernels-{gname}"
    result = {
        "benchmark": "lora_kernels", "mode": mode, "date": dt.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton interpreter)",
        "gpu_name": gname, "torch": torch.__version__, "triton": triton.__version__, "pdl": pdl_on,
        "dtype": str(dtype).removeprefix("torch."), "tolerance": TOL,
        "timing": (f"CUDA graph of {REPLICAS} calls on copies of the data, median of event-timed replays / "
                   f"{REPLICAS} (L2 flushed by a 256 MiB read before each), "
                   f"warmup {bench.get('warmup_ms')} ms, rep {bench.get('rep_ms')} ms") if dev.type == "cuda"
        else f"time.perf_counter median of {bench['cpu_reps']} direct calls (no CUDA graph)",
        "copy_bandwidth_GBps": bw / 1e9, "copy_bytes": copy_bytes,
        "floor": "bytes(x read + y read/write + active adapters' A, B read) / copy bandwidth",
        "table": {"path": table_path, "found": table_found, "meta": table.meta},
        "static": {"shrink": static_s.as_list(), "expand": static_e.as_list(),
                   "candidates": {"shrink": [c_.as_list() for c_ in cand_s],
                                  "expand": [c_.as_list() for c_ in cand_e]},
                   "selection": "lowest geomean over the grid of (shrink alone + expand alone) time",
                   "pair_geomean_us": {f"{cfg_str(a)}|{cfg_str(b)}": v for (a, b), v in sorted(pairs.items(), key=lambda kv: kv[1])}},
        "tile_config_fields": [f.name for f in dataclasses.fields(TileConfig)],
        "gather_cap_bytes": GATHER_CAP_BYTES,
        "summary": summary, "cases": recs, "failures": chk.failures,
        "runtime_s": time.perf_counter() - t_start,
    }
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=1))
    plot_note = plot(recs, out_dir / f"{stem}.png", f"{result['dtype']}, {result['device']}, {result['date'][:10]}")

    print_report(recs, summary, result, json_path, plot_note)
    if chk.failures:
        print(f"\n{len(chk.failures)} CORRECTNESS FAILURE(S):", file=sys.stderr)
        for f in chk.failures:
            print("  " + f, file=sys.stderr)
        sys.exit(1)


def die(msg: str, chk: Checker) -> None:
    for f in chk.failures:
        print("  " + f, file=sys.stderr)
    print(f"{msg} ({len(chk.failures)} correctness failure(s) above)", file=sys.stderr)
    sys.exit(1)


def plot(recs: list[dict], path: Path, title: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(recs)), 5))
    xs = range(len(recs))
    for key, marker, name in (("atmm_floor", "o", "ATMM (tuned)"), ("static_floor", "s", "ATMM static"),
                              ("loop_floor", "^", "torch loop"), ("gather_floor", "v", "gather-bmm")):
        pts = [(i, r["ratio"][key]) for i, r in zip(xs, recs) if r["ratio"][key]]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="floor")
    ax.set_yscale("log")
    ax.set_ylabel("time / floor")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["label"] for r in recs], rotation=75, ha="right", fontsize=7)
    ax.set_title(f"batched LoRA delta: {title}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def _f(v: float | None, nd: int = 1, none: str = "-") -> str:
    if v is None:
        return none
    return f"{v:.{nd}f}" if v < 1e4 else f"{v:.3g}"


def print_report(recs: list[dict], summary: dict, result: dict, json_path: Path, plot_note: str) -> None:
    st = result["static"]
    print(f"\nbatched LoRA delta y += s*(x A_i) B_i, {result['dtype']}, {result['device']}, {result['date']}")
    print(f"torch {result['torch']}, triton {result['triton']}; copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s;"
          f" table {'found' if result['table']['found'] else 'absent (heuristic)'}: {result['table']['path']}")
    print(f"static tiling: shrink {cfg_str(TileConfig(*st['shrink']))}, expand {cfg_str(TileConfig(*st['expand']))}"
          f" ({' x '.join(f.name for f in dataclasses.fields(TileConfig))})")
    print(f"results: {json_path}; {plot_note}")
    srcs = {"table": "T", "heuristic": "H"}
    hdr = (f"{'case':<32} {'S':>4} {'floor':>8} {'ATMM':>8} {'static':>8} {'loop':>8} {'gather':>8} "
           f"{'A/floor':>8} {'st/A':>6} {'loop/A':>7} {'gath/A':>7}  cfg")
    print("\n" + hdr)
    print("-" * len(hdr))
    for r in recs:
        us, ra = r["us"], r["ratio"]
        src = srcs[r["tuned"]["shrink"]["source"]] + srcs[r["tuned"]["expand"]["source"]]
        print(f"{r['label']:<32} {r['segments']:>4} {_f(r['floor_us']):>8} {_f(us['atmm']):>8} {_f(us['static']):>8} "
              f"{_f(us['loop']):>8} {_f(us['gather'], none='oom/skip'):>8} {_f(ra['atmm_floor'], 2):>8} {_f(ra['static_atmm'], 2):>6} "
              f"{_f(ra['loop_atmm'], 2):>7} {_f(ra['gather_atmm'], 2):>7}  {src}")
    print("-" * len(hdr))
    print(f"times in us ({result['timing'].split(',')[0]}); cfg: tuned config source of shrink/expand, "
          "T = table, H = heuristic; oom/skip: gathered weights over 4 GiB")
    for k, s in summary.items():
        v = s["value"]
        tgt = f" (target {s['target']}: {'met' if s.get('met') else 'NOT met'})" if s.get("met") is not None else ""
        text = "n/a" if v is None else (", ".join(v) or "none") if isinstance(v, list) else f"{v:.2f}"
        print(f"{k:<42} {text}{tgt}")


if __name__ == "__main__":
    main()
