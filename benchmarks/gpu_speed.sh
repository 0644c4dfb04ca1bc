#!/usr/bin/env bash
# Speed as users get it, on one GPU, within 9 minutes: the engine end to end with its defaults (bench_e2e, 32
# adapters and base only, no tuning flags), then `vlora serve` with its defaults driven over HTTP beside the offline
# engine (bench_serve). Usage: benchmarks/gpu_speed.sh OUTDIR
# Writes OUTDIR/env.txt, e2e-<gpu>.json/.png and e2e.log, serve-<gpu>.json and serve.log.
set -uo pipefail
out=${1:?output dir}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
    git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    # the HTTP server's event loop: uvloop and httptools when installed (uvicorn picks them), else asyncio and h11
    python3 -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in ('uvloop', 'httptools')})"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
# the Triton kernels compiled by the first run land in Triton's disk cache; the later engines load them
timeout 240 python3 benchmarks/bench_e2e.py --skip-hf --out "$out" > "$out/e2e.log" 2>&1
echo "bench_e2e exit $?"; grep -E "output tok/s|decode forward|pool|wrote" "$out/e2e.log" | tail -8
timeout 290 python3 benchmarks/bench_serve.py --out "$out" > "$out/serve.log" 2>&1
echo "bench_serve exit $?"; grep -E "tok/s|HTTP /|healthy|wrote" "$out/serve.log" | tail -10
