#!/usr/bin/env bash
# The memory issue's GPU benchmarks, one part per device call (each fits in 10 minutes):
#   throughput - 5, 100 and 1,000 adapters (target: 1,000 >= 90% of 5)
#   dynamic    - dynamic-popularity multi-turn, fastlibra vs unified vs lru-fixed (target: mean TTFT -50%)
# Usage: benchmarks/gpu_memory.sh OUTDIR throughput|dynamic [policies]
set -uo pipefail
out=${1:?output dir}; part=${2:?throughput or dynamic}; policies=${3:-fastlibra,unified,lru-fixed}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$out/$part"
python3 benchmarks/bench_memory.py --parts "$part" --policies "$policies" --out "$out/$part" 2>&1 \
    | grep -v Warning | tee "$out/$part/memory-$part.log" | tail -20
