#!/usr/bin/env bash
# Serving under arrivals on one GPU (the Traffic workload of BENCHMARKS.md over HTTP, `vlora serve` defaults,
# sampled), one part per device call of under 10 minutes:
#   a100:  100 adapters (all registered at start; --distinct 25 weight sets), rates $RATES, $DURATION s each
#   a1000: the worker's read of one adapter (bench_adapter_read), then 1,000 adapters loaded on first request
#          from --adapter-dir (--distinct 100, at most 200 loaded)
#   e2e:   bench_e2e (32 adapters and base, greedy and sampled, no tuning flags), then the mixed-graph GPU tests
#   serve: bench_serve (bench_e2e's workload over HTTP against the offline engine, greedy and sampled, each figure
#          the median of 3 runs): the engine in a process of its own (the default), then on a thread of the
#          server's process (--no-engine-process), on the same requests
#   tests: the GPU tests (-m gpu, two at a time; tests/parallel needs two GPUs and is left out)
# CODE=DIR runs the benchmark of another source tree (e.g. a copy of an earlier commit, for a before/after pair);
# VLORA_COMMIT names the commit measured where the machine's git does not know it. TRAFFIC_ARGS adds options
# (a small model on the CPU: --model random:tiny-llama --device cpu ...).
# Usage: [CODE=DIR] [RATES=2,4,8,12,16] [DURATION=30] [VLORA_COMMIT=sha] benchmarks/gpu_traffic.sh OUT PART
# Writes OUT/PART/{traffic-<gpu>.json,.md,.png, traffic.log} (e2e: OUT/e2e/{e2e-<gpu>.json, e2e.log, tests.log};
# serve: OUT/serve/{serve-<gpu>.json, serve.log}; tests: OUT/tests/tests.log).
set -uo pipefail
out=$(realpath -m "${1:?output dir}"); part=${2:?part: a100, a1000, e2e, serve or tests}
code=$(realpath "${CODE:-.}")
rates=${RATES:-2,4,8,12,16}; duration=${DURATION:-30}
mkdir -p "$out/$part"
# random adapters go to /dev/shm where it has room: the disk stays out of start-up
shm=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
[[ -z ${TMPDIR:-} && ${shm:-0} -ge 48 ]] && export TMPDIR=/dev/shm
cd "$code" || exit 1
export PYTHONPATH=$code${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/gpu_env.sh"
gpu_env "$out/$part" "code: $code"
traffic() {
    # shellcheck disable=SC2086
    timeout 560 python3 benchmarks/bench_traffic.py --rates "$rates" --duration "$duration" "$@" ${TRAFFIC_ARGS:-} \
        --out "$out/$part" > "$out/$part/traffic.log" 2>&1
    echo "bench_traffic exit $?"; grep -E "healthy|rate .*:|SLO rate" "$out/$part/traffic.log" | tail -12
}
case $part in
    a100)  traffic --adapters 100 --distinct 25 ;;
    a1000)
        # the worker's read of one adapter on this host first (rank 16 and 64, one core, as the worker runs)
        timeout 120 python3 benchmarks/bench_adapter_read.py --label host --out "$out/$part" > "$out/$part/read.log" 2>&1
        echo "bench_adapter_read exit $?"; cat "$out/$part/read.log"
        traffic --adapters 1000 --distinct 100 --on-demand --max-loaded-adapters 200 ;;
    e2e)
        # shellcheck disable=SC2086
        timeout 300 python3 benchmarks/bench_e2e.py --skip-hf --sampling greedy,sampled ${E2E_ARGS:-} \
            --out "$out/$part" > "$out/$part/e2e.log" 2>&1
        echo "bench_e2e exit $?"; grep -E "output tok/s|prefill|wrote" "$out/$part/e2e.log" | tail -8
        timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" ${TEST_ARGS:--m gpu} \
            tests/models/test_fast_path.py > "$out/$part/tests.log" 2>&1
        echo "tests exit $?"; tail -3 "$out/$part/tests.log" ;;
    serve)
        timeout 570 python3 benchmarks/bench_serve.py --sampling greedy,sampled --repeat 3 \
            --variants "process=;thread=--no-engine-process" --out "$out/$part" > "$out/$part/serve.log" 2>&1
        echo "bench_serve exit $?"; grep -E "server '|->|HTTP / offline|healthy|wrote|Error" "$out/$part/serve.log" | tail -30 ;;
    tests)
        # shellcheck disable=SC2086
        timeout 560 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests --ignore=tests/parallel -n 2 \
            --continue-on-collection-errors ${TEST_ARGS:-} > "$out/$part/tests.log" 2>&1
        echo "tests exit $?"; grep -E "passed|failed|FAILED|ERROR" "$out/$part/tests.log" | tail -15 ;;
    *) echo "unknown part $part"; exit 2 ;;
esac
