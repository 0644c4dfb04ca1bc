#!/usr/bin/env bash
# One device run for the decode fast path: GPU tests, decode-bucket retune (merged into the shipped
# table), skinny-GEMM benchmark, end-to-end benchmark with the new table.
# Usage: benchmarks/gpu_decode.sh OUTDIR [--no-tests]
set -uo pipefail
out=${1:?output dir}; tests=${2:-}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
gpu=$(python3 -c "from vlora.kernels.tuning import gpu_name; print(gpu_name())")
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
[[ $tests == --no-tests ]] || timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/server tests 2>&1 \
    | tee "$out/gpu-tests-$gpu.log" | tail -8
cp "vlora/kernels/configs/$gpu.json" "$out/$gpu.json" 2>/dev/null
python3 -m vlora.cli tune --preset llama-7b --tokens 1,4,16,64 --segments 1,4,16,64 --ranks 8,16,32,64 \
    --merge --budget-s 170 --output "$out/$gpu.json" 2>&1 | tail -3
cp "$out/$gpu.json" "vlora/kernels/configs/$gpu.json"
timeout 120 python3 benchmarks/bench_gemv.py --out "$out" 2>&1 | tee "$out/gemv-$gpu.log" | tail -25
python3 benchmarks/bench_e2e.py --skip-peft --out "$out" 2>&1 | tee "$out/e2e-$gpu.log" | tail -30
