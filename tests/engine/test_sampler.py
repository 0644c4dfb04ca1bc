"""The batched sampler (``vlora/engine/sampler.py``) against a direct fp64 reference of its semantics.

Distribution tests draw ~100k tokens per setting (many rows at once, over a few positions: distinct
(seed, position) pairs are independent draws) and compare the empirical frequencies with the exact truncated and
renormalised distribution by Pearson's chi-square (p > 1e-3, fixed seeds: the tests are deterministic); tokens
outside the kept set must never be drawn. The reference is cross-checked against transformers' logits warpers.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from vlora.engine.faults import RowFailed
from vlora.engine.sampler import TOPK_CANDIDATES_MAX, Sampler
from vlora.engine.sequence import Sequence, TokenLogprobs
from vlora.kernels import philox
from vlora.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these tests run many mid-size elementwise ops (Philox on the CPU), where the thread
    pool's barriers cost tens of times the work when other processes share the cores; alone on 2 cores a second
    thread gains little here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
EOS = (1,)
INF = float("inf")
P_MIN = 1e-3


# ---------------------------------------------------------------- the reference (fp64, one row, straightforward)

def ref_logits(logits, p: SamplingParams, prompt=(), output=(), eos=EOS) -> torch.Tensor:
    """Logits after logit_bias, the min_tokens ban and the penalties (fp64, [V])."""
    x = torch.as_tensor(logits).double().clone()
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            x[t] = -INF
    r = p.repetition_penalty
    if r != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= p.frequency_penalty * list(output).count(t) + p.presence_penalty
    return x


def ref_probs(logits, p: SamplingParams, prompt=(), output=(), eos=EOS, check_margins=True) -> torch.Tensor:
    """The exact distribution of the sampled token (fp64, [V]; one-hot for greedy rows).

    ``check_margins``: fail (a badly chosen test setting, not a sampler bug) when a top-p or min-p decision lies
    so close to its threshold that float32 rounding in the sampler could flip it."""
    x = ref_logits(logits, p, prompt, output, eos)
    V = x.shape[0]
    if p.greedy:
        return torch.nn.functional.one_hot(x.argmax(), V).double()
    x = x / p.temperature
    order = sorted(range(V), key=lambda t: -x[t].item())
    kept = [True] * V
    if p.top_k > 0:
        for t in order[p.top_k:]:
            kept[t] = False
        if check_margins and p.top_k < V:
            assert x[order[p.top_k - 1]] - x[order[p.top_k]] > 1e-4, "a tie at the top-k boundary"
    in_k = [t for t in order if kept[t]]
    z = torch.stack([x[t] for t in in_k])
    probs = dict(zip(in_k, torch.softmax(z, 0).tolist()))     # renormalised inside the top-k set
    drop = set()
    if p.top_p < 1.0:
        before = 0.0
        for t in in_k:
            if check_margins:
                assert abs(before - p.top_p) > 1e-5, "top-p boundary too close to call in float32"
            if before >= p.top_p:
                drop.add(t)
            before += probs[t]
    if p.min_p > 0.0:
        top = max(probs.values())
        for t in in_k:
            if check_margins:
                assert abs(probs[t] - p.min_p * top) > 1e-6 * top, "min-p boundary too close to call in float32"
            if probs[t] < p.min_p * top:
                drop.add(t)
    for t in drop:
        kept[t] = False
    mask = torch.tensor(kept)
    out = torch.zeros(V, dtype=torch.float64)
    out[mask] = torch.softmax(x[mask], 0)
    return out


# ---------------------------------------------------------------- statistics (scipy is not installed)

def chisquare_p(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson's chi-square goodness of fit of counts ``observed`` [V] to ``expected_probs`` [V] (zero-probability
    tokens excluded; those expected below ``min_expected`` pooled into one bin). Returns (statistic, p-value)."""
    n = observed.sum().item()
    obs, exp = observed.double(), expected_probs.double() * n
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    small = exp < min_expected
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
        if exp[-1] < min_expected and len(exp) > 1:          # the pooled bin is still small: fold it into the
            obs = torch.cat([obs[:-2], obs[-2:].sum()[None]])  # last regular one
            exp = torch.cat([exp[:-2], exp[-2:].sum()[None]])
    df = len(exp) - 1
    if df == 0:
        return 0.0, 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()
    return stat.item(), p


