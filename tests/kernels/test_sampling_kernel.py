"""Philox4x32-10 and the Gumbel-max sampling kernel: Random123's known answers, and the Triton kernel
(``kernels/sampling.py``; the interpreter on the CPU) against its torch twin (``kernels/philox.py``) token for
token. The interpreter is slow: a few rows each."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from vlora.kernels import philox
from vlora.kernels import sampling

M32 = 0xFFFFFFFF
DEV = "cuda" if torch.cuda.is_available() else "cpu"     # the kernel compiled on a GPU, else the interpreter


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread (small tensors; the thread pool's barriers cost more than they gain on shared cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _i64(u: int) -> int:
    """A 64-bit key word pair (high << 32 | low) as the int64 that holds the same bits."""
    return u - 2**64 if u >= 2**63 else u


# Random123's kat_vectors for philox4x32_10: (counter c0..c3, key k0, k1) -> (out0..out3)
KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KATS, ids=["zeros", "ones", "pi"])
def test_philox_known_answers_torch(counter, key, want):
    k = torch.tensor(_i64(key[1] << 32 | key[0]), dtype=torch.int64)
    c = [torch.tensor(v, dtype=torch.int64) for v in counter]
    got = philox.philox4x32(k, *c)
    assert tuple(int(v) for v in got) == want, [hex(int(v)) for v in got]
    # broadcast over a batch (the layout the sampler uses), the same answer in every lane
    got = philox.philox4x32(k.expand(3)[:, None], c[0].expand(3, 2), c[1].expand(3, 2), c[2], c[3])
    assert all(torch.equal(g, torch.full((3, 2), w)) for g, w in zip(got, want))


@triton.jit
def _philox_kat_kernel(seed_ptr, c_ptr, out_ptr):
    seed = tl.load(seed_ptr)
    offs = tl.arange(0, 1)
    c0 = tl.load(c_ptr + offs).to(tl.uint32)
    c1 = tl.load(c_ptr + 1 + offs).to(tl.uint32)
    c2 = tl.load(c_ptr + 2 + offs).to(tl.uint32)
    c3 = tl.load(c_ptr + 3 + offs).to(tl.uint32)
    a, b, c, d = tl.philox(seed, c0, c1, c2, c3)
    tl.store(out_ptr + offs, a.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + 1 + offs, b.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + 2 + offs, c.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + 3 + offs, d.to(tl.int64) & 0xFFFFFFFF)


def _triton_philox(counter, key, device):
    seed = torch.tensor([_i64(key[1] << 32 | key[0])], dtype=torch.int64, device=device)
    c = torch.tensor(counter, dtype=torch.int64, device=device)
    out = torch.zeros(4, dtype=torch.int64, device=device)
    _philox_kat_kernel[(1,)](seed, c, out)
    return tuple(int(v) & M32 for v in out.cpu())


@pytest.mark.parametrize("counter,key,want", KATS, ids=["zeros", "ones", "pi"])
def test_philox_known_answers_triton(counter, key, want):
    """The kernel's ``tl.philox`` (an int64 seed split into its low and high words) gives Random123's answers."""
    got = _triton_philox(counter, key, DEV)
    assert got == want, [hex(v) for v in got]


# the 24-bit values u is made of: the lowest and the highest 2**16 of them (the interesting ends)
_K24 = torch.cat([torch.arange(2**16), torch.arange(2**24 - 2**16, 2**24)])


def test_uniforms_lie_strictly_inside_zero_one():
    """Every 32-bit pattern maps to u in (0, 1): u = 1 would make the noise -log(-log(u)) = +inf."""
    for low in (0, 0xFF):                                  # the low bits are dropped
        u = philox.uniform(_K24 << 8 | low)
        assert u.dtype == torch.float32
        assert (u > 0).all() and (u < 1).all(), \
            f"u = {u.max().item()!r} at bits {hex(int(_K24[u.argmax()] << 8 | low))}"
    noise = philox.gumbel(torch.tensor([0]), torch.tensor([0]), torch.arange(4096))
    assert torch.isfinite(noise).all()


def test_uniforms_are_centred_in_their_interval():
    """The module's promise: u = ((bits >> 9) + 0.5) / 2**23 exactly in float32, for the extremes and a sweep."""
    k23 = torch.cat([torch.arange(0, 1 << 16), torch.arange((1 << 23) - (1 << 16), 1 << 23)])
    for low in (0, 0x1FF):                                 # the low 9 bits are dropped
        u = philox.uniform(k23 << 9 | low)
        exact = (k23.double() + 0.5) / 2**23
        bad = (u.double() != exact).nonzero()[:, 0]
        assert bad.numel() == 0, (f"{bad.numel()} of the {len(k23)} uniforms checked are not the centred value; "
                                  f"the first at bits >> 9 = {hex(int(k23[bad[0]]))}: {u[bad[0]].item()!r} != "
                                  f"{exact[bad[0]].item()!r}")
    assert philox.uniform(torch.tensor([0xFFFFFFFF])).item() == 1 - 2**-24


