#!/usr/bin/env bash
# The inference-mode policy decision's GPU runs (bench_policies_paired.py), sampled decoding, one part per device
# call of under 10 minutes. A part runs one invocation per GPU at once, each on a group of settings, then merges
# them into one report. Every policy of a setting runs on one GPU, so the paired differences never cross GPUs.
#   groups: 4+ GPUs: skew0.3 | skew0.5 | retrieval | skew0.7,skew0.9,video
#           2-3 GPUs: skew0.3,skew0.5,skew0.9 | retrieval,skew0.7,video (about 290 and 340 s of runs at 5 seeds
#           after a start of about 150 s);  1 GPU: those two, one after the other
#   (four invocations at once on nvidia-h200-x4 took about 500 s from start to their first run, against 150 s for
#   two on nvidia-h200-x2: on four GPUs the 5 seeds do not fit in one call)
#   plain: 8 adapters, merges in place; the first group also runs the spread check (as runs were made before and
#          as now)
#   copy:  8 adapters, --merged-copy (a merged adapter's copy kept in free pool pages)
#   a32:   32 adapters, merges in place, skewness 0.3-0.9 (groups skew0.3,skew0.5 | skew0.7,skew0.9 on 2+ GPUs)
#   e2e:   what a default of vlora would change on the uniform workload: bench_e2e (greedy and sampled) under
#          unmerged and under vlora on each of two GPUs, in opposite orders (9 min at most: STEP_S=270 a run),
#          then OUT/e2e-pairs.{md,json} (benchmarks/policy_pairs.py); FIRST=vlora starts GPU 0 with vlora and
#          numbers its runs from 1 (gpu1, gpu2): on one GPU, calls with FIRST unset and FIRST=vlora into one OUT
#          make the crossover
#   serve: the same with bench_serve over HTTP
#   (E2E_ARGS: more options for both scripts, e.g. a small model on the CPU)
# The GPUs are CUDA_VISIBLE_DEVICES's (all by default), so two parts can share a machine:
#   CUDA_VISIBLE_DEVICES=0,1 benchmarks/gpu_paired.sh OUT e2e & CUDA_VISIBLE_DEVICES=2,3 benchmarks/gpu_paired.sh OUT a32
# Usage: [DURATION=4] [SEEDS=5] [FIRST_SEED=0] [GROUP=i] [MAX_WALL_S=530] [VLORA_COMMIT=sha] [STEP_S=270] \
#            benchmarks/gpu_paired.sh OUT PART
# Writes OUT/PART/{report.md,results.json,paired.png}, each group's folder and log beside it; exits 1 on a failure.
# GROUP=i runs that group alone, on the first GPU, into OUT/PART-i (more seeds for an earlier run: FIRST_SEED;
# join the folders with bench_policies_paired.py --merge).
set -uo pipefail
out=${1:?output dir}; part=${2:?part: plain, copy, a32, e2e or serve}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
# Random adapters are written to /dev/shm where it has room: on a GPU host where writing 32 adapters of a 7B
# model to /tmp took 2-3 minutes, the files in memory take the disk out of start-up.
shm=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
[[ -z ${TMPDIR:-} && ${shm:-0} -ge 48 ]] && export TMPDIR=/dev/shm
echo "temporary files under ${TMPDIR:-/tmp} (/dev/shm: ${shm:-?} GiB free)"
# Processes run side by side share the host's cores: each takes its share as torch's thread count. Two processes
# of 32 threads each on 32 cores drew random adapters 13x slower than one alone (18 s against 1.4 s, H200 host,
# 2026-11-28; with 16 threads each: 1.9 s): the many mid-size tensor ops of writing and registering adapters
# each wait on a team of threads that the other process's team keeps off the cores.
share_cores() {   # processes at once
    local cores; cores=$(nproc)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / $1 > 0 ? cores / $1 : 1 ))}
}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
else visible=($(seq 0 $(( gpus > 0 ? gpus - 1 : 0 )))); fi
adapters=8; extra=(); spread=()
case $part in
    plain) spread=(--repeat 3 --spread-before) ;;
    copy)  extra=(--merged-copy) ;;
    a32)   adapters=32 ;;
    e2e|serve)
        # Each GPU runs both policies, one after the other, in opposite orders on alternate GPUs (GPU 0: unmerged
        # first), so neither policy has a GPU or a place in the order to itself.
        ngpu=$(( gpus > 1 ? 2 : 1 ))
        share_cores "$ngpu"
        run_policy() {   # policy, GPU slot
            local tag=$part-$1-gpu$2
            if [[ $part == e2e ]]; then
                timeout "${STEP_S:-270}" python3 benchmarks/bench_e2e.py --skip-hf --sampling greedy,sampled \
                    --policy "$1" ${E2E_ARGS:-} --out "$out/$tag" > "$out/$tag.log" 2>&1
            else
                timeout "${STEP_S:-270}" python3 benchmarks/bench_serve.py --skip-offline --sampling greedy,sampled \
                    --serve-args "--policy $1" ${E2E_ARGS:-} --out "$out/$tag" > "$out/$tag.log" 2>&1
            fi || echo "$tag exit $?"
        }
        first_swap=0; [[ ${FIRST:-unmerged} == vlora ]] && first_swap=1
        pids=()
        for ((n = 0; n < ngpu; n++)); do
            order=(unmerged vlora); (( (n + ${first_swap}) % 2 )) && order=(vlora unmerged)
            ( export CUDA_VISIBLE_DEVICES=${visible[$n]:-0}
              for pol in "${order[@]}"; do run_policy "$pol" $(( n + first_swap )); done ) & pids+=($!)
        done
        wait "${pids[@]}"
        python3 benchmarks/policy_pairs.py "$out" "$part"
        exit $? ;;
    *)     echo "unknown part $part (plain, copy, a32, e2e or serve)" >&2; exit 2 ;;
