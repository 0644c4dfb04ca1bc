#!/usr/bin/env bash
# The orchestrator issue's GPU comparison in one device run: V-LoRA's policy vs unmerged-only, merged-only and
# dLoRA-style on a random Llama-2-7B-shaped model, skewness 0.3/0.5/0.7/0.9 and the two V-LoRA application
# profiles. Usage: benchmarks/gpu_policies.sh OUTDIR [seconds per run] [retrieval rates] [video streams]
set -uo pipefail
out=${1:?output dir}; dur=${2:-30}; rates=${3:-2,4,6}; streams=${4:-4,8,16}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
common=(--model random:llama-2-7b --kv-cache-memory-gb 40 --max-num-seqs 64 --max-num-batched-tokens 8192
        --max-lora-rank 64 --num-adapters 32 --duration "$dur" --quiet)
python3 -m vlora.cli bench "${common[@]}" --workload synthetic --sweep skewness --points 0.3,0.5,0.7,0.9 \
    --rate 6 --out "$out/skewness" 2>&1 | tail -20
python3 -m vlora.cli bench "${common[@]}" --workload retrieval --sweep rate --points "$rates" --out "$out/retrieval" \
    2>&1 | tail -14
python3 -m vlora.cli bench "${common[@]}" --workload video --sweep streams --points "$streams" --out "$out/video" \
    2>&1 | tail -14
