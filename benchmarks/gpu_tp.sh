#!/usr/bin/env bash
# Tensor parallelism on two GPUs of one host (70b: four), one part per device call of under 10 minutes:
#   tests-graphs, tests-other: the tensor-parallel GPU tests (pytest -m gpu tests/parallel), the decode-graph
#             tests (three all-reduces) and the others (tokens, a killed worker under two all-reduces,
#             FastLibra), one device call each: a process's first engine builds every Triton variant it can
#             launch, 2-3 minutes on a fresh machine
#   profile:  rank 0's host phases and GPU kernels of TP=2 decode steps (13B shape, batch 1 and 64, 32 adapters
#             of ranks 8-64; profile_step --replay-kernels)
#   13b:      bench_tp --configs 13b (TP=1 and TP=2, 32 adapters, greedy and sampled, async scheduling on,
#             all-reduce $ALL_REDUCE, default auto)
#   13b-sync: the same with async scheduling off (the before/after pair)
#   34b:      bench_tp --configs 34b (TP=2)
#   70b-tokens, 70b: four GPUs: bench_tp --configs 70b-tokens (the 70B shape cut to two layers, TP=4 tokens
#             against TP=1), --configs 70b (the whole shape at TP=4, 32 adapters: about 25 GB of adapter files
#             written first)
# NCCL's NVLink multicast stays off (the engine sets NCCL_NVLS_ENABLE=0 in every rank; set here too).
# VLORA_COMMIT names the commit measured where the machine's git does not know it.
# Usage: [ALL_REDUCE=auto|nccl|symm_mem] benchmarks/gpu_tp.sh OUT PART
# Writes OUT/PART/: env.txt, the log, and bench_tp's tp-<config>.json/.md (written as each configuration ends).
set -uo pipefail
out=$(realpath -m "${1:?output dir}"); part=${2:?part: tests-graphs, tests-other, profile, 13b, 13b-sync, 34b, 70b-tokens or 70b}
mkdir -p "$out/$part"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/gpu_env.sh"
gpu_env "$out/$part"
bench() {   # $1: configs, $2: async on|off, $3: time limit (s)
    timeout "$3" python3 benchmarks/bench_tp.py --configs "$1" --async-scheduling "$2" \
        --all-reduce "${ALL_REDUCE:-auto}" --out "$out/$part" > "$out/$part/bench_tp.log" 2>&1
    echo "bench_tp $1 async $2 exit $?"
    grep -E "started in|e2e |batch 1 |between replays|failed|Error" "$out/$part/bench_tp.log" | tail -30
}
case $part in
    tests-graphs|tests-other)
        sel="equals_one_gpu_eager"; [ "$part" = tests-other ] && sel="not equals_one_gpu_eager"
        timeout 570 python3 -m pytest -v -p no:cacheprovider -m gpu tests/parallel -k "$sel" --durations=0 \
            > "$out/$part/tests.log" 2>&1
        echo "pytest -k '$sel' exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/$part/tests.log" | tail -12 ;;
    profile)
        for b in 1 64; do
            timeout 280 python3 benchmarks/profile_step.py --model random:llama-2-13b --batch "$b" --adapters 32 \
                --rank 8,16,32,64 --steps 10 --no-cprofile --replay-kernels --top 30 --tensor-parallel-size 2 \
                --all-reduce "${ALL_REDUCE:-auto}" > "$out/profile/profile-b$b.log" 2>&1
            echo "profile batch $b exit $?"; grep -E "engine step|median decode|GPU kernels over" "$out/profile/profile-b$b.log"
        done ;;
    13b) bench 13b on 575 ;;
    13b-sync) bench 13b off 575 ;;
    34b) bench 34b on 575 ;;
    70b-tokens|70b) bench "$part" on 575 ;;
    *) echo "unknown part $part"; exit 2 ;;
esac
