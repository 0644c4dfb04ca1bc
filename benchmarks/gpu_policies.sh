#!/usr/bin/env bash
# The orchestrator issue's GPU comparison: V-LoRA's policy vs unmerged-only, merged-only and dLoRA-style on a
# random Llama-2-7B-shaped model, skewness 0.3/0.5/0.7/0.9 and the two V-LoRA application profiles. One part
# per device call, so that each fits in 10 minutes (4 policies x 2 points x (warm-up + run + drain)).
# Usage: [REPEATS=n] benchmarks/gpu_policies.sh OUTDIR PART [seconds per run]
#   PART: skew-low (0.3, 0.5) | skew-high (0.7, 0.9) | retrieval (2, 6 req/s) | video (4, 16 streams) | all
set -uo pipefail
out=${1:?output dir}; part=${2:?part}; dur=${3:-25}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
common=(--model random:llama-2-7b --policy vlora --kv-cache-memory-gb 40 --max-num-seqs 64 --max-num-batched-tokens 8192
        --max-lora-rank 64 --num-adapters 32 --duration "$dur" --repeats "${REPEATS:-1}" --quiet)
run() {   # name, then vlora bench arguments
    local name=$1; shift
    python3 -m vlora.cli bench "${common[@]}" "$@" --out "$out/$name" 2>&1 | grep -v Warning | tail -30
}
case $part in
    skew-low)  run skew-low --workload synthetic --sweep skewness --points 0.3,0.5 --rate 6 ;;
    skew-high) run skew-high --workload synthetic --sweep skewness --points 0.7,0.9 --rate 6 ;;
    retrieval) run retrieval --workload retrieval --sweep rate --points 2,6 ;;
    video)     run video --workload video --sweep streams --points 4,16 ;;
    all)       for p in skew-low skew-high retrieval video; do "$0" "$out" "$p" "$dur"; done ;;
    *)         echo "unknown part $part" >&2; exit 2 ;;
esac
