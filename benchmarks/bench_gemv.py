"""Skinny GEMM (decode at batch 1-4) against cuBLAS and the weight-bytes floor, per Llama-2-7B projection.

Each case cycles over enough copies of the weight that none is in L2 when it is
read (the decode step reads every weight once). Floor: weight bytes / copy
bandwidth measured in the same run. Also sweeps (BLOCK_K, warps) around the
heuristic to show how far it is from the best config of this grid.

    python benchmarks/bench_gemv.py            # GPU only
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import triton

from vlora.kernels.gemv import gemv, gemv_config
from vlora.kernels.tuning import gpu_name

SHAPES = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096),
          "lm_head": (4096, 32000)}


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / time_fn(lambda i: dst.copy_(src), 20)


def time_fn(fn, iters: int) -> float:
    """Seconds per call, median of 5 timed bursts of ``iters`` calls (call i gets its index)."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return sorted(times)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    print(f"{gpu_name()}: copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'proj':8} {'M':>2} {'floor us':>9} {'cublas':>7} {'gemv':>7} {'best':>7}  best cfg")
    for name, (k, n) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, math.ceil((256 << 20) / nbytes) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = (x.double() @ ws[0].double().T)
            err = ((gemv(x, ws[0]).double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"{name} M={m}: relative error {err}"
            floor = nbytes / bw
            t_cublas = time_fn(lambda i: torch.nn.functional.linear(x, ws[i % copies]), 50)
            t_gemv = time_fn(lambda i: gemv(x, ws[i % copies]), 50)
            bn, bk, wp = gemv_config(m, n, k)
            best = (t_gemv, (bn, bk, wp))
            m_pad = triton.next_power_of_2(m)
            for block_k in (256, 512, 1024):
                for partials in (4096, 8192, 16384):
                    for warps in (4, 8):
                        block_n = max(1, partials // (m_pad * block_k))
                        cfg = (block_n, min(block_k, triton.next_power_of_2(k)), warps)
                        t = time_fn(lambda i: gemv(x, ws[i % copies], config=cfg), 50)
                        best = min(best, (t, cfg))
            rows.append({"proj": name, "m": m, "k": k, "n": n, "floor_us": floor * 1e6,
                         "cublas_us": t_cublas * 1e6, "gemv_us": t_gemv * 1e6, "best_us": best[0] * 1e6,
                         "best_config": best[1], "heuristic_config": (bn, bk, wp), "rel_err": err})
            print(f"{name:8} {m:>2} {floor * 1e6:9.1f} {t_cublas * 1e6:7.1f} {t_gemv * 1e6:7.1f} "
                  f"{best[0] * 1e6:7.1f}  {best[1]}")
        del ws
    for m in (1, 2, 4):
        sel = [r for r in rows if r["m"] == m]
        geo = lambda key: math.exp(sum(math.log(r[key] / r["floor_us"]) for r in sel) / len(sel))  # noqa: E731
        print(f"M={m}: geomean time/floor cublas {geo('cublas_us'):.3f} gemv {geo('gemv_us'):.3f} "
              f"best {geo('best_us'):.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gemv-{gpu_name()}.json"
    path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_bw_gbs": bw / 1e9, "rows": rows},
                               indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
