import torch, time, sys
# the draw of write_random_adapter (7B shape, rank 64), CPU generator, many mid-size ops
h, i = 4096, 11008
ins = [h, h, h, h, h, h, i]; outs = [h, h, h, h, i, i, h]
g = torch.Generator().manual_seed(0)
if len(sys.argv) > 1: import torch.cuda; torch.zeros(1, device="cuda")   # with a CUDA context, as the bench
t = time.time()
for a in range(2):
    for layer in range(32):
        for fi, fo in zip(ins, outs):
            x = (torch.randn(64, fi, generator=g) * 0.01).to(torch.bfloat16)
            y = (torch.randn(fo, 64, generator=g) * 0.01).to(torch.bfloat16)
print(torch.get_num_threads(), "2 adapters drawn in", round(time.time() - t, 2), "s", flush=True)
