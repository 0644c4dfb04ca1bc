"""Where a first merge's time goes: torch.profiler over merge_ of a random Llama-2-7B-shaped model, rank 64."""
import sys
import tempfile
from pathlib import Path

import torch

from vlora.lora.adapter import ModelShape
from vlora.lora.merge import group_widths, merge_, stage_factors, unmerge_
from vlora.lora.random_adapter import write_random_adapter
from vlora.lora.registry import AdapterRegistry

h, inter, L, r = 4096, 11008, 32, 64
ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": h, "gate_proj": h, "up_proj": h, "down_proj": inter}
outs = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": h, "gate_proj": inter, "up_proj": inter, "down_proj": h}
widths = group_widths(h, h, h, inter)
shape = ModelShape("bench", L, ins, outs)
reg = AdapterRegistry(shape, 128, torch.bfloat16, torch.device("cpu"), check_base_model=False, kernel="torch")
with tempfile.TemporaryDirectory() as tmp:
    adapter = reg.register("a", write_random_adapter(Path(tmp) / "a", shape, r, seed=0, std=0.01))
g = torch.Generator(device="cuda").manual_seed(0)
src = {"qkv": "q_proj", "o": "o_proj", "gate_up": "gate_proj", "down": "down_proj"}
weights = {grp: (torch.randn(L, sum(wd), ins[src[grp]], generator=g, device="cuda") * 0.02).to(torch.bfloat16)
           for grp, wd in widths.items()}
staged = stage_factors(adapter, weights, widths)
for _ in range(2):
    rec = merge_(weights, widths, adapter, staged=staged)
    unmerge_(weights, widths, rec)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    rec = merge_(weights, widths, adapter, staged=staged)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
if ev:
    t0 = min(e.time_range.start for e in ev)
    t1 = max(e.time_range.end for e in ev)
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    print(f"GPU span {(t1 - t0) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms")
unmerge_(weights, widths, rec)
torch.cuda.synchronize()
# the timeline: every GPU kernel (start, duration) and the host's calls, from the merge's start
print("\nGPU timeline (ms from the first kernel):")
t0 = min(e.time_range.start for e in ev)
for e in sorted(ev, key=lambda e: e.time_range.start):
    if e.time_range.end - e.time_range.start > 20:
        print(f"  {(e.time_range.start - t0) / 1e3:8.3f} +{(e.time_range.end - e.time_range.start) / 1e3:7.3f}  {e.name[:70]}")
# the kernels alone, queued back to back, no records made
from vlora.kernels import merge as kernels  # noqa: E402
import time  # noqa: E402
for rep in range(3):
    torch.cuda.synchronize()
    t = time.perf_counter()
    launched = []
    for grp, w in weights.items():
        row0 = 0
        for j, width in enumerate(widths[grp]):
            a, b = staged[(grp, j)]
            launched.append(kernels.launch_merge_(w, row0, a, b, adapter.scaling))
            row0 += width
    torch.cuda.synchronize()
    t_k = time.perf_counter() - t
    t = time.perf_counter()
    recs = [kernels.finish_merge(m) for m in launched]  # noqa: F841
    torch.cuda.synchronize()
    t_f = time.perf_counter() - t
    print(f"kernels alone {t_k * 1e3:.2f} ms, then the records made one after another {t_f * 1e3:.2f} ms")
    for m, sr in zip(launched, recs):
        kernels.unmerge_slice_(m.w, m.row0, m.a, m.b, m.scale, sr)
