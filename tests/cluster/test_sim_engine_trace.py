"""The simulator's replica schedules as the engine does: the same trace of arrivals through a real engine (tiny
model, CPU, adapters in the pool on the kernel path) and through a :class:`SimReplica` with the engine's limits
gives the same chunks every iteration (request, first token, token count), the same preemptions, the same
adapter loads and the same finishes."""

from __future__ import annotations

import random

import pytest

from tests.models.test_parity import build
from vlora import LLM, SamplingParams
from vlora.bench.workloads import RequestSpec
from vlora.cluster.costs import ReplicaLimits, linear_table
from vlora.cluster.sim import SimReplica, SimRequest

ADAPTERS = {"a0": "a8", "a1": "a16", "a2": "a8", "a3": "a16"}     # name -> checkpoint (its rank)
RANK = {"a8": 8, "a16": 16}


def trace(seed: int, n: int = 14) -> list[tuple[int, RequestSpec]]:
    """(iteration it arrives before, request): prompts from 3 to 40 tokens (some longer than the 16-token budget,
    so chunked), 2 to 24 output tokens, adapters and the base model mixed."""
    rng = random.Random(seed)
    out, step = [], 0
    for _ in range(n):
        step += rng.choice((0, 0, 1, 2, 4))
        out.append((step, RequestSpec(0.0, rng.choice((None, "a0", "a1", "a2", "a3")), rng.randint(3, 40),
                                      rng.randint(2, 24))))
    return out


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    path, paths, _ = build(tmp_path_factory.mktemp("simtrace"))

    def make(hand_back: bool, bound: int | None = None, chunks: int | None = None):
        llm = LLM(str(path), adapters={a: paths[c] for a, c in ADAPTERS.items()}, num_blocks=6, block_size=4,
                  max_model_len=128, lora_kernel="triton", max_loras=1, max_lora_rank=16, max_num_seqs=3,
                  max_num_batched_tokens=16, max_prefill_tokens_with_decodes=bound, device="cpu", dtype="float32")
        eng = llm.engine
        eng.scheduler.max_chunks_with_decodes = chunks        # as where mixed CUDA graphs replay such iterations
        eng.hand_back_preempted = hand_back
        # the tokens do not change a schedule (ignore_eos): the forward is left out, which keeps the test fast
        eng.executor.run = lambda scheduled: {s.seq.request_id: 7 for s in scheduled if s.samples}
        return eng
    return make


