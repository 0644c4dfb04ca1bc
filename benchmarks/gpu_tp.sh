#!/usr/bin/env bash
# Tensor parallelism on two GPUs of one host, one part per device call of under 10 minutes:
#   tests:    the tensor-parallel GPU tests (pytest -m gpu tests/parallel)
#   13b:      bench_tp --configs 13b (TP=1 and TP=2, 32 adapters, greedy and sampled, async scheduling on,
#             all-reduce $ALL_REDUCE, default auto)
#   13b-sync: the same with async scheduling off (the before/after pair)
#   34b:      bench_tp --configs 34b (TP=2)
# NCCL's NVLink multicast stays off (the engine sets NCCL_NVLS_ENABLE=0 in every rank; set here too).
# VLORA_COMMIT names the commit measured where the machine's git does not know it.
# Usage: [ALL_REDUCE=auto|nccl|symm_mem] benchmarks/gpu_tp.sh OUT PART
# Writes OUT/PART/: env.txt, the log, and bench_tp's tp-<config>.json/.md (written as each configuration ends).
set -uo pipefail
out=$(realpath -m "${1:?output dir}"); part=${2:?part: tests, 13b, 13b-sync or 34b}
mkdir -p "$out/$part"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{
    echo "commit ${VLORA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null
    nvidia-smi topo -m 2>/dev/null | head -4
} > "$out/$part/env.txt" 2>&1
cat "$out/$part/env.txt"
bench() {   # $1: configs, $2: async on|off, $3: time limit (s)
    timeout "$3" python3 benchmarks/bench_tp.py --configs "$1" --async-scheduling "$2" \
        --all-reduce "${ALL_REDUCE:-auto}" --out "$out/$part" > "$out/$part/bench_tp.log" 2>&1
    echo "bench_tp $1 async $2 exit $?"
    grep -E "started in|e2e |batch 1 |between replays|failed|Error" "$out/$part/bench_tp.log" | tail -30
}
case $part in
    tests)
        timeout 570 python3 -m pytest -q -p no:cacheprovider -m gpu tests/parallel --durations=0 \
            > "$out/tests/tests.log" 2>&1
        echo "pytest exit $?"; tail -25 "$out/tests/tests.log" ;;
    13b) bench 13b on 575 ;;
    13b-sync) bench 13b off 575 ;;
    34b) bench 34b on 575 ;;
    *) echo "unknown part $part"; exit 2 ;;
esac
