#!/usr/bin/env bash
# The LoRA kernels on one GPU, one part per device call of under 10 minutes:
#   tune:    `vlora tune` of ranks $RANKS (default 128,256) for the Llama-2-7B groups, merged into a copy of the
#            shipped table: the decode buckets ($DECODE_TOKENS: 1,4,16,64) first, then prefill ($PREFILL_TOKENS:
#            256,1024,4096), each part within its time budget ($DECODE_S, $PREFILL_S seconds), segment buckets
#            $SEGMENTS (1,4,16,64); a merge keeps the keys other ranks' pairs read, and the table is saved after
#            every chunk of pairs
#   profile: where a batch-64 decode step's GPU time goes as the engine runs it (graph replays, side streams):
#            profile_step --replay-kernels with 32 adapters of ranks 8-64, then the base model
#   grid:    bench_lora_kernels' full grid (ranks 8-256) on the table $TABLE (default: the shipped one)
#   e2e:     bench_e2e (32 adapters and base, greedy and sampled, no tuning flags)
# VLORA_COMMIT names the commit measured where the machine's git does not know it.
# Usage: [RANKS=128,256] [DECODE_TOKENS=...] [PREFILL_TOKENS=...] [TABLE=path] benchmarks/gpu_kernels.sh OUT PART
# Writes OUT/PART/: tune: the merged table <gpu>.json and tune.log; profile: profile-{lora,base}.log;
# grid: lora_kernels-<gpu>.json/.png and grid.log; e2e: e2e-<gpu>.json and e2e.log.
set -uo pipefail
out=$(realpath -m "${1:?output dir}"); part=${2:?part: tune, profile, grid or e2e}
mkdir -p "$out/$part"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/gpu_env.sh"
gpu_env "$out/$part"
gpu=$(python3 -c "from vlora.kernels.tuning import gpu_name; print(gpu_name())")
case $part in
    tune)
        table=$out/tune/$gpu.json
        cp "vlora/kernels/configs/$gpu.json" "$table" 2>/dev/null || echo "no shipped table for $gpu: a new one"
        for step in "${DECODE_TOKENS:-1,4,16,64} ${DECODE_S:-200}" "${PREFILL_TOKENS:-256,1024,4096} ${PREFILL_S:-200}"; do
            set -- $step
            timeout $(( $2 + 60 )) python3 -c "import sys; from vlora.cli import main; sys.exit(main())" tune \
                --preset llama-7b --ranks "${RANKS:-128,256}" --tokens "$1" --segments "${SEGMENTS:-1,4,16,64}" --budget-s "$2" \
                --workers "${WORKERS:-14}" --output "$table" >> "$out/tune/tune.log" 2>&1
            echo "tune tokens $1 exit $?"; grep -E "tuned ->" "$out/tune/tune.log" | tail -1
        done ;;
    profile)
        for what in "lora 32" "base 0"; do
            set -- $what
            timeout 280 python3 benchmarks/profile_step.py --batch 64 --adapters "$2" --rank 8,16,32,64 --steps 10 \
                --no-cprofile --replay-kernels --top 30 > "$out/profile/profile-$1.log" 2>&1
            echo "profile $1 exit $?"; grep -E "engine step|GPU kernels over" "$out/profile/profile-$1.log"
        done ;;
    grid)
        timeout 560 python3 benchmarks/bench_lora_kernels.py ${TABLE:+--table "$TABLE"} --out "$out/grid" \
            > "$out/grid/grid.log" 2>&1
        echo "bench_lora_kernels exit $?"; grep -E "geomean|wrote|FAIL|Error" "$out/grid/grid.log" | tail -12 ;;
    e2e)
        timeout 330 python3 benchmarks/bench_e2e.py --skip-hf --sampling greedy,sampled --out "$out/e2e" \
            > "$out/e2e/e2e.log" 2>&1
        echo "bench_e2e exit $?"; grep -E "output tok/s|prefill|adapters add|wrote" "$out/e2e/e2e.log" | tail -10 ;;
    *) echo "unknown part $part"; exit 2 ;;
esac
