"""Async scheduling (a decode queued behind the one in flight, its input tokens taken on the device) gives the
tokens of the synchronous loop: greedy and seeded sampling, stop tokens and EOS that end a sequence while the
next iteration is already queued, aborts and arrivals mid-run, preemption, prefix caching. The model is a stub
whose next token is a fixed function of the input token and its position, so that every token checks the
wiring of input ids (host or device), positions and the rows that are dropped; the block tables are checked
against a rebuild from scratch."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlora import LLM, SamplingParams
from vlora.engine.cuda_graphs import HostTables

VOCAB = 256


def next_token(token: int, position: int) -> int:
    return (token * 31 + position * 17 + 3) % VOCAB


def stub_llm(async_scheduling: bool, num_blocks: int = 96, max_num_seqs: int = 8, **kw) -> LLM:
    """A tiny random model whose forward is replaced: row ``i`` scores ``next_token(id, position)`` highest."""
    llm = LLM("random:tiny-llama", device="cpu", num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=64, async_scheduling=async_scheduling, **kw)
    model = llm.engine.model

    def forward(fb, kv_cache):
        return next_token_tensor(fb.input_ids, fb.positions).to(torch.float32).unsqueeze(1)

    def compute_logits(hidden, fast=False):
        return 40.0 * torch.nn.functional.one_hot(hidden[:, 0].long(), VOCAB).to(torch.float32)

    model.forward = forward
    model.compute_logits = compute_logits
    llm.engine.runner.enable_graphs(max_num_seqs, llm.engine.max_model_len)
    return llm


def next_token_tensor(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (ids * 31 + positions * 17 + 3) % VOCAB


def expected(prompt: list[int], sp: SamplingParams, eos: int = 2) -> list[int]:
    out, toks = [], list(prompt)
    while len(out) < sp.max_tokens:
        t = next_token(toks[-1], len(toks) - 1)
        if len(out) < sp.min_tokens and (t == eos or t in sp.stop_token_ids):
            t = 0      # banned: the stub's second best is token 0 (logits 0, argmax of the rest)
        out.append(t)
        toks.append(t)
        if t in sp.stop_token_ids or (not sp.ignore_eos and t == eos):
            break
    return out


def requests(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(n)]
    sps = []
    for i, p in enumerate(prompts):
        full = expected(p, SamplingParams(max_tokens=12, ignore_eos=True))
        stop = [full[rng.randrange(2, 12)]] if i % 3 == 0 else []      # ends mid-run, decided by its own token
        sps.append(SamplingParams(max_tokens=rng.randrange(1, 13), ignore_eos=i % 2 == 0, stop_token_ids=stop))
    return prompts, sps


@pytest.mark.parametrize("seed", [0, 1])
def test_async_tokens_equal_sync(seed):
    prompts, sps = requests(12, seed)
    want = [expected(p, sp) for p, sp in zip(prompts, sps)]
    sync = stub_llm(False)
    assert [o.token_ids for o in sync.generate(prompts, None, sps)] == want
    assert sync.engine.num_overlapped == 0
    llm = stub_llm(True)
    outs = llm.generate(prompts, None, sps)
    assert [o.token_ids for o in outs] == want
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in sync.generate(prompts, None, sps)]
    eng = llm.engine
    assert eng.num_overlapped > 0 and eng.runner.graphs.num_replays > eng.num_overlapped
    assert not eng.has_unfinished() and eng.pool.kv_pages == 0
    eng.pool.check()


def test_streamed_deltas_hold_no_pending_token():
    """Every streamed delta is a real token, in order; the outputs end with the tokens of the sync loop."""
    prompts, sps = requests(8, 2)
    llm = stub_llm(True)
    eng = llm.engine
    ids = [eng.add_request(p, None, sp) for p, sp in zip(prompts, sps)]
    got = {r: [] for r in ids}
    while eng.has_unfinished():
        for out in eng.step():
            assr = got[out.request_id]
            assr.extend(out.delta_token_ids)
            assert out.token_ids == assr and -1 not in out.token_ids
    assert [got[r] for r in ids] == [expected(p, sp) for p, sp in zip(prompts, sps)]
    assert eng.num_overlapped > 0


def test_abort_and_arrivals_mid_run():
    """An abort lands the iteration in flight first; a request added mid-run waits one step for the loop to fall
    back to synchronous scheduling, then joins; both give the sync loop's tokens."""
    prompts, sps = requests(6, 3)
    sps = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in prompts]
    llm = stub_llm(True)
    eng = llm.engine
    ids = [eng.add_request(p, None, sp) for p, sp in zip(prompts, sps)]
    for _ in range(4):
        eng.step()
    assert eng.in_flight
    assert eng.abort(ids[1])
    late = eng.add_request([7, 8, 9], None, SamplingParams(max_tokens=6, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id] = out
    assert outs[ids[1]].finish_reason == "abort" and -1 not in outs[ids[1]].token_ids
    full = expected(prompts[1], sps[1])
    assert outs[ids[1]].token_ids == full[:len(outs[ids[1]].token_ids)]
    for rid, p in zip(ids, prompts):
        if rid != ids[1]:
            assert outs[rid].token_ids == expected(p, sps[0])
    assert outs[late].token_ids == expected([7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    assert eng.pool.kv_pages == 0


def test_outputs_of_an_iteration_landed_by_an_abort_are_streamed():
    """An abort (of another request) lands the iteration in flight: its outputs go out with the next step, so the
    streamed deltas add up to the tokens, and a request that ends in that iteration gets its final output."""
    prompts = [[5, 6, 7], [9, 10]]
    sps = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)]
    llm = stub_llm(True)
    eng = llm.engine
    ids = [eng.add_request(p, None, sp) for p, sp in zip(prompts, sps)]
    streamed, final = {r: [] for r in ids}, {}
    aborted = False
    while eng.has_unfinished():
        if not aborted and eng.in_flight and len(streamed[ids[1]]) == 2:
            aborted = eng.abort(ids[0])         # lands the iteration that samples ids[1]'s third token
        for out in eng.step():
            streamed[out.request_id].extend(out.delta_token_ids)
            if out.finished:
                final[out.request_id] = out
    assert aborted
    assert final[ids[1]].token_ids == expected(prompts[1], sps[1]) == streamed[ids[1]]
    assert final[ids[0]].finish_reason == "abort" and streamed[ids[0]] == final[ids[0]].token_ids


def test_a_full_batch_keeps_queueing_with_requests_waiting():
    """With the batch at max_num_seqs and requests waiting, decodes are still queued behind one another (a
    waiting request joins once a sequence ends); every request gets the tokens of the sync loop."""
    prompts, sps = requests(10, 5)
    llm = stub_llm(True, max_num_seqs=4)
    eng = llm.engine
    ids = [eng.add_request(p, None, sp) for p, sp in zip(prompts, sps)]
    outs, queued_with_waiting = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id] = out
        queued_with_waiting += eng.in_flight and bool(eng.scheduler.waiting)
    assert queued_with_waiting > 0
    assert [outs[r].token_ids for r in ids] == [expected(p, sp) for p, sp in zip(prompts, sps)]
    assert eng.pool.kv_pages == 0