def assert_distribution(tokens: torch.Tensor, probs: torch.Tensor, what: str = ""):
    """``tokens`` (any shape) are draws from ``probs`` [V]: none outside its support, chi-square p > P_MIN."""
    V = probs.shape[0]
    counts = torch.bincount(tokens.flatten(), minlength=V)
    assert counts.shape[0] == V, f"{what}: token ids outside the vocabulary"
    outside = (counts > 0) & (probs == 0)
    assert not outside.any(), (f"{what}: drew tokens outside the kept set: "
                               f"{ {int(t): int(counts[t]) for t in outside.nonzero()[:, 0]} }")
    stat, p = chisquare_p(counts, probs)
    assert p > P_MIN, (f"{what}: chi-square {stat:.1f}, p = {p:.2e}\n observed {counts.tolist()}\n "
                       f"expected {[round(v, 1) for v in (probs * counts.sum()).tolist()]}")


def test_chisquare_helper_rejects_a_wrong_distribution():
    """The statistics helper itself: accepts multinomial draws of the right distribution, rejects a nearby one."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(20, generator=g, dtype=torch.float64), 0)
    draws = torch.multinomial(probs, 100_000, replacement=True, generator=g)
    assert_distribution(draws, probs)
    wrong = probs.clone()
    wrong[probs.argmax()] *= 1.05                 # a 5% error on the likeliest token
    wrong /= wrong.sum()
    assert chisquare_p(torch.bincount(draws, minlength=20), wrong)[1] < P_MIN
    # scipy's classic example: chisquare([16, 18, 16, 14, 12, 12]) -> statistic 2.0, p 0.84914503608460956
    stat, p = chisquare_p(torch.tensor([16, 18, 16, 14, 12, 12]), torch.full((6,), 1 / 6, dtype=torch.float64))
    assert stat == pytest.approx(2.0) and p == pytest.approx(0.84914503608460956, rel=1e-9)


# ---------------------------------------------------------------- drawing many tokens

def _seqs(params, n, seed0, prompt=(2, 3), output=()):
    ps = params if isinstance(params, list) else [params]
    return [Sequence(f"r{i}", list(prompt), ps[i % len(ps)], None, i, output_token_ids=list(output),
                     sample_seed=seed0 + i) for i in range(n)]


def draw(logits, params, *, rows=20_000, steps=5, seed0=0, prompt=(2, 3), output=(), eos=EOS) -> torch.Tensor:
    """Tokens [steps, rows] sampled from ``logits`` ([V], or [m, V] with ``params`` a list of m: row i uses
    setting i % m). Each step is a fresh Sampler (so penalty counts start from the given history) and the prompts
    grow by a copy of their first token (same prompt set, next position): every (seed, position) is new."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    V = logits.shape[-1]
    seqs = _seqs(params, rows, seed0, prompt, output)
    m = len(params) if isinstance(params, list) else 1
    x = logits.reshape(-1, V)[torch.arange(rows) % m].contiguous()
    out = []
    for _ in range(steps):
        res = Sampler(V, eos, CPU).sample(x.clone(), seqs).result()
        assert all(isinstance(t, int) for t in res), [t for t in res if not isinstance(t, int)][:3]
        out.append(torch.tensor(res))
        for s in seqs:
            s.prompt_token_ids.append(s.prompt_token_ids[0])
    return torch.stack(out)