# ------------------------------------------------------------ the Triton kernel against the torch twin

def _case(R, K, *, ids_vocab=None, masked=0.0, seed=0, device=DEV, seeds=None, positions=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g) * 2
    if masked:
        x[torch.rand(R, K, generator=g) < masked] = float("-inf")
    ids = None
    if ids_vocab is not None:                   # candidates: sorted values, their vocabulary ids
        x, order = x.sort(dim=-1, descending=True)
        ids = torch.stack([torch.randperm(ids_vocab, generator=g)[:K] for _ in range(R)])
        ids = ids.gather(1, order).contiguous()
    if seeds is None:
        seeds = torch.randint(0, 2**62, (R,), generator=g)
    if positions is None:
        positions = torch.randint(0, 2**31, (R,), generator=g)
    to = lambda t: None if t is None else t.to(device).contiguous()    # noqa: E731
    return to(x), to(seeds), to(positions), to(ids)


def _both(x, seeds, positions, ids):
    got = sampling.gumbel_argmax(x, seeds, positions, ids)
    want = philox.gumbel_argmax(x, seeds, positions, ids)
    return got.cpu(), want.cpu()


def test_kernel_matches_twin_full_rows_several_blocks():
    R, K = 3, 2 * sampling.BLOCK + 700                 # three blocks, the last one partial
    x, seeds, positions, _ = _case(R, K, seed=1)
    # the best of a row in different blocks: push a strong logit into block 1 of row 1 and block 2 of row 2
    x[1, sampling.BLOCK + 5] += 40
    x[2, 2 * sampling.BLOCK + 699] += 40
    got, want = _both(x, seeds, positions, None)
    assert got.tolist() == want.tolist()
    assert want[1] == sampling.BLOCK + 5 and want[2] == K - 1


def test_kernel_matches_twin_on_candidates_with_ids():
    x, seeds, positions, ids = _case(3, 2500, ids_vocab=50_000, seed=2)
    got, want = _both(x, seeds, positions, ids)
    assert got.tolist() == want.tolist()
    assert all(int(t) in ids[r].tolist() for r, t in enumerate(got.tolist()))
    # a small top-k: a few candidates, the rest of the block masked
    x, seeds, positions, ids = _case(4, 7, ids_vocab=32_000, seed=3)
    got, want = _both(x, seeds, positions, ids)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("masked", [0.5, 0.999])
def test_kernel_matches_twin_with_minus_inf_entries(masked):
    x, seeds, positions, ids = _case(3, sampling.BLOCK + 300, masked=masked, seed=4)
    x[2] = float("-inf")
    x[2, sampling.BLOCK + 10] = -50.0                  # a row whose only kept token sits in the second block
    got, want = _both(x, seeds, positions, ids)
    assert got.tolist() == want.tolist()
    assert want[2] == sampling.BLOCK + 10
    assert torch.isfinite(x.cpu()[torch.arange(3), want]).all()   # only kept tokens are drawn


def test_kernel_matches_twin_large_seeds_and_positions():
    R, K = 6, 600
    seeds = torch.tensor([2**62, 2**62 + 12345, 2**63 - 1, 2**63 - 2, 0, 2**32 + 1])
    positions = torch.tensor([2**31, 2**31 + 7, 2**32 - 1, 0, 2**31 - 1, 3_000_000_000])
    x, seeds, positions, _ = _case(R, K, seed=5, seeds=seeds, positions=positions)
    got, want = _both(x, seeds, positions, None)
    assert got.tolist() == want.tolist()
    # with ids as well (the candidates' path)
    x, seeds, positions, ids = _case(R, 40, ids_vocab=150_000, seed=6, seeds=seeds, positions=positions)
    got, want = _both(x, seeds, positions, ids)
    assert got.tolist() == want.tolist()


def test_kernel_and_twin_seeds_and_positions_matter():
    """Neighbouring seeds / positions (high words of the seed too) draw different tokens from flat logits."""
    K = 256
    x = torch.zeros(8, K, device=DEV)
    base = 2**62 + 3
    seeds = torch.tensor([base, base + 1, base + 2**32, base + 2**33, base, base, base, base], device=DEV)
    positions = torch.tensor([9, 9, 9, 9, 10, 11, 2**31 + 9, 2**31 + 10], device=DEV)
    got, want = _both(x, seeds, positions, None)
    assert got.tolist() == want.tolist()
    assert len(set(want.tolist())) >= 6


