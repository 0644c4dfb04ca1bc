# One training step (one thread) with the batch's shared leading tokens run once, and with every row running
# them (run from the repository root: python THIS DIR/spec.json, DIR written by examples/adapters/make_tasks.py).
# It reaches into the trainer.
import sys, time
sys.path.insert(0, '.')
import torch
from vlora.adapters.sources import load_sources
from vlora.adapters.trainer import LoraTrainer, TrainConfig
torch.set_num_threads(1)
tr = LoraTrainer(TrainConfig(threads=1), progress=False)
srcs = {s.task: s for s in load_sources(sys.argv[1])}
st = tr.init(0); tr._set(st.lora)
batches = {"four tasks": [tr._encode(srcs[t], e) for t in ["spam", "parity", "urgency", "larger"] for e in srcs[t].train[:4]],
           "one task": [tr._encode(srcs["emotion"], e) for e in srcs["emotion"].train[:16]]}
def step(batch):
    loss = tr._loss(batch, None); loss.backward(); tr.model.zero_grad()
for name, batch in batches.items():
    tr._layer_inputs(batch)
    for share in (True, False, True, False):
        tr.share_prefix = share
        step(batch)
        c = time.process_time()
        for _ in range(4): step(batch)
        print(f"{name}: shared part run once={share}: {(time.process_time() - c) / 4:.3f} s of CPU a step", flush=True)
