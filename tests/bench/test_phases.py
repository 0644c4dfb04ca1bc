"""PhaseTimer: each step's phases add up to its wall time, decode-only steps are told apart, and closing it puts
the engine's methods back."""

from __future__ import annotations

import pytest

from tests.engine.test_async_scheduling import stub_llm
from vlora import SamplingParams
from vlora.bench.phases import PHASES, PhaseTimer, format_summary
from vlora.engine import sampler


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_phases_add_up_and_are_undone(async_scheduling):
    llm = stub_llm(async_scheduling)
    eng = llm.engine
    before = (eng.step, eng._schedule, eng.runner.sampler.sample, sampler.Sampled.result, eng.runner.graphs.run)
    timer = PhaseTimer(eng)
    llm.generate([[5, 6, 7]] * 4, None, SamplingParams(max_tokens=8, ignore_eos=True))
    timer.close()
    assert (eng.step, eng._schedule, eng.runner.sampler.sample, sampler.Sampled.result,
            eng.runner.graphs.run) == before
    assert "step" not in vars(eng) and "_schedule" not in vars(eng) and "sample" not in vars(eng.runner.sampler)
    steps = timer.steps
    assert steps and not steps[0]["decode_only"] and steps[-1]["decode_only"]
    for s in steps:
        # the gap is the wrappers' own time, plus any preemption of this thread on a busy CPU (CI runs two
        # workers on two cores): far below a step, never a missing phase
        assert sum(s.get(p, 0.0) for p in PHASES) == pytest.approx(s["wall"], abs=2e-3)
    summary = timer.summary(4)
    assert summary["steps"] >= 5 and summary["stage+replay_us"] > 0 and summary["schedule_us"] > 0
    assert "finish" in format_summary(summary) and timer.summary(3) == {}
