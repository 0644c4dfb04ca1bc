#!/usr/bin/env bash
# The engine-seams check on GPUs: the executor and the iteration queue change no token and cost no speed.
# One part per device call, each under 10 minutes:
#   speed  (one GPU, ~6 min): bench_e2e greedy and sampled (32 adapters, then base only), then `vlora serve`
#          over HTTP beside the offline engine (bench_serve; needs fastapi/uvicorn: carry them as wheels)
#   tests  (one GPU, ~6 min): every GPU-marked test but the tensor-parallel and server ones
#   tp     (two GPUs, ~3 min): the tensor-parallel GPU tests (NCCL and symm_mem decode graphs)
# Usage: benchmarks/gpu_seams.sh OUTDIR PART. Writes env.txt and the part's logs/JSON into OUTDIR; exits 1 if a
# step failed.
set -uo pipefail
out=${1:?output dir}; part=${2:?part: speed, tests or tp}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), 'x', torch.cuda.device_count())"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
} > "$out/env-$part.txt" 2>&1
cat "$out/env-$part.txt"
failed=()
case $part in
    speed)
        timeout 200 python3 benchmarks/bench_e2e.py --skip-hf --sampling greedy,sampled --out "$out" \
            > "$out/e2e.log" 2>&1
        rc=$?; echo "bench_e2e exit $rc"; ((rc)) && failed+=("bench_e2e ($rc)")
        grep -E "vlora (adapters|base): [0-9]+ output tok/s|decode forward B=|FAILED|Error" "$out/e2e.log" | tail -8
        sed -n '/sampled decoding/,$p' "$out/e2e.log"
        timeout 170 python3 benchmarks/bench_serve.py --sampling greedy,sampled --out "$out" > "$out/serve.log" 2>&1
        rc=$?; echo "bench_serve exit $rc"; ((rc)) && failed+=("bench_serve ($rc)")
        grep -E "healthy|FAILED|Error" "$out/serve.log" | tail -6
        sed -n '/per sampling setting/,$p' "$out/serve.log"
        ;;
    tests)
        timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 --ignore=tests/server \
            --ignore=tests/parallel tests > "$out/gpu-tests.log" 2>&1
        rc=$?; echo "GPU tests exit $rc"; ((rc)) && failed+=("tests ($rc)")
        tail -25 "$out/gpu-tests.log"
        ;;
    tp)
        timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=150 --durations=10 tests/parallel \
            > "$out/tp-tests.log" 2>&1
        rc=$?; echo "TP GPU tests exit $rc"; ((rc)) && failed+=("tp tests ($rc)")
        tail -25 "$out/tp-tests.log"
        ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
esac
((${#failed[@]})) && { echo "failed: ${failed[*]}"; exit 1; }
echo "all steps passed"
