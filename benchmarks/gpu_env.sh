# Sourced by the benchmarks/gpu_*.sh scripts: `gpu_env DIR [NOTE]` writes DIR/env.txt (the commit measured, torch
# and Triton, the GPUs, their links; NOTE first if given) and prints it. VLORA_COMMIT names the commit where the
# machine's git does not know it.
gpu_env() {
    {
        [[ -n ${2:-} ]] && echo "$2"
        echo "commit ${VLORA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'x', torch.cuda.is_available() and torch.cuda.get_device_name())"
        nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null
        nvidia-smi topo -m 2>/dev/null | head -4
    } > "$1/env.txt" 2>&1
    cat "$1/env.txt"
}