def test_decodes_queue_only_behind_captured_graphs_and_a_failed_capture_runs_eagerly():
    """A bucket whose graph is not captured yet is decoded synchronously first (its capture then happens with
    the input tokens on the host); one whose capture runs out of device memory runs eagerly from then on. No
    request fails, tokens are unchanged, and decodes still queue where graphs exist."""
    llm = stub_llm(True)
    g = llm.engine.runner.graphs
    for key in [k for k in g.graphs if k[0] < 8]:
        del g.graphs[key]
    capture = g.capture

    def out_of_memory_below_8(b, kind, mixed):
        if b < 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test's)")
        return capture(b, kind, mixed)
    g.capture = out_of_memory_below_8
    prompts = [[5 + i, 7, 9] for i in range(8)]
    sps = [SamplingParams(max_tokens=3 + i, ignore_eos=True) for i in range(8)]
    want = [expected(p, sp) for p, sp in zip(prompts, sps)]
    for _ in range(2):
        out = llm.generate(prompts, None, sps)
        assert [o.token_ids for o in out] == want and {o.finish_reason for o in out} == {"length"}
    assert g.uncapturable and all(b < 8 for b, _, _ in g.uncapturable)
    assert llm.engine.num_overlapped > 0                      # the full batch of 8 still queued


def test_seeded_sampling_and_min_tokens():
    """Seeded (non-greedy) rows draw from their own generators in the same order; min_tokens bans the stop
    token by the count of tokens sampled so far, pending ones included."""
    prompts, _ = requests(6, 4)
    sps = []
    for i, p in enumerate(prompts):
        stop = expected(p, SamplingParams(max_tokens=4, ignore_eos=True))[2]
        sps.append(SamplingParams(max_tokens=10, temperature=1.0, seed=i, stop_token_ids=[stop], min_tokens=5,
                                  ignore_eos=True))
    want = [o.token_ids for o in stub_llm(False).generate(prompts, None, sps)]
    llm = stub_llm(True)
    assert [o.token_ids for o in llm.generate(prompts, None, sps)] == want
    assert llm.engine.num_overlapped > 0


