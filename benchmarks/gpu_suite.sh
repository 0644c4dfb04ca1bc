#!/usr/bin/env bash
# One device run: GPU tests, ATMM tiling search, kernel benchmark. Usage: benchmarks/gpu_suite.sh OUTDIR [tune budget s]
set -uo pipefail
out=${1:?output dir}; budget=${2:-240}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
gpu=$(python3 -c "from vlora.kernels.tuning import gpu_name; print(gpu_name())")
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/server tests -x 2>&1 | tee "$out/gpu-tests-$gpu.log" | tail -15
python3 -m vlora.cli tune --preset bench-grid --ranks 8,16,32,64 --budget-s "$budget" --no-merge \
    --output "$out/$gpu.json" 2>&1 | tail -3
python3 benchmarks/bench_lora_kernels.py --table "$out/$gpu.json" --out "$out" 2>&1 | tee "$out/bench-$gpu.log" | tail -60