def _logits(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed({"spread": 1, "ties": 2, "dominant": 3}[kind])
    if kind == "spread":          # V=24, a wide spread of probabilities
        return (torch.randn(24, generator=g) * 2.0).float()
    if kind == "ties":            # V=16, near-ties among the likely tokens (gaps ~1e-3), none at a boundary below
        return torch.tensor([3.0, 3.001, 2.998, 2.5, 2.503, 2.0, 1.5, 1.5015, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0,
                             -3.0, -4.0])
    return torch.cat([torch.tensor([9.0]), torch.randn(19, generator=g) * 0.7]).float()   # V=20, one dominant


SINGLE = [
    ("T0.5", "spread", SamplingParams(temperature=0.5)),
    ("T1", "ties", SamplingParams(temperature=1.0)),
    ("T1.7", "dominant", SamplingParams(temperature=1.7)),
    ("top_k", "spread", SamplingParams(temperature=1.0, top_k=5)),
    ("top_p", "spread", SamplingParams(temperature=1.0, top_p=0.8)),
    ("min_p", "ties", SamplingParams(temperature=0.9, min_p=0.2)),
    ("k+p+min_p", "spread", SamplingParams(temperature=1.3, top_k=10, top_p=0.7, min_p=0.05)),
    ("p+min_p", "dominant", SamplingParams(temperature=1.7, top_p=0.995, min_p=0.001)),
    ("bias", "spread", SamplingParams(temperature=1.0, logit_bias={3: 2.5, 7: -1.0, 0: -100.0, 23: 4.0})),
]


@pytest.mark.parametrize("name,shape,p", SINGLE, ids=[s[0] for s in SINGLE])
def test_distribution(name, shape, p):
    logits = _logits(shape)
    probs = ref_probs(logits, p, prompt=(2, 3))
    if p.top_k or p.top_p < 1 or p.min_p:
        assert 1 < (probs > 0).sum() < len(probs), "the truncation should drop some tokens and keep several"
    tokens = draw(logits, p, seed0=zlib.crc32(name.encode()) << 20)
    assert_distribution(tokens, probs, name)


def test_distribution_penalties():
    """Repetition, frequency and presence penalties over a prompt and an output history (with a bias and top-k)."""
    spread, ties = _logits("spread"), _logits("ties")
    prompt, output = (2, 3, 5, 5, 9, 17), (5, 11, 11, 11, 3, 20, 4)
    cases = [(spread, SamplingParams(temperature=1.0, repetition_penalty=1.4, presence_penalty=0.6,
                                     frequency_penalty=0.4)),
             (spread, SamplingParams(temperature=0.8, top_k=12, repetition_penalty=0.8, presence_penalty=-0.5,
                                     frequency_penalty=0.25, logit_bias={11: 1.5})),
             # repetition alone, on tokens of negative logits (11..15 of "ties") as well as positive ones (0, 3)
             (ties, SamplingParams(temperature=1.0, repetition_penalty=2.0))]
    for i, (logits, p) in enumerate(cases):
        pr, out = (prompt, output) if i < 2 else ((0, 11, 12, 12), (13, 3, 14))
        probs = ref_probs(logits, p, pr, out)
        plain = ref_probs(logits, SamplingParams(temperature=p.temperature, top_k=p.top_k), pr, out)
        assert (probs - plain).abs().max() > 0.01            # the penalties matter for this setting
        # a slot per sequence per step: fewer rows here (the token-count table set-up dominates)
        tokens = draw(logits, p, rows=1000, steps=10, seed0=1000 * i + 7, prompt=pr, output=out)
        assert_distribution(tokens, probs, f"penalties {i}")


def _mixed_check(settings, logits_rows, rows, steps, seed0):
    params = [p for p in settings]
    tokens = draw(torch.stack(logits_rows), params, rows=rows, steps=steps, seed0=seed0)
    m = len(settings)
    for j, p in enumerate(settings):
        probs = ref_probs(logits_rows[j], p, prompt=(2, 3))
        got = tokens[:, j::m]
        if p.greedy:
            assert (got == probs.argmax()).all(), f"greedy row {j}"
        else:
            assert_distribution(got, probs, f"mixed row {j}: {p}")


def test_distribution_mixed_batch_sorted_vocabulary():
    """Rows with different settings in one batch, one of them sampled without top-k (so the sampler sorts the
    whole vocabulary); greedy rows among them."""
    spread, ties, dom = _logits("spread"), _logits("ties"), _logits("dominant")
    V = 24
    pad = lambda x: torch.cat([x, torch.full((V - len(x),), -INF)])      # noqa: E731 (-inf: never kept)
    settings = [SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.0, top_p=0.85),
                SamplingParams(temperature=0.7, top_k=3),
                SamplingParams(temperature=1.0, min_p=0.3),
                SamplingParams(temperature=1.5),
                SamplingParams(temperature=1.2, top_k=8, top_p=0.9, min_p=0.02),
                SamplingParams(temperature=0.0, logit_bias={4: 50.0})]
    logits_rows = [spread, pad(ties), spread, pad(dom), pad(ties), spread, spread]
    _mixed_check(settings, logits_rows, rows=7 * 3500, steps=5, seed0=5_000_000)


def test_distribution_mixed_batch_topk_candidates():
    """Every sampled row has a top-k (different ones) -> torch.topk candidates; greedy rows among them."""
    spread, dom = _logits("spread"), _logits("dominant")
    dom = torch.cat([dom, torch.full((4,), -5.0)])
    settings = [SamplingParams(temperature=1.0, top_k=2),
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.0, top_k=20, top_p=0.9),
                SamplingParams(temperature=1.7, top_k=6, min_p=0.1),
                SamplingParams(temperature=0.6, top_k=23)]
    _mixed_check(settings, [spread, spread, spread, dom, spread], rows=5 * 5000, steps=5, seed0=9_000_000)