def record(scheduler) -> list:
    """Every output of ``scheduler.schedule`` from now on: (chunks as (request, first token, token count),
    preempted requests, truncated requests)."""
    plans = []
    schedule = scheduler.schedule

    def recording(eligible=None):
        out = schedule(eligible)
        plans.append(([(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled],
                      [s.request_id for s in out.preempted], [s.request_id for s in out.truncated]))
        return out
    scheduler.schedule = recording
    return plans


def engine_log(eng, arrivals) -> list:
    """Per iteration: the schedule, the adapter loads so far, the requests finished "length" (and their tokens)."""
    plans, log, step, pending = record(eng.scheduler), [], 0, list(arrivals)
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, spec = pending.pop(0)
            eng.add_request(list(range(3, 3 + spec.input_len)), spec.adapter,
                            SamplingParams(max_tokens=spec.output_len, ignore_eos=True), request_id=rid)
        if not eng.has_unfinished():                    # idle until the next arrival
            step += 1
            continue
        outs = eng.step()
        assert len(plans) == len(log) + 1               # unmerged: one schedule per step
        log.append((plans[-1], eng.adapters.store.num_loads,
                    sorted((o.request_id, len(o.token_ids)) for o in outs if o.finish_reason == "length")))
        step += 1
        assert step < 500
    eng.pool.check()
    return log


def sim_log(rep: SimReplica, arrivals) -> list:
    plans, log, step, pending, now = record(rep.scheduler), [], 0, list(arrivals), 0.0
    while pending or rep.has_work:
        while pending and pending[0][0] <= step:
            _, rid, spec = pending.pop(0)
            rep.add(SimRequest(rid, spec, RANK[ADAPTERS[spec.adapter]] if spec.adapter else 0, now))
        if not rep.has_work:
            step += 1
            continue
        end = rep.start(now, fast_forward=False)
        if end is not None:
            now = end
            rep.complete(now)
        assert len(plans) == len(log) + 1
        assert sorted(r.request_id for r in rep.left) == sorted(plans[-1][1]) or not rep.hand_back
        log.append((plans[-1], rep.store.num_loads,
                    sorted((r.request_id, r.generated) for r in rep.finished if r.finish_reason == "length")))
        rep.left.clear()
        rep.finished.clear()
        step += 1
        assert step < 500
    rep.pool.check()
    return log


def compare(make_engine, seed: int, hand_back: bool, **bounds) -> list:
    """The engine's log of ``trace(seed)``, after checking that the simulator's log equals it. ``bounds``: the
    engine's bound on prompt tokens (``bound``) and chunks (``chunks``) beside decodes."""
    eng = make_engine(hand_back, **bounds)
    pages = {RANK[c]: eng.adapters.store.pages_needed(eng.adapters.get(a)) for a, c in ADAPTERS.items()}
    sc = eng.scheduler.config
    limits = ReplicaLimits(num_pages=eng.pool.num_pages, page_tokens=eng.block_size,
                           max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                           adapter_pages=pages, max_prefill_tokens_with_decodes=sc.max_prefill_tokens_with_decodes,
                           max_chunks_with_decodes=eng.scheduler.max_chunks_with_decodes)
    table = linear_table(limits, 0.010, 0.001, 0.002, 0.005, adapter_load_s={8: 0.003, 16: 0.004})
    arrivals = [(step, f"r{i}", spec) for i, (step, spec) in enumerate(trace(seed))]
    want = engine_log(eng, arrivals)
    got = sim_log(SimReplica(0, table, limits.max_num_seqs, hand_back=hand_back), arrivals)
    assert got == want
    return want


@pytest.mark.parametrize("seed,hand_back", [(0, False), (2, True), (3, False)])
def test_sim_replica_schedules_as_the_engine_on_a_recorded_trace(engine_factory, seed, hand_back):
    want = compare(engine_factory, seed, hand_back)
    # the trace went through the hard cases: chunked prefills, preemptions, every adapter loaded (the pool holds
    # two at most, so some were evicted)
    assert any(0 < start < 40 and n > 1 for (chunks, _, _), _, _ in want for _, start, n in chunks)
    assert any(preempted for (_, preempted, _), _, _ in want)
    assert want[-1][1] >= len(ADAPTERS)


@pytest.mark.parametrize("hand_back", [False, True])
def test_sim_replica_schedules_as_the_engine_on_more_traces(engine_factory, hand_back):
    for seed in range(4, 16):
        compare(engine_factory, seed, hand_back)


@pytest.mark.parametrize("hand_back", [False, True])
def test_sim_replica_bounds_prompts_beside_decodes_as_the_engine(engine_factory, hand_back):
    """With at most 6 prompt tokens and 1 prompt chunk beside decodes (the bound of mixed CUDA graphs, made
    small), the simulator still schedules every iteration as the engine."""
    logs = [compare(engine_factory, seed, hand_back, bound=6, chunks=1) for seed in range(4)]
    decoding = [chunks for log in logs for (chunks, _, _), _, _ in log if any(n == 1 for _, _, n in chunks)]
    assert decoding and all(sum(n for _, _, n in c if n > 1) <= 6 for c in decoding)
    assert all(sum(1 for _, _, n in c if n > 1) <= 1 for c in decoding)
    assert any(0 < sum(n for _, _, n in c if n > 1) for c in decoding)        # prompts did go beside decodes

