# One training step of 16 examples of four of the nine tasks at 1 and 2 CPU threads (run from the repository root:
# python THIS DIR/spec.json, DIR written by examples/adapters/make_tasks.py). It reaches into the trainer.
import sys, time, os
sys.path.insert(0, '.')
import torch
from vlora.adapters.sources import load_sources
from vlora.adapters.trainer import LoraTrainer, TrainConfig
tr = LoraTrainer(TrainConfig(threads=1), progress=False)
srcs = {s.task: s for s in load_sources(sys.argv[1])}
st = tr.init(0); tr._set(st.lora)
mixed = [tr._encode(srcs[t], e) for t in ["spam", "parity", "urgency", "larger"] for e in srcs[t].train[:4]]
tr._layer_inputs(mixed)
def step(batch):
    loss = tr._loss(batch, None); loss.backward(); tr.model.zero_grad()
for th in (1, 2, 1, 2):
    torch.set_num_threads(th)
    step(mixed)
    t = time.perf_counter(); c = time.process_time()
    for _ in range(4): step(mixed)
    print(th, f"{(time.perf_counter()-t)/4:.3f} s/step wall {(time.process_time()-c)/4:.3f} cpu", flush=True)