# The (seed, position, token) whose Philox bits are 0xffffff3c (bits >> 8 = 2**24 - 1): see
# tests/engine/test_sampler.py. Its noise must be finite: a -inf (dropped) token must lose.
INF_SEED, INF_POSITION, INF_TOKEN = 2548809334802615, 5, 21


@pytest.mark.parametrize("impl", ["twin", "kernel"])
def test_a_dropped_token_never_wins_even_at_the_largest_uniform(impl):
    """Row 0: the token is dropped (-inf); row 1: it is kept with a logit of -100 (probability ~e**-100). Neither
    may draw it: the right token is the argmax of x + noise over the other tokens (all finite)."""
    K = 24
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, K, generator=g)
    x[0, INF_TOKEN], x[1, INF_TOKEN] = float("-inf"), -100.0
    seeds = torch.tensor([INF_SEED, INF_SEED])
    positions = torch.tensor([INF_POSITION, INF_POSITION])
    fn = philox.gumbel_argmax if impl == "twin" else sampling.gumbel_argmax
    got = fn(x.to(DEV), seeds.to(DEV), positions.to(DEV)).tolist()
    noise = philox.gumbel(seeds, positions, torch.arange(K))
    others = torch.arange(K) != INF_TOKEN
    want = torch.where(others, x + noise, torch.tensor(float("-inf"))).argmax(-1).tolist()
    assert got == want, f"{impl}: drew {got}, want {want} (token {INF_TOKEN} is -inf in row 0, -100 in row 1)"


# ------------------------------------------------------------ on the GPU

@pytest.mark.gpu
def test_gpu_kernel_matches_twin():
    """The compiled kernel on CUDA against the torch twin on the same device: vocabularies of real models, many
    rows, candidates, masked entries, large seeds and positions. (A mismatch is tolerated only at a near-tie of the
    twin's two best values, which a last-place difference of log could flip.)"""
    cases = [dict(R=64, K=32_000), dict(R=64, K=152_064, masked=0.3), dict(R=17, K=128_256, seed=3),
             dict(R=48, K=1024, ids_vocab=128_256), dict(R=48, K=50, ids_vocab=32_000, masked=0.5)]
    for i, c in enumerate(cases):
        x, seeds, positions, ids = _case(c["R"], c["K"], ids_vocab=c.get("ids_vocab"), masked=c.get("masked", 0.0),
                                         seed=100 + i, device="cuda")
        seeds[:8] = torch.tensor([2**63 - 1 - j for j in range(8)], device="cuda")
        positions[:4] = torch.tensor([2**31, 2**32 - 1, 0, 2**31 + 1], device="cuda")
        got, want = _both(x, seeds, positions, ids)
        bad = (got != want).nonzero()[:, 0]
        if bad.numel():
            cols = torch.arange(x.shape[1], device="cuda")
            y = x + philox.gumbel(seeds, positions, cols if ids is None else ids)
            top2 = y[bad.cuda()].topk(2, dim=-1).values
            assert ((top2[:, 0] - top2[:, 1]) < 1e-5).all(), (i, bad.tolist(), top2.tolist())
        assert bad.numel() <= 1, (i, bad.tolist())


@pytest.mark.gpu
def test_gpu_sampler_draws_the_cpu_sampler_tokens(monkeypatch):
    """The sampler on CUDA (the Triton kernel) and on the CPU with the kernel's torch twin in place of its own
    noise draw the same tokens for a mixed batch."""
    from vlora.engine import sampler as sampler_module
    from vlora.engine.sampler import Sampler

    monkeypatch.setattr(sampler_module, "cpu_gumbel_argmax",
                        lambda x, b, positions, ids: philox.gumbel_argmax(x, b.seeds, positions, ids))
    from vlora.engine.sequence import Sequence
    from vlora.sampling_params import SamplingParams

    V = 32_000
    ps = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40),
          SamplingParams(temperature=1.2, top_p=0.9), SamplingParams(temperature=0.8, min_p=0.05),
          SamplingParams(), SamplingParams(temperature=1.0, top_k=2000, repetition_penalty=1.3)]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(48, V, generator=g) * 3
    for dev in ("cpu", "cuda"):
        seqs = [Sequence(f"r{i}", [i, 1, 2], ps[i % len(ps)], None, i, sample_seed=2**62 + i) for i in range(48)]
        toks = Sampler(V, (2,), torch.device(dev)).sample(x.to(dev), seqs).result()
        if dev == "cpu":
            want = toks
    assert sum(a != b for a, b in zip(toks, want)) <= 1