def test_topk_path_and_sorted_path_are_both_taken(monkeypatch):
    """The two mixed tests above exercise both candidate paths (what topk / sort sees)."""
    seen = []
    real_topk, real_sort = torch.Tensor.topk, torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, *a, **k: seen.append("topk") or real_topk(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: seen.append("sort") or real_sort(self, *a, **k))
    x = _logits("spread")[None].expand(2, -1).contiguous()
    Sampler(24, EOS, CPU).sample(x, _seqs([SamplingParams(temperature=1.0, top_k=3),
                                           SamplingParams(temperature=1.0, top_k=5)], 2, 0)).result()
    assert seen == ["topk"]
    seen.clear()
    Sampler(24, EOS, CPU).sample(x, _seqs([SamplingParams(temperature=1.0, top_k=3),
                                           SamplingParams(temperature=1.0, top_p=0.5)], 2, 0)).result()
    assert seen == ["sort"]


# ---------------------------------------------------------------- the reference against transformers

def _hf_probs(logits, p: SamplingParams) -> torch.Tensor:
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.as_tensor(logits).double()[None]
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(float(p.temperature))(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(float(p.top_p))(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(float(p.min_p))(ids, scores)
    return torch.softmax(scores, -1)[0]


def test_reference_matches_transformers_warpers():
    g = torch.Generator().manual_seed(11)
    n = 0
    for shape in ("spread", "ties", "dominant"):
        for T in (0.5, 1.7):
            for k in (0, 1, 4, 9):
                for top_p in (1.0, 0.93, 0.6, 0.2):
                    for min_p in (0.0, 0.07, 0.35):
                        p = SamplingParams(temperature=T, top_k=k, top_p=top_p, min_p=min_p)
                        logits = _logits(shape) + 1e-3 * torch.randn(len(_logits(shape)), generator=g)
                        try:
                            ours = ref_probs(logits, p)
                        except AssertionError:          # a threshold too close to call: not a fair comparison
                            continue
                        hf = _hf_probs(logits, p)
                        assert torch.equal(ours > 0, hf > 0), (shape, p)
                        torch.testing.assert_close(ours, hf, rtol=1e-12, atol=1e-15)
                        n += 1
    assert n > 200


def test_reference_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(12)
    for r in (0.5, 1.3, 2.0):
        logits = torch.randn(40, generator=g).double() * 3
        logits[7] = 0.0
        prompt, output = [3, 7, 7, 12, 30], [12, 0, 39, 39]
        ours = ref_logits(logits, SamplingParams(repetition_penalty=r), prompt, output)
        hf = RepetitionPenaltyLogitsProcessor(float(r))(torch.tensor([prompt + output]), logits[None].clone())[0]
        torch.testing.assert_close(ours, hf, rtol=0, atol=0)
        assert not torch.equal(ours, logits)


# ---------------------------------------------------------------- seeds

def _one(sampler, logits_row, seq) -> int | RowFailed:
    return sampler.sample(logits_row[None].contiguous(), [seq]).result()[0]


def _oracle(x32: torch.Tensor, kept: torch.Tensor, seed: int, position: int) -> int:
    """The Gumbel-max draw over the full vocabulary (kept tokens only) with the sampler's noise on the CPU."""
    from vlora.engine.sampler import cpu_noise

    x = torch.where(kept, x32, torch.tensor(-INF))
    return int((x + cpu_noise(seed, position, x.shape[0])).argmax())


def _mixed_batch_params():
    return [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, top_k=7),
            SamplingParams(temperature=1.3, min_p=0.1, logprobs=3),
            SamplingParams(temperature=1.0, presence_penalty=1.0, repetition_penalty=1.2),
            SamplingParams(temperature=0.5, logit_bias={0: 5.0}, min_tokens=2, stop_token_ids=(9,)),
            SamplingParams(temperature=2.0, top_k=1050), SamplingParams(logprobs=0)]


@pytest.mark.parametrize("target", [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.1, top_p=0.6),
                                    SamplingParams(temperature=1.5, top_k=50, min_p=0.01, seed=2**63 - 1)],
                         ids=["top_k", "plain", "top_p", "k+min_p"])
