#!/usr/bin/env bash
# Sampled decoding against greedy, on one GPU, within 7.5 minutes (each step under `timeout`: 200 + 90 + 150 s):
# bench_e2e with every --sampling setting on the same engine (32 adapters, then base only; no transformers runs),
# then the GPU tests that sample: seeded and sampled tokens on the CUDA graphs under async scheduling, and the
# sampler's own (tests/engine/test_sampl*.py, tests/kernels/test_sampling*.py: the GPU-marked ones there are),
# then `vlora serve` over HTTP beside the offline engine with greedy and sampled (bench_serve; skipped when the
# server's packages, fastapi and uvicorn, do not import).
# Usage: benchmarks/gpu_sampling.sh OUTDIR
# Seen on an H100 / H200 (2026-11-27): bench_e2e 150 s (a minute of it writing the adapters), bench_serve 140 s,
# the tests 66 s. The lent GPU machines lack fastapi and uvicorn: carry vlora's server packages as wheels (the
# versions of requirements.lock, with opentelemetry-api that fastapi imports) and put them on PYTHONPATH first.
# Writes 7 files, all directly in OUTDIR: env.txt, e2e-<gpu>.json/.png and e2e.log, serve-<gpu>.json and serve.log,
# tests.log. Exits 1 if a step failed (a sampling setting that failed makes its benchmark exit 1; see its log).
set -uo pipefail
out=${1:?output dir}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
    git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
    git status --porcelain 2>/dev/null | grep -q . && echo "(uncommitted changes in the working tree)"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
failed=()
# the Triton kernels compiled by the first run land in Triton's disk cache; the later engines load them
timeout 200 python3 benchmarks/bench_e2e.py --skip-hf --sampling greedy,sampled,seeded,min_tokens,penalties,logprobs \
    --out "$out" > "$out/e2e.log" 2>&1
rc=$?; echo "bench_e2e exit $rc"; ((rc)) && failed+=("bench_e2e ($rc)")
grep -E "^\S+ vlora (adapters|base): [0-9]+ output tok/s|decode forward B=|FAILED|Error" "$out/e2e.log" | tail -8
sed -n '/sampled decoding/,$p' "$out/e2e.log"
# tests/engine's GPU tests take over 2 minutes together (mode profiling, merges, kernel builds), and so do
# tests/models/test_fast_path.py's with this one: the one that samples on the graphs, and the sampler's own
shopt -s nullglob
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests/engine/test_async_scheduling.py \
    tests/engine/test_sampl*.py tests/kernels/test_sampling*.py > "$out/tests.log" 2>&1
rc=$?; echo "GPU tests exit $rc"; ((rc)) && failed+=("tests ($rc)")
tail -5 "$out/tests.log"
if python3 -c "import fastapi, uvicorn, httpx" > "$out/serve.log" 2>&1; then
    timeout 150 python3 benchmarks/bench_serve.py --sampling greedy,sampled --out "$out" > "$out/serve.log" 2>&1
    rc=$?
else
    echo "bench_serve skipped: the server's packages do not import (install vlora's dependencies)" >> "$out/serve.log"
    rc=2
fi
echo "bench_serve exit $rc"; ((rc)) && failed+=("bench_serve ($rc)")
grep -E "healthy|FAILED|Error" "$out/serve.log" | tail -6
sed -n '/per sampling setting/,$p' "$out/serve.log"
((${#failed[@]})) && { echo "failed: ${failed[*]}"; exit 1; }
echo "all steps passed"