def test_preemption_and_prefix_caching_keep_tokens():
    """A pool too small for every sequence (preemptions: the loop falls back to sync iterations) and prefix
    caching (shared prompt prefixes) give the tokens of the sync loop."""
    base = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [base + [20 + i] for i in range(8)]
    sps = [SamplingParams(max_tokens=10 + i, ignore_eos=True) for i in range(8)]
    want = [expected(p, sp) for p, sp in zip(prompts, sps)]
    for kw, counter in ((dict(num_blocks=14), "preemptions"), (dict(prefix_caching=True), None)):
        llm = stub_llm(True, **kw)
        for _ in range(2):             # the second run finds the first one's prompts cached
            assert [o.token_ids for o in llm.generate(prompts, None, sps)] == want, kw
        eng = llm.engine
        assert eng.num_overlapped > 0
        if counter:
            assert eng.scheduler.counters()[counter] > 0
        else:
            assert eng.scheduler.prompt_tokens_computed < 2 * sum(len(p) for p in prompts)
        eng.pool.check()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_host_tables_equal_a_rebuild(data):
    """HostTables, written only where rows changed, holds what a rebuild from scratch holds, through pages
    appended, sequences replaced (new block lists after a preemption or finish) and rows reordered."""
    rows, cols = 6, 10
    tables = HostTables(rows, cols, torch.device("cpu"))
    seqs = [[] for _ in range(8)]
    for _ in range(data.draw(st.integers(1, 12))):
        for i in range(len(seqs)):
            op = data.draw(st.sampled_from(["append", "keep", "replace"]))
            if op == "append" and len(seqs[i]) < cols:
                seqs[i].append(data.draw(st.integers(0, 99)))
            elif op == "replace":
                seqs[i] = [data.draw(st.integers(0, 99)) for _ in range(data.draw(st.integers(0, cols)))]
        order = data.draw(st.permutations(range(len(seqs))))[:data.draw(st.integers(1, rows))]
        lists = [seqs[i] for i in order]
        counts = [data.draw(st.integers(0, len(t))) if t else 0 for t in lists]
        tables.fill(lists, counts)
        for r, (t, k) in enumerate(zip(lists, counts)):
            assert tables.tensor[r, :k].tolist() == t[:k]


@pytest.mark.gpu
def test_cuda_async_scheduling_keeps_tokens(tmp_path):
    """The real decode graphs (fp32, adapters): greedy, seeded and stop-token requests give the synchronous
    loop's tokens with async scheduling on, and iterations were queued behind one another."""
    from tests.models.test_fast_path import GRAPH_NAMES, GRAPH_PROMPTS, GRAPH_SPS
    from tests.models.test_parity import build

    path, paths, _ = build(tmp_path)
    kw = dict(adapters=paths, num_blocks=64, block_size=4, max_num_seqs=8, device="cuda", dtype="float32")
    sync = LLM(str(path), async_scheduling=False, **kw)
    llm = LLM(str(path), **kw)
    greedy = [o.token_ids for o in sync.generate(GRAPH_PROMPTS, GRAPH_NAMES, GRAPH_SPS)]
    stops = [SamplingParams(max_tokens=9, stop_token_ids=[toks[2]]) for toks in greedy]
    seeded = [SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(7)]
    mixed = [SamplingParams(max_tokens=9, temperature=[0.0, 0.7, 1.1][i % 3], top_k=[0, 20, 5][i % 3], seed=i,
                            min_p=0.05 * (i % 2), presence_penalty=0.5, frequency_penalty=0.3 * (i % 2),
                            repetition_penalty=1.0 + 0.2 * (i % 3), logit_bias={3: 2.0, 5: -1.0}, min_tokens=4,
                            logprobs=i % 4, stop_token_ids=[toks[2]]) for i, toks in enumerate(greedy)]
    for sps in (GRAPH_SPS, stops, seeded, mixed):
        want = [o.token_ids for o in sync.generate(GRAPH_PROMPTS, GRAPH_NAMES, sps)]
        assert [o.token_ids for o in llm.generate(GRAPH_PROMPTS, GRAPH_NAMES, sps)] == want
    assert llm.engine.num_overlapped > 0 and sync.engine.num_overlapped == 0
    assert llm.engine.pool.kv_pages == 0


def test_merging_policy_queues_only_while_its_decision_keeps_every_row_unmerged():
    """Under the vlora policy a decode is queued behind the one in flight while the policy keeps
    everything unmerged and runs every row; a decision that leaves a running row out falls back to the synchronous loop
    for that iteration. Tokens are the sync loop's either way."""
    from vlora.engine.modes import Mode
    from vlora.engine.orchestrator import Decision

    prompts, sps = requests(6, 4)
    want = [expected(p, sp) for p, sp in zip(prompts, sps)]
    llm = stub_llm(True, policy="vlora")
    assert [o.token_ids for o in llm.generate(prompts, None, sps)] == want
    assert llm.engine.num_overlapped > 0

    llm = stub_llm(True, policy="vlora")
    eng = llm.engine
    decide, lookahead = eng.orchestrator.plan, eng._lookahead
    left_out = []

    def first_row_waits(seqs, modes, registry):         # the first running request waits while others run
        d = decide(seqs, modes, registry)
        started = [s.request_id for s in seqs if s.output_token_ids]
        first = min(started, default=None)
        left_out.append(first is not None and len(seqs) > 1)
        return Decision(Mode.UNMERGED, None, tuple(r for r in d.batch if r != first) if left_out[-1] else d.batch)

    def queued(behind):
        plan = lookahead(behind)
        assert plan is None or not left_out[-1]          # queued only on a decision that runs every row
        return plan

    eng.orchestrator.plan, eng._lookahead = first_row_waits, queued
    assert [o.token_ids for o in llm.generate(prompts, None, sps)] == want
    assert any(left_out) and not eng.has_unfinished()