def test_same_seed_and_position_same_token_alone_or_in_any_batch(target):
    V = 1100                                          # > TOPK_CANDIDATES_MAX: top_k=1050 rows sort the vocabulary
    assert V > TOPK_CANDIDATES_MAX
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(V, generator=g) * 3
    others = _mixed_batch_params()
    seed = target.seed if target.seed is not None else 123456789
    kept = ref_probs(logits, target, check_margins=False) > 0
    T = torch.tensor(target.temperature, dtype=torch.float32)
    alone, in_batch, in_candidates_batch = [], [], []
    for step in range(6):
        prompt = [5] * (3 + step)                      # position 3 + step
        seq = Sequence("t", prompt, target, None, 0, sample_seed=seed)
        alone.append(_one(Sampler(V, EOS, CPU), logits, seq))
        # in a batch of 64 mixed rows (some sort the vocabulary), at row 37
        batch = [Sequence(f"o{i}", [4] * (i % 5 + 1), others[i % len(others)], None, i, sample_seed=i)
                 for i in range(64)]
        batch[37] = Sequence("t", list(prompt), target, None, 0, sample_seed=seed)
        x = torch.randn(64, V, generator=g) * 3
        x[37] = logits
        in_batch.append(Sampler(V, EOS, CPU).sample(x, batch).result()[37])
        # in a batch whose every sampled row has a small top-k (candidates path when the target has one)
        batch2 = [Sequence(f"c{i}", [4], SamplingParams(temperature=1.0, top_k=1 + i), None, i, sample_seed=i)
                  for i in range(8)]
        batch2[5] = Sequence("t", list(prompt), target, None, 0, sample_seed=seed)
        x2 = torch.randn(8, V, generator=g)
        x2[5] = logits
        in_candidates_batch.append(Sampler(V, EOS, CPU).sample(x2, batch2).result()[5])
        # the full-vocabulary oracle over the reference's kept set
        assert alone[-1] == _oracle(logits / T, kept, seed, 3 + step), step
    assert alone == in_batch == in_candidates_batch
    assert len(set(alone)) > 1


def test_topk_candidates_equal_full_vocabulary_for_the_same_kept_set():
    """top_k = V - 1 (torch.topk candidates, V - 1 columns) draws what the sorted full vocabulary draws (a batch
    with a top-p-only row) and what the full-vocabulary oracle draws with the one lowest token dropped."""
    V = 40
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(V, generator=g)
    kept = torch.ones(V, dtype=torch.bool)
    kept[logits.argmin()] = False
    p = SamplingParams(temperature=1.0, top_k=V - 1)
    sorter = SamplingParams(temperature=1.0, top_p=0.5)
    diff = 0
    for seed in range(120):
        cand = Sampler(V, EOS, CPU).sample(logits[None].clone(), _seqs(p, 1, seed)).result()[0]
        x = torch.stack([logits, logits])
        full = Sampler(V, EOS, CPU).sample(x, [_seqs(p, 1, seed)[0], _seqs(sorter, 1, 99)[0]]).result()[0]
        assert cand == full == _oracle(logits, kept, seed, 2), seed
        diff += cand != int(logits.argmax())
    assert diff > 30


def test_different_seeds_give_different_streams():
    V = 40
    logits = torch.zeros(V)
    streams = []
    for seed in (0, 1, 2**40, 2**62 + 5):
        seq = Sequence("s", [3], SamplingParams(temperature=1.0), None, 0, sample_seed=seed)
        s = Sampler(V, EOS, CPU)
        toks = []
        for _ in range(30):
            toks.append(_one(s, logits, seq))
            seq.output_token_ids.append(toks[-1])
        streams.append(toks)
        # the same seed again: the same stream
        seq2 = Sequence("s2", [3], SamplingParams(temperature=1.0), None, 0, sample_seed=seed)
        again = []
        for _ in range(30):
            again.append(_one(Sampler(V, EOS, CPU), logits, seq2))
            seq2.output_token_ids.append(again[-1])
        assert again == toks
    for i in range(len(streams)):
        for j in range(i):
            assert sum(a == b for a, b in zip(streams[i], streams[j])) < 8, (i, j)
    assert all(len(set(s)) > 10 for s in streams)


# ---------------------------------------------------------------- greedy, min_tokens, failures

def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(5)
    V, n = 50, 32
    x = torch.randn(n, V, generator=g)
    seqs = _seqs(SamplingParams(), n, 0)
    assert Sampler(V, EOS, CPU).sample(x.clone(), seqs).result() == x.argmax(-1).tolist()
    # mixed with sampled rows (and with a bias on a greedy row)
    ps = [SamplingParams(), SamplingParams(temperature=1.0, top_k=5), SamplingParams(logit_bias={7: 100.0}),
          SamplingParams(temperature=0.5)]
    seqs = _seqs(ps, n, 0)
    res = Sampler(V, EOS, CPU).sample(x.clone(), seqs).result()
    for i in range(n):
        if i % 4 == 0:
            assert res[i] == int(x[i].argmax())
        elif i % 4 == 2:
            assert res[i] == 7
        elif i % 4 == 1:
            assert res[i] in x[i].topk(5).indices.tolist()


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 0), (1.0, 4), (0.6, 0)])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(temperature, top_k):
    V, eos = 20, (2, 5)
    logits = -3.0 - 0.1 * torch.arange(V, dtype=torch.float32)
    logits[2], logits[7], logits[5], logits[4], logits[11] = 12.0, 11.5, 11.0, 6.0, 5.8
    p = SamplingParams(temperature=temperature, top_k=top_k, min_tokens=3, stop_token_ids=(7,))
    rows = 400
    seqs = [Sequence(f"m{i}", [3], p, None, 0, sample_seed=i) for i in range(rows)]
    sampler = Sampler(V, eos, CPU)
    for step in range(5):
        res = sampler.sample(logits[None].expand(rows, V).contiguous(), seqs).result()
        banned = {2, 5, 7}
        if step < 3:
            assert not banned & set(res), (step, sorted(set(res)))
            if temperature == 0:
                assert set(res) == {4}
        else:                                         # allowed again: eos / stop ids dominate
            assert 2 in res and sum(t in banned for t in res) > 0.95 * rows
            if temperature == 0:
                assert set(res) == {2}
        probs = ref_probs(logits, p, output=[0] * step, eos=eos)
        assert all(probs[t] > 0 for t in res)
        for s in seqs:                                # the engine would finish at a stop id; here the tests
            s.output_token_ids.append(0)              # go on with a neutral token