esac
if [[ $part == a32 ]]; then
    if ((gpus > 1)); then groups=("skew0.3,skew0.5" "skew0.7,skew0.9"); else groups=("skew0.3,skew0.5,skew0.7,skew0.9"); fi
elif ((gpus >= 4)); then groups=("skew0.3" "skew0.5" "retrieval" "skew0.7,skew0.9,video")
else groups=("skew0.3,skew0.5,skew0.9" "retrieval,skew0.7,video"); fi
common=(--adapters "$adapters" --duration "${DURATION:-4}" --seeds "${SEEDS:-5}" --first-seed "${FIRST_SEED:-0}"
        --sampling chat --max-wall-s "${MAX_WALL_S:-530}" "${extra[@]}" ${DRY:+--dry-run})
run_group() {   # index, GPU slot
    local i=$1 more=()
    ((i == 0 && ${FIRST_SEED:-0} == 0)) && more=("${spread[@]}")
    CUDA_VISIBLE_DEVICES=${visible[$2]:-0} python3 benchmarks/bench_policies_paired.py --out "$out/$part-$i" \
        --settings "${groups[$i]}" "${common[@]}" "${more[@]}" > "$out/$part-$i.log" 2>&1
}
failed=0
if [[ -n ${GROUP:-} ]]; then
    run_group "$GROUP" 0 || failed=1
    grep -v Warning "$out/$part-$GROUP.log" | tail -4
    exit $failed
fi
dirs=()
if ((gpus >= ${#groups[@]})); then
    share_cores ${#groups[@]}
    pids=()
    for i in "${!groups[@]}"; do run_group "$i" "$i" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p" || failed=1; done
else
    for i in "${!groups[@]}"; do run_group "$i" 0 || failed=1; done
fi
for i in "${!groups[@]}"; do echo "== group $i"; grep -v Warning "$out/$part-$i.log" | tail -4; dirs+=("$out/$part-$i"); done
python3 benchmarks/bench_policies_paired.py --merge "${dirs[@]}" --out "$out/$part" || failed=1
sed -n '/against each baseline/,$p' "$out/$part/report.md" 2>/dev/null
exit $failed
