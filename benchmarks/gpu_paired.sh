#!/usr/bin/env bash
# The inference-mode policy decision's GPU runs (bench_policies_paired.py), sampled decoding, one part per device
# call of under 10 minutes. Each part runs two invocations at once, one per GPU, that split the settings
# (skew 0.3, 0.5 and retrieval on GPU 0; skew 0.7, 0.9 and video on GPU 1), then merges them into one report.
# Every policy of a setting runs on the same GPU, so the paired differences never cross GPUs.
#   plain: merges in place; GPU 0 also runs the spread check, as runs were made before and as now
#   copy:  --merged-copy (a merged adapter's copy kept in free pool pages)
#   e2e:   what a default of vlora would change on the uniform workload: bench_e2e (greedy and sampled), then
#          bench_serve over HTTP, under unmerged on GPU 0 and vlora on GPU 1 at once (8 min at most: the timeouts)
# On one GPU the two halves run one after the other (twice as long).
# Usage: [ADAPTERS=8] [DURATION=4] [SEEDS=5] [FIRST_SEED=0] [HALF=0|1] [MAX_WALL_S=530] [VLORA_COMMIT=sha] \
#            benchmarks/gpu_paired.sh OUT PART
# Writes OUT/PART/{report.md,results.json,paired.png}, each half's folder and log beside it; exits 1 on a failure.
# HALF=i runs that half alone, on GPU 0, into OUT/PART-i (more seeds for an earlier run: FIRST_SEED; join the
# folders with bench_policies_paired.py --merge).
set -uo pipefail
out=${1:?output dir}; part=${2:?part: plain, copy or e2e}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
case $part in
    plain) extra=(); spread=(--repeat 3 --spread-before) ;;
    copy)  extra=(--merged-copy); spread=() ;;
    e2e)
        pids=()
        for i in 0 1; do
            pol=$( ((i)) && echo vlora || echo unmerged )
            ( export CUDA_VISIBLE_DEVICES=$i
              timeout 280 python3 benchmarks/bench_e2e.py --skip-hf --sampling greedy,sampled --policy "$pol" \
                  --out "$out/e2e-$pol" > "$out/e2e-$pol.log" 2>&1 || echo "bench_e2e $pol exit $?"
              timeout 200 python3 benchmarks/bench_serve.py --skip-offline --sampling greedy,sampled \
                  --serve-args "--policy $pol" --out "$out/serve-$pol" > "$out/serve-$pol.log" 2>&1 \
                  || echo "bench_serve $pol exit $?" ) & pids+=($!)
        done
        wait "${pids[@]}"
        for pol in unmerged vlora; do
            echo "== $pol"; grep -E "output tok/s|sampled|greedy" "$out/e2e-$pol.log" | tail -8
            grep -E "tok/s|Error" "$out/serve-$pol.log" | tail -4
        done
        exit 0 ;;
    *)     echo "unknown part $part (plain, copy or e2e)" >&2; exit 2 ;;
esac
common=(--adapters "${ADAPTERS:-8}" --duration "${DURATION:-4}" --seeds "${SEEDS:-5}" --first-seed "${FIRST_SEED:-0}"
        --sampling chat
        --max-wall-s "${MAX_WALL_S:-530}" "${extra[@]}" ${DRY:+--dry-run})
halves=("skew0.3,skew0.5,retrieval" "skew0.7,skew0.9,video")
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
run_half() {   # index
    local i=$1 dev=$(( gpus > 1 ? $1 : 0 ))
    local more=(); ((i == 0 && ${FIRST_SEED:-0} == 0)) && more=("${spread[@]}")
    CUDA_VISIBLE_DEVICES=$dev python3 benchmarks/bench_policies_paired.py --out "$out/$part-$i" \
        --settings "${halves[$i]}" "${common[@]}" "${more[@]}" > "$out/$part-$i.log" 2>&1
}
failed=0
if [[ -n ${HALF:-} ]]; then
    gpus=1; run_half "$HALF" || failed=1
    grep -v Warning "$out/$part-$HALF.log" | tail -4
    exit $failed
fi
if ((gpus > 1)); then
    run_half 0 & p0=$!
    run_half 1 & p1=$!
    wait $p0 || failed=1
    wait $p1 || failed=1
else
    run_half 0 || failed=1
    run_half 1 || failed=1
fi
for i in 0 1; do echo "== half $i"; grep -v Warning "$out/$part-$i.log" | tail -4; done
python3 benchmarks/bench_policies_paired.py --merge "$out/$part-0" "$out/$part-1" --out "$out/$part" || failed=1
sed -n '/against each baseline/,$p' "$out/$part/report.md" 2>/dev/null
exit $failed