def _bad_rows(V, g):
    allinf = torch.full((V,), -INF)
    nan = torch.full((V,), float("nan"))
    mixed = torch.full((V,), -INF)
    mixed[::3] = float("nan")
    return {"all -inf": allinf, "all nan": nan, "-inf and nan": mixed}


@pytest.mark.parametrize("bad_params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5),
                                        SamplingParams(temperature=1.0, top_p=0.9, logprobs=2),
                                        SamplingParams()],
                         ids=["sampled", "top_k", "top_p+logprobs", "greedy"])
@pytest.mark.parametrize("bad", ["all -inf", "all nan", "-inf and nan"])
def test_unsamplable_row_fails_alone(bad, bad_params):
    V, n = 30, 9
    g = torch.Generator().manual_seed(6)
    ps = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.7, top_k=4),
          SamplingParams(temperature=1.0, top_p=0.8, logprobs=1)]
    x = torch.randn(n, V, generator=g)
    seqs = _seqs(ps, n, 100)
    want = Sampler(V, EOS, CPU).sample(x.clone(), seqs).result()
    seqs_bad = list(seqs)
    seqs_bad[4] = Sequence("bad", [2], bad_params, None, 0, sample_seed=4)
    x_bad = x.clone()
    x_bad[4] = _bad_rows(V, g)[bad]
    got = Sampler(V, EOS, CPU).sample(x_bad, seqs_bad).result()
    assert isinstance(got[4], RowFailed), f"{bad} row with {bad_params}: got {got[4]!r}, want RowFailed"
    assert got[:4] + got[5:] == want[:4] + want[5:]


def test_stop_ids_outside_vocabulary_under_min_tokens_fail_only_that_row():
    V, n = 30, 6
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, V, generator=g)
    ps = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3)]
    seqs = _seqs(ps, n, 0)
    want = Sampler(V, EOS, CPU).sample(x.clone(), seqs).result()
    seqs[2] = Sequence("bad", [2, 3], SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=(V + 5,)), None,
                       0, sample_seed=2)
    seqs[3] = Sequence("ok", [2, 3], SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=(V - 1,)), None,
                       0, sample_seed=3)
    s = Sampler(V, EOS, CPU)
    got = s.sample(x.clone(), seqs).result()
    assert isinstance(got[2], RowFailed) and "stop_token_ids" in str(got[2])
    assert isinstance(got[3], int) and got[3] not in (V - 1, *EOS)
    assert [got[i] for i in (0, 1, 4, 5)] == [want[i] for i in (0, 1, 4, 5)]
    # the same without min_tokens: the ids are just never met, nothing fails
    seqs[2] = Sequence("bad", [2, 3], SamplingParams(temperature=1.0, stop_token_ids=(V + 5,)), None, 0,
                       sample_seed=2)
    assert all(isinstance(t, int) for t in Sampler(V, EOS, CPU).sample(x.clone(), seqs).result())


