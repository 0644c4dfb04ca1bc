"""The Megatron partition in one process: ``world`` shards run in threads whose all-reduce sums their partial
outputs, against the whole model, for base rows and adapters of ranks 4/8/16 (KV heads split, and replicated
when the ranks outnumber them)."""

from __future__ import annotations

import copy
import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.parallel.test_tensor_parallel import NAMES, PROMPTS, build, engine
from vlora.engine.scheduler import ScheduledSeq
from vlora.engine.sequence import Sequence
from vlora.parallel.messages import lora_of, passes
from vlora.parallel.partition import Shard, shard_adapter, shard_decoder
from vlora.sampling_params import SamplingParams


class ThreadSum:
    """An all-reduce among ``n`` threads: every rank gets the sum of the partial outputs, in rank order."""

    def __init__(self, n: int):
        self.barrier, self.parts = threading.Barrier(n, timeout=60), [None] * n

    def rank(self, r: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[r] = t
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()                       # all have read the parts before any is overwritten
            return t.copy_(total)
        return reduce


@pytest.fixture(scope="module", params=["llama", "qwen2"])   # qwen2: biases on q, k, v
def whole(tmp_path_factory, request, tiny_llama):
    path, adapters = tiny_llama if request.param == "llama" else \
        build(tmp_path_factory.mktemp(request.param), kv_heads=2, model_type=request.param)
    return engine(path, adapters, 1).engine


@pytest.mark.parametrize("world", [2, 4])           # 4 ranks > 2 KV heads: each KV head on two ranks
def test_shards_sum_to_the_whole_model(whole, world):
    eng = whole
    seqs = [Sequence(f"t{i}", list(p), SamplingParams(), None if a is None else eng.adapters.get(a), i)
            for i, (p, a) in enumerate(zip(PROMPTS, NAMES))]
    scheduled = []
    for seq in seqs:
        seq.blocks = eng.allocator.allocate(-(-seq.num_tokens // eng.block_size))
        scheduled.append(ScheduledSeq(seq, 0, seq.num_tokens))
    try:
        with torch.inference_mode():
            fb = eng.runner.prepare(eng.runner.order(tuple(scheduled)))
            want = eng.model.compute_logits(eng.model(fb, eng.runner.kv_cache))
            segs = tuple(tuple((s.start, s.end, s.adapter.name, s.scale) for s in p.segments)
                         for p in passes(fb.lora))
            total, out = ThreadSum(world), [None] * world

            def run(r: int) -> None:
                with torch.inference_mode():
                    cfg, shard = eng.model.cfg, Shard.of(eng.model.cfg, r, world)
                    model = copy.deepcopy(eng.model)
                    shard_decoder(model, shard, total.rank(r))
                    kv = torch.zeros(*eng.runner.kv_cache.shape[:-2], len(shard.kv_heads), cfg.head_dim)
                    parts = {n: shard_adapter(eng.adapters.get(n), cfg, shard) for n in RANK_NAMES}
                    out[r] = model(dataclasses.replace(fb, lora=lora_of(segs, parts.__getitem__)), kv)

            threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            got = eng.model.compute_logits(out[0])
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert all(torch.equal(out[0], o) for o in out[1:])          # every rank ends with the same hidden state
        assert (got.argmax(-1) == want.argmax(-1)).all()
    finally:
        for seq in seqs:
            eng.allocator.free(seq.blocks)


RANK_NAMES = ("a4", "a8", "a16")


def test_shards_cover_the_heads_and_refuse_uneven_splits():
    cfg = SimpleNamespace(num_heads=8, num_kv_heads=2, intermediate_size=64)
    shards = [Shard.of(cfg, r, 4) for r in range(4)]
    assert [list(s.heads) for s in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(s.kv_heads) for s in shards] == [[0], [0], [1], [1]]       # each rank: the group its heads read
    assert sorted(c for s in shards for c in s.mlp) == list(range(64))
    with pytest.raises(ValueError, match="attention heads"):
        Shard.of(cfg, 0, 3)
    with pytest.raises(ValueError, match="KV heads"):
        Shard.of(SimpleNamespace(num_heads=12, num_kv_heads=3, intermediate_size=64), 0, 2)
