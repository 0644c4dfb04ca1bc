"""Where a decode step's time goes: host functions (cProfile over engine steps) and GPU kernels (torch.profiler
over one eager forward), for a random-weight model with or without adapters.

    python benchmarks/profile_step.py --batch 64 --adapters 32          # GPU, Llama-2-7B shapes
    python benchmarks/profile_step.py --model random:tiny-llama --device cpu --batch 8 --adapters 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlora import LLM, SamplingParams  # noqa: E402
from vlora.lora.adapter import ModelShape  # noqa: E402
from vlora.lora.random_adapter import write_random_adapter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=0)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-gb", type=float, default=32.0)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=args.batch, kv_cache_memory_gb=args.kv_gb,
              max_num_batched_tokens=8192, max_model_len=args.input_len + args.steps + 64, check_base_model=False)
    eng = llm.engine
    cfg = eng.model.cfg
    ins, outs = cfg.lora_in_out()
    shape = ModelShape(cfg.name, cfg.num_layers, ins, outs)
    tmp = tempfile.mkdtemp()
    names = [None] * args.batch
    for j in range(args.adapters):
        llm.register_adapter(f"a{j}", write_random_adapter(Path(tmp) / f"a{j}", shape, args.rank, j, std=0.01))
    if args.adapters:
        names = [f"a{i % args.adapters}" for i in range(args.batch)]
    prompts = torch.randint(3, cfg.vocab_size, (args.batch, args.input_len)).tolist()
    sp = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
    for p, a in zip(prompts, names):
        eng.add_request(p, a, sp)
    while any(s.num_computed < len(s.prompt_token_ids) for s in eng.scheduler.unfinished()):
        eng.step()
    for _ in range(3):                        # graphs captured, caches warm
        eng.step()
    cuda = eng.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(args.steps):
        eng.step()
    pr.disable()
    ms = 1e3 * (time.perf_counter() - t0) / args.steps
    print(f"engine step, batch {args.batch}, {args.adapters} adapters: {ms:.2f} ms")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue())
    # GPU kernels of one eager decode forward (no graph) of the same batch
    runner = eng.runner
    sched = eng.scheduler.schedule()
    ordered = runner.order(sched.scheduled)
    fb = runner.prepare(ordered)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode():
        for _ in range(2):
            eng.model(fb, runner.kv_cache)
        with profile(activities=acts) as prof:
            eng.model(fb, runner.kv_cache)
            if cuda:
                torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