def test_logit_bias_outside_vocabulary_fails_only_that_row():
    V, n = 30, 4
    x = torch.randn(n, V, generator=torch.Generator().manual_seed(8))
    seqs = _seqs(SamplingParams(temperature=1.0, logit_bias={3: 1.0}), n, 0)
    want = Sampler(V, EOS, CPU).sample(x.clone(), seqs).result()
    seqs[1] = Sequence("bad", [2, 3], SamplingParams(temperature=1.0, logit_bias={3: 1.0, V: 2.0}), None, 0,
                       sample_seed=1)
    got = Sampler(V, EOS, CPU).sample(x.clone(), seqs).result()
    assert isinstance(got[1], RowFailed)
    assert [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_the_raw_distribution():
    V, n = 64, 12
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, V, generator=g) * 2
    ks = [0, 1, 5, 20, None, 3]
    ps = [SamplingParams(temperature=1.7, top_k=4, logprobs=ks[0], repetition_penalty=1.5, logit_bias={1: 3.0}),
          SamplingParams(temperature=0.0, logprobs=ks[1], presence_penalty=2.0, frequency_penalty=1.0),
          SamplingParams(temperature=0.4, top_p=0.5, logprobs=ks[2], logit_bias={10: -50.0, 11: 20.0}),
          SamplingParams(temperature=1.0, min_p=0.2, logprobs=ks[3], min_tokens=3, stop_token_ids=(5,)),
          SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.0, logprobs=ks[5], logit_bias={0: 30.0})]
    seqs = [Sequence(f"l{i}", [7, 8, 9], ps[i % 6], None, 0, output_token_ids=[9, 12, 12], sample_seed=i)
            for i in range(n)]
    sampler = Sampler(V, EOS, CPU)
    for step in range(3):
        res = sampler.sample(x.clone(), seqs).result()
        raw = torch.log_softmax(x, -1)
        for i, r in enumerate(res):
            k = ks[i % 6]
            if k is None:
                assert isinstance(r, int)
                continue
            assert isinstance(r, TokenLogprobs), r
            assert abs(r.logprob - raw[i, r.token_id].item()) < 1e-5
            assert len(r.top) == k
            if k:
                want = raw[i].topk(k)
                assert [t for t, _ in r.top] == want.indices.tolist()
                assert [v for _, v in r.top] == pytest.approx(want.values.tolist(), abs=1e-5)
                assert all(a[1] >= b[1] for a, b in zip(r.top, r.top[1:]))
            p = ps[i % 6]
            out = seqs[i].output_token_ids
            probs = ref_probs(x[i], p, seqs[i].prompt_token_ids, out, check_margins=False)
            assert probs[r.token_id] > 0
            if i % 6 == 5:
                assert r.token_id == 0                 # the bias moved the token, not the logprob
                assert r.logprob == pytest.approx(raw[i, 0].item(), abs=1e-5)
        for i, s in enumerate(seqs):
            s.output_token_ids.append(res[i] if isinstance(res[i], int) else res[i].token_id)


# ---------------------------------------------------------------- penalties through steps

def _penalty_params():
    return [SamplingParams(frequency_penalty=1.5),
            SamplingParams(presence_penalty=2.0),
            SamplingParams(repetition_penalty=3.0),
            SamplingParams(repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.6, logit_bias={4: 1.0}),
            SamplingParams(frequency_penalty=-1.0, repetition_penalty=0.7),
            SamplingParams()]


def test_penalties_follow_the_output_greedy():
    """Greedy rows over many steps (the test appends each token): each token is the argmax of the reference's
    penalised logits of the history so far; the batch changes composition half-way (a row leaves, a new one with a
    history joins), so the counts of rows that stay, and the set-up of a new row's counts, are checked too."""
    V, n, steps = 24, 12, 16
    g = torch.Generator().manual_seed(10)
    base = torch.randn(n + 1, V, generator=g) * 1.5
    ps = _penalty_params()
    seqs = [Sequence(f"g{i}", [i % V, 3, 3], ps[i % len(ps)], None, i, sample_seed=i) for i in range(n)]
    joiner = Sequence("join", [1, 2], SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2), None, 99,
                      output_token_ids=[6, 6, 7], sample_seed=99)
    sampler = Sampler(V, EOS, CPU)
    batch = list(seqs)
    rows = list(range(n))
    checked = 0
    for step in range(steps):
        if step == steps // 2:
            batch, rows = batch[1:] + [joiner], rows[1:] + [n]
        x = base[rows] + 0.3 * torch.randn(len(rows), V, generator=g)
        res = sampler.sample(x.clone(), batch).result()
        for j, s in enumerate(batch):
            ref = ref_logits(x[j], s.params, s.prompt_token_ids, s.output_token_ids)
            top2 = ref.topk(2).values
            if top2[0] - top2[1] > 1e-4:
                assert res[j] == int(ref.argmax()), (step, s.request_id, s.output_token_ids)
                checked += 1
            s.output_token_ids.append(res[j])
    assert checked > 0.9 * steps * n
    freq = seqs[0].output_token_ids
    assert len(set(freq)) > 3                        # the frequency penalty moved the argmax around


