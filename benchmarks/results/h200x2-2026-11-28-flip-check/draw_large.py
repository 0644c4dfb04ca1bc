import torch,time
g=torch.Generator().manual_seed(0)
t=time.time()
for k in range(6):
    x=(torch.randn(64,2_000_000,generator=g)*0.01).to(torch.bfloat16)
    y=torch.zeros(64*2_000_000, dtype=torch.bfloat16); y.copy_(x.t().contiguous().view(-1))
print(torch.get_num_threads(), round(time.time()-t,1), flush=True)
