#!/usr/bin/env bash
# Runs GPU benchmark parts one after another in the background, so that the work goes on between device calls
# (a machine stays held while calls follow each other), and each call takes back a snapshot of what finished.
#   benchmarks/gpu_queue.sh start OUTDIR SECONDS PART...   start the queue, then wait as `wait` does
#   benchmarks/gpu_queue.sh wait  OUTDIR SECONDS           wait until the queue is done or SECONDS pass,
#                                                          then pack every part's results into OUTDIR/queue.tar.gz
# PART: tests (env TESTS_K, TESTS_PATH: a subset) | merge | decode | e2e | e2e-overlap |
#       lora-kernels (with this queue's tune-grid table, if it ran first) | tune-grid |
#       vision | memory-throughput | memory-dynamic | pressure-<session rate> (env KV_GB, HOST_KV_GB) |
#       policies-<skew-low|skew-high|retrieval|video>.
# Each part writes into /tmp/vlora-queue/<part>/ and its log beside it.
set -uo pipefail
cmd=${1:?start or wait}; out=${2:?output dir}; secs=${3:?seconds}; shift 3
q=/tmp/vlora-queue
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

run_part() {   # one part, its results in $q/$1
    local part=$1 dir=$q/$1
    mkdir -p "$dir"
    case $part in
        tests)   find tests -name __pycache__ -prune -exec rm -rf {} +     # stale ones broke collection once
                 timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/server \
                     ${TESTS_K:+-k "$TESTS_K"} ${TESTS_PATH:-tests} ;;
        merge)   timeout 480 python3 benchmarks/bench_merge.py --sweep --out "$dir" ;;
        decode)  timeout 900 bash benchmarks/gpu_decode.sh "$dir" --no-tests ;;
        e2e)     timeout 600 python3 benchmarks/bench_e2e.py --skip-peft --out "$dir" ;;
        e2e-overlap) for m in off shrink full; do mkdir -p "$dir/$m"
                     timeout 300 python3 benchmarks/bench_e2e.py --skip-hf --lora-overlap $m --out "$dir/$m"
                     done ;;
        lora-kernels) tuned=$(ls $q/tune-grid/*.json 2>/dev/null | head -1)    # this queue's tune-grid, if any
                      timeout 500 python3 benchmarks/bench_lora_kernels.py ${tuned:+--table "$tuned"} --out "$dir" ;;
        tune-grid) gpu=$(python3 -c "from vlora.kernels.tuning import gpu_name; print(gpu_name())")
                   cp "vlora/kernels/configs/$gpu.json" "$dir/$gpu.json"
                   timeout 560 python3 -m vlora.cli tune --preset bench-grid --tokens 1,256,1024,4096,8192 \
                       --ranks 16,64 --merge --budget-s 480 --output "$dir/$gpu.json" 2>&1 | tail -3
                   cp "$dir/$gpu.json" "vlora/kernels/configs/$gpu.json" ;;
        vision)  timeout 600 python3 benchmarks/bench_vision.py --out "$dir" ;;
        memory-*) timeout 600 bash benchmarks/gpu_memory.sh "$dir" "${part#memory-}" ;;
        pressure-*) timeout 560 python3 benchmarks/bench_memory.py --pressure --parts dynamic \
                        --session-rate "${part#pressure-}" --policies "${POLICIES:-fastlibra,lru-fixed}" \
                        ${HOST_KV_GB:+--host-kv-gb $HOST_KV_GB} ${KV_GB:+--kv-gb $KV_GB} --out "$dir" 2>&1 \
                        | grep -v Warning ;;
        policies-*) timeout 600 bash benchmarks/gpu_policies.sh "$dir" "${part#policies-}" ;;
        *) echo "unknown part $part" >&2; return 2 ;;
    esac
}

if [[ $cmd == start ]]; then
    rm -rf "$q"; mkdir -p "$q"
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
        > "$q/device.txt" 2>&1
    printf '%s\n' "$@" > "$q/parts"
    setsid nohup bash -c '
        for part in $(cat '"$q"'/parts); do
            start=$(date +%s)
            bash '"$0"' _part - 0 "$part" > '"$q"'/$part.log 2>&1
            echo "$part rc=$? $(( $(date +%s) - start ))s" >> '"$q"'/done
        done
        touch '"$q"'/finished' > /dev/null 2>&1 < /dev/null &
elif [[ $cmd == _part ]]; then
    run_part "$1"; exit $?
fi

deadline=$(( $(date +%s) + secs ))
while [[ ! -e $q/finished && $(date +%s) -lt $deadline ]]; do sleep 5; done
cat "$q/device.txt" "$q/done" 2>/dev/null
for log in "$q"/*.log; do [[ -e $log ]] && { echo "== $log"; tail -c 1500 "$log"; }; done
tar -czf "$out/queue.tar.gz" -C /tmp vlora-queue