def test_penalties_follow_the_output_sampled():
    """Sampled rows over steps: every token inside the reference's kept set for its history, and the tokens of
    all (row, step) draws of a setting together fit the mean of their reference distributions (Pearson's
    statistic against it is conservative for independent draws from different distributions)."""
    V, n, steps = 16, 600, 6
    logits = _logits("ties")
    ps = [SamplingParams(temperature=1.0, top_k=6, frequency_penalty=0.8, presence_penalty=0.3),
          SamplingParams(temperature=0.8, repetition_penalty=1.6, top_p=0.9),
          SamplingParams(temperature=1.2, presence_penalty=1.5, frequency_penalty=-0.5, min_p=0.05)]
    seqs = [Sequence(f"s{i}", [0, 5], ps[i % 3], None, i, sample_seed=10_000 + i) for i in range(n)]
    sampler = Sampler(V, EOS, CPU)
    counts = torch.zeros(3, V, dtype=torch.long)
    expected = torch.zeros(3, V, dtype=torch.float64)
    for step in range(steps):
        res = sampler.sample(logits[None].expand(n, V).contiguous(), seqs).result()
        for i, s in enumerate(seqs):
            probs = ref_probs(logits, s.params, s.prompt_token_ids, s.output_token_ids, check_margins=False)
            assert probs[res[i]] > 0, (step, i, res[i], s.output_token_ids)
            expected[i % 3] += probs
            counts[i % 3, res[i]] += 1
            s.output_token_ids.append(res[i])
    for k in range(3):
        stat, p = chisquare_p(counts[k], expected[k] / expected[k].sum())
        assert p > P_MIN, (k, stat, counts[k].tolist(), expected[k].round().tolist())
    # the histories made a difference: the first step's distribution is not the mix of all steps
    first = ref_probs(logits, ps[0], [0, 5], [], check_margins=False)
    assert (first - expected[0] / expected[0].sum()).abs().max() > 0.03


def test_penalty_counts_survive_a_new_sampler_batch_of_the_same_rows():
    """The counts are the device's: a token sampled in one call is penalised in the next, before the host has
    appended it (the engine reads tokens one iteration late); the test appends a placeholder then patches it."""
    V = 10
    x = torch.zeros(V)
    x[3], x[4] = 5.0, 4.0
    seq = Sequence("p", [0], SamplingParams(frequency_penalty=2.0), None, 0, sample_seed=0)
    s = Sampler(V, EOS, CPU)
    first = s.sample(x[None].clone(), [seq])
    seq.output_token_ids.append(Sequence.PENDING)     # the engine's placeholder while the token is in flight
    second = s.sample(x[None].clone(), [seq])         # queued before the first is read
    assert first.result() == [3]
    assert second.result() == [4]                     # 5 - 2 < 4: the device counted 3 already


# ---------------------------------------------------------------- a noise value of +inf

# A (seed, position, token) whose Philox bits are 0xffffff3c: bits >> 8 = 2**24 - 1, the largest 24-bit value, so
# the uniform ((2**24 - 1) + 0.5) / 2**24 must be just below 1 and the noise large but finite. Found by the top-p
# distribution test above (row 18615 of its seeds, 3 steps on: position 5).
INF_SEED, INF_POSITION, INF_TOKEN = 2548809334802615, 5, 21


def test_noise_is_finite_at_the_largest_uniform():
    bits = philox.philox4x32(torch.tensor(INF_SEED), torch.tensor(INF_TOKEN), torch.tensor(INF_POSITION))[0]
    assert int(bits) >> 8 == 2**24 - 1
    noise = philox.gumbel(torch.tensor([INF_SEED]), torch.tensor([INF_POSITION]), torch.tensor([INF_TOKEN]))
    assert torch.isfinite(noise).all(), f"noise(seed, position, token) = {noise.item()}, want a finite value"


@pytest.mark.parametrize("how", ["-inf logit", "top_p", "top_k", "logit_bias -100"])
def test_a_token_that_is_not_kept_is_never_drawn(how):
    """The token whose noise is the largest uniform's: dropped (or biased by -100), it must not be drawn."""
    V = 24
    logits = _logits("spread")
    assert logits.argmax() != INF_TOKEN
    p = SamplingParams(temperature=1.0)
    if how == "-inf logit":
        logits[INF_TOKEN] = -INF
    elif how == "top_p":
        p = SamplingParams(temperature=1.0, top_p=0.5)
    elif how == "top_k":
        p = SamplingParams(temperature=1.0, top_k=3)
    else:
        p = SamplingParams(temperature=1.0, logit_bias={INF_TOKEN: -100.0})
    probs = ref_probs(logits, p)
    assert probs[INF_TOKEN] < 1e-40
    seq = Sequence("inf", [2] * INF_POSITION, p, None, 0, sample_seed=INF_SEED)
    got = Sampler(V, EOS, CPU).sample(logits[None].clone(), [seq]).result()[0]
    assert got != INF_TOKEN, f"drew token {got}, whose probability is {probs[INF_TOKEN].item():.3g}"
