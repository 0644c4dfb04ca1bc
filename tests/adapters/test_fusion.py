"""The fusion loop with a fake trainer: solo runs first, rollback on violation, new adapters, sources missing
their requirement alone retried in the other adapters, the easiest-first order, baselines that win, resume,
and the report's contents."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from vlora.adapters.fusion import FusionConfig, fuse, meets, plan_order
from vlora.adapters.report import REPORT_JSON, REPORT_MD
from vlora.adapters.sources import Example, make_source

JOINT = "*joint"        # marks a state trained on several sources at once (the one-for-all baseline)


def source(task: str, requirement: float = 0.8, n: int = 40):
    return make_source(task, requirement, [Example(f"{task} {i}", "ab"[i % 2]) for i in range(n)])


class FakeTrainer:
    """An adapter state is the tuple of tasks trained into it. A task's held-out accuracy is ``solo`` (1.0
    unless given) alone; with other tasks it is ``fused`` (default: its solo accuracy) minus ``drop`` for
    every other task in the adapter, ``joint`` when trained together with all of them at once, and 0.5 when a
    task it conflicts with is in it too."""

    def __init__(self, drop: float = 0.0, conflicts=(), solo: dict | None = None, fused: dict | None = None,
                 joint: dict | None = None, crash_after: int | None = None):
        self.drop, self.conflicts = drop, {frozenset(c) for c in conflicts}
        self.solo, self.fused, self.joint = solo or {}, fused or {}, joint or {}
        self.crash_after = crash_after
        self.fits: list[tuple[tuple, tuple, tuple]] = []        # (state, new, replay)

    def init(self, seed):
        return ()

    def fit(self, state, new, replay, seed, desc):
        if self.crash_after is not None and len(self.fits) >= self.crash_after:
            raise KeyboardInterrupt("simulated crash")
        self.fits.append((state, tuple(s.task for s in new), tuple(s.task for s in replay)))
        return state + tuple(s.task for s in new) + ((JOINT,) if len(new) > 1 else ())

    def accuracy(self, state, task):
        tasks = [t for t in state if t != JOINT]
        if any(frozenset((task, other)) in self.conflicts for other in tasks if other != task):
            return 0.5
        if len(tasks) == 1:
            return self.solo.get(task, 1.0)
        if JOINT in state and task in self.joint:
            return self.joint[task]
        return self.fused.get(task, self.solo.get(task, 1.0)) - self.drop * (len(tasks) - 1)

    def evaluate(self, state, source):
        n = len(source.heldout)
        k = round(self.accuracy(state, source.task) * n) if source.task in state else 0
        return [True] * k + [False] * (n - k)

    def save(self, state, path: Path):
        path.mkdir(parents=True)
        (path / "state.json").write_text(json.dumps(list(state)))

    def load(self, path: Path):
        return tuple(json.loads((path / "state.json").read_text()))

    def size_bytes(self, state):
        return 1000

    def settings(self):
        return {"fake": True}

    def budget(self, new, replay):
        """One step per example of a pass: the new sources' and as many replayed."""
        fresh = sum(len(s.train) for s in new)
        return fresh + min(fresh, sum(len(s.train) for s in replay))


def saved(out: Path, name: str) -> list[str]:
    return json.loads((out / name / "state.json").read_text())


def solo_fits(tasks):
    return [((), (t,), ()) for t in tasks]


def test_violation_rolls_back_and_opens_a_new_adapter(tmp_path):
    sources = [source("a"), source("b"), source("c"), source("d")]
    trainer = FakeTrainer(conflicts=[("a", "c")])
    r = fuse(sources, trainer, tmp_path, FusionConfig(order="given", baselines=False))
    assert [(a.adapter, a.source, a.kind) for a in r.attempts] == [
        (0, "a", "alone"), (0, "b", "alone"), (0, "c", "alone"), (0, "d", "alone"),
        (1, "a", "open"), (1, "b", "fuse"), (1, "c", "rollback"), (2, "c", "open"), (2, "d", "fuse")]
    assert [a.tasks for a in r.adapters] == [["a", "b"], ["c", "d"]]
    assert r.attempts[6].accuracy == {"a": 0.5, "b": 1.0, "c": 0.5}       # what the violating candidate reached
    assert saved(tmp_path, "adapter-1") == ["a", "b"]                       # the last good state, not a+b+c
    assert saved(tmp_path, "adapter-2") == ["c", "d"]                       # c's solo run, then d fused
    # every source alone first (reused when it opens an adapter); fusing trains the last good state on the
    # new source while replaying the tasks it holds
    assert trainer.fits == solo_fits("abcd") + [(("a",), ("b",), ("a",)), (("a", "b"), ("c",), ("a", "b")),
                                                (("c",), ("d",), ("c",))]
    assert r.all_met and r.fused_accuracy() == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}
    manifest = json.loads((tmp_path / "adapter-2" / "vlora_tasks.json").read_text())
    assert [t["task"] for t in manifest["tasks"]] == ["c", "d"] and manifest["tasks"][0]["requirement"] == 0.8


def test_a_source_is_tried_in_earlier_adapters_too(tmp_path):
    # d conflicts with c (in the newest adapter) but fits the first one; with tries=1 it would open a third
    sources = [source(t) for t in "abcd"]
    trainer = FakeTrainer(conflicts=[("a", "c"), ("c", "d")])
    r = fuse(sources, trainer, tmp_path / "two", FusionConfig(order="given", tries=2, baselines=False))
    assert [a.tasks for a in r.adapters] == [["a", "b", "d"], ["c"]]
    assert [(a.adapter, a.kind) for a in r.attempts if a.source == "d"] == [(0, "alone"), (2, "rollback"), (1, "fuse")]
    one = fuse(sources, FakeTrainer(conflicts=[("a", "c"), ("c", "d")]), tmp_path / "one",
               FusionConfig(order="given", tries=1, baselines=False))
    assert [a.tasks for a in one.adapters] == [["a", "b"], ["c"], ["d"]]


def test_capacity_limits_each_adapter_and_every_requirement_holds(tmp_path):
    # each extra task costs every task 0.1 accuracy; requirement 0.75 -> at most 3 tasks per adapter
    sources = [source(t, 0.75) for t in "abcdefg"]
    r = fuse(sources, FakeTrainer(drop=0.1), tmp_path, FusionConfig(order="given", baselines=False))
    assert [a.tasks for a in r.adapters] == [list("abc"), list("def"), ["g"]]
    assert r.all_met and all(a >= 0.75 for a in r.fused_accuracy().values())


def test_stricter_requirement_packs_fewer_tasks(tmp_path):
    sources = [source(t, 0.75) for t in "abcd"] + [source("e", 0.95)]
    r = fuse(sources, FakeTrainer(drop=0.1), tmp_path, FusionConfig(order="given", tries=1, baselines=False))
    assert [a.tasks for a in r.adapters] == [list("abc"), ["d"], ["e"]]     # d+e would put e at 0.9 < 0.95
    assert r.all_met


def test_source_failing_alone_is_retried_in_the_open_adapters(tmp_path):
    # "hard" misses 0.9 alone (0.6) but reaches it next to other tasks; it is packed last and fused
    sources = [source("hard", 0.9), source("a"), source("b")]
    trainer = FakeTrainer(conflicts=[("a", "b")], solo={"hard": 0.6}, fused={"hard": 0.9})
    r = fuse(sources, trainer, tmp_path, FusionConfig(baselines=False))
    assert r.order == ["a", "b", "hard"]                                     # easiest first, failing alone last
    assert [a.tasks for a in r.adapters] == [["a"], ["b", "hard"]]
    assert [(a.adapter, a.kind) for a in r.attempts if a.source == "hard"] == [(0, "alone"), (2, "fuse")]
    assert r.all_met and r.fused_accuracy()["hard"] == 0.9
    assert r.unmet() == {}


def test_source_missing_everywhere_is_reported_with_the_reason(tmp_path):
    sources = [source("a"), source("hard", 0.9), source("b", 0.9)]
    trainer = FakeTrainer(drop=0.1, solo={"hard": 0.6}, fused={"hard": 0.6})
    r = fuse(sources, trainer, tmp_path, FusionConfig(baselines=False))
    # a+b would drop both to 0.9: fine for b (0.9), and a needs 0.8; hard is tried in every adapter and misses
    assert [a.tasks for a in r.adapters] == [["a", "b"], ["hard"]]
    assert [(a.adapter, a.kind) for a in r.attempts if a.source == "hard"] == [(0, "alone"), (1, "rollback"),
                                                                              (2, "open")]
    assert not r.all_met and r.met(r.fused_accuracy()) == {"a": True, "b": True, "hard": False}
    why = r.unmet()["hard"]
    assert "needs 0.90" in why and "0.60 trained alone" in why and "fused into adapter-1 0.40" in why
    md = (tmp_path / REPORT_MD).read_text()
    assert "every requirement met: **NO**" in md and "| hard | 0.90 | adapter-2 | 0.600 FAIL |" in md
    assert "## Requirements not met" in md and f"- **hard**: {why}" in md


def test_source_missing_everywhere_joins_the_adapter_where_it_does_best(tmp_path):
    # fused, "hard" gets 0.7: still short of 0.9, but better than alone (0.6) and a keeps its requirement
    sources = [source("a"), source("hard", 0.9)]
    r = fuse(sources, FakeTrainer(solo={"hard": 0.6}, fused={"hard": 0.7}), tmp_path, FusionConfig(baselines=False))
    assert [a.tasks for a in r.adapters] == [["a", "hard"]]
    assert [a.kind for a in r.attempts] == ["alone", "alone", "open", "rollback", "park"]
    assert r.fused_accuracy() == {"a": 1.0, "hard": 0.7} and saved(tmp_path, "adapter-1") == ["a", "hard"]


def test_easiest_order_and_random_order():
    sources = [source("a", 0.5), source("b", 0.9), source("c", 0.6), source("d", 0.8)]
    alone = {"a": 0.7, "b": 0.8, "c": 1.0, "d": 1.0}
    assert [s.task for s in plan_order(sources, "easiest", 0, alone)] == ["c", "a", "d", "b"]
    with pytest.raises(ValueError, match="needs each source's accuracy alone"):
        plan_order(sources, "easiest", 0)
    sources = [source(t) for t in "abcdefgh"]
    orders = {s: [x.task for x in plan_order(sources, "random", s)] for s in range(4)}
    assert all(sorted(o) == list("abcdefgh") for o in orders.values())
    assert orders[1] == [x.task for x in plan_order(sources, "random", 1)]
    assert len({tuple(o) for o in orders.values()}) > 1
    assert [x.task for x in plan_order(sources, "given", 3)] == list("abcdefgh")
    for bad in (dict(order="best"), dict(output="all"), dict(tries=0)):
        with pytest.raises(ValueError, match="must be"):
            FusionConfig(**bad)


def test_a_baseline_that_wins_is_reported_and_written(tmp_path):
    # "hard" misses alone and fused one by one, but reaches 0.9 trained jointly with the others at once
    sources = [source("a"), source("b"), source("hard", 0.9)]
    trainer = FakeTrainer(solo={"hard": 0.6}, joint={"hard": 0.9})
    logs = []
    r = fuse(sources, trainer, tmp_path / "best", log=logs.append)
    assert [a.tasks for a in r.adapters] == [["a", "b", "hard"]]          # parked: 0.6 fused, as alone
    assert r.best == r.chosen == "all-in-one" and r.all_met
    assert [a.tasks for a in r.output] == [["a", "b", "hard"]]
    assert "*joint" in saved(tmp_path / "best", "adapter-1")             # the baseline's weights are written
    assert any("baseline 'one adapter for all sources' beats the fusion (3/3 requirements met with 1 adapter "
               "against 2/3 requirements met with 1 adapter)" in m for m in logs)
    j = json.loads((tmp_path / "best" / REPORT_JSON).read_text())
    assert j["best"] == j["written"] == "all-in-one" and j["all_met"] and j["unmet"] == {}
    assert "**The baseline 'one adapter for all sources' beats the fusion**" in (tmp_path / "best" / REPORT_MD).read_text()
    keep = fuse(sources, FakeTrainer(solo={"hard": 0.6}, joint={"hard": 0.9}), tmp_path / "fusion",
                FusionConfig(output="fusion"))
    assert keep.best == "all-in-one" and keep.chosen == "fusion" and not keep.all_met
    assert "*joint" not in saved(tmp_path / "fusion", "adapter-1")


@pytest.mark.parametrize("case", range(24))
def test_never_more_adapters_than_sources_nor_fewer_met_than_a_baseline(tmp_path, case):
    rng = random.Random(case)
    tasks = [f"t{i}" for i in range(rng.randint(1, 7))]
    sources = [source(t, rng.choice([0.6, 0.8, 0.9])) for t in tasks]
    pairs = [(a, b) for i, a in enumerate(tasks) for b in tasks[i + 1:]]
    trainer = FakeTrainer(drop=rng.choice([0.0, 0.05, 0.1]), conflicts=rng.sample(pairs, min(len(pairs), rng.randint(0, 3))),
                          solo={t: rng.choice([0.5, 0.7, 1.0]) for t in tasks},
                          fused={t: rng.choice([0.5, 0.8, 1.0]) for t in tasks},
                          joint={t: rng.choice([0.5, 1.0]) for t in tasks})
    cfg = FusionConfig(order=rng.choice(["easiest", "given", "random"]), tries=rng.randint(1, 3), seed=case)
    r = fuse(sources, trainer, tmp_path, cfg)
    assert len(r.adapters) <= r.baselines["per-source"].adapters == len(sources)
    assert sorted(t for a in r.adapters for t in a.tasks) == sorted(tasks)
    written = sum(r.met(r.output_accuracy()).values())
    assert all(written >= sum(r.met(b.accuracy).values()) for b in r.baselines.values())
    # a source that meets its requirement alone keeps meeting it in the fusion
    alone = {a.source: a.accuracy[a.source] for a in r.attempts if a.kind == "alone"}
    fused = r.fused_accuracy()
    assert all(meets(fused[s.task], s.requirement) for s in sources if meets(alone[s.task], s.requirement))


def test_interrupted_run_resumes_where_it_stopped(tmp_path):
    sources = [source(t, 0.75) for t in "abcdef"]
    first = FakeTrainer(drop=0.1)
    full = fuse(sources, first, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        fuse(sources, FakeTrainer(drop=0.1, crash_after=8), tmp_path / "part")
    again = FakeTrainer(drop=0.1)
    resumed = fuse(sources, again, tmp_path / "part")
    assert [a.tasks for a in resumed.adapters] == [a.tasks for a in full.adapters]
    assert [(a.adapter, a.source, a.kind, a.accuracy) for a in resumed.attempts] == \
        [(a.adapter, a.source, a.kind, a.accuracy) for a in full.attempts]
    assert again.fits == first.fits[8:]             # the 8 journaled runs are not repeated
    assert saved(tmp_path / "part", "adapter-1") == saved(tmp_path / "full", "adapter-1")
    # a finished run reruns for free
    rerun = FakeTrainer(drop=0.1)
    fuse(sources, rerun, tmp_path / "part")
    assert rerun.fits == []


def test_checkpoint_of_other_sources_is_not_resumed(tmp_path):
    fuse([source("a"), source("b")], FakeTrainer(conflicts=[("a", "b")]), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("adapter-*")) == ["adapter-1", "adapter-2"]
    other = FakeTrainer()
    r = fuse([source("a"), source("c")], other, tmp_path)
    assert [a.tasks for a in r.adapters] == [["a", "c"]] and len(other.fits) == 4
    assert sorted(p.name for p in tmp_path.glob("adapter-*")) == ["adapter-1"]


def test_baselines_and_report(tmp_path):
    sources = [source("a"), source("b"), source("c", 0.6)]
    trainer = FakeTrainer(drop=0.1, conflicts=[("a", "b")])
    r = fuse(sources, trainer, tmp_path, FusionConfig(order="given"))
    assert [a.tasks for a in r.adapters] == [["a"], ["b", "c"]]           # c tries the newest adapter first
    per, alone = r.baselines["per-source"], r.baselines["all-in-one"]
    assert per.adapters == 3 and per.accuracy == {"a": 1.0, "b": 1.0, "c": 1.0} and per.size_bytes == 3000
    assert alone.adapters == 1 and alone.accuracy == {"a": 0.5, "b": 0.5, "c": 0.8}
    # the solo runs are the per-source baseline; the one-for-all baseline trains every source at once
    assert [f for f in trainer.fits if f[0] == ()] == solo_fits("abc") + [((), ("a", "b", "c"), ())]
    j = json.loads((tmp_path / REPORT_JSON).read_text())
    assert j["all_met"] is True and j["order"] == ["a", "b", "c"] and j["best"] == j["written"] == "fusion"
    assert j["adapters"] == [{"name": "adapter-1", "tasks": ["a"], "accuracy": {"a": 1.0}, "size_bytes": 1000},
                             {"name": "adapter-2", "tasks": ["b", "c"], "accuracy": {"b": 0.9, "c": 0.9},
                              "size_bytes": 1000}]
    m = j["methods"]
    assert (m["fusion"]["adapters"], m["per-source"]["adapters"], m["all-in-one"]["adapters"]) == (2, 3, 1)
    assert m["fusion"]["all_met"] and m["per-source"]["all_met"] and not m["all-in-one"]["all_met"]
    assert m["all-in-one"]["met"] == {"a": False, "b": False, "c": True}
    assert [a["kind"] for a in j["attempts"]] == ["alone"] * 3 + ["open", "rollback", "open", "fuse"]
    assert all(a["train_s"] >= 0 for a in j["attempts"]) and j["wall_s"] >= j["train_s"] >= 0
    assert j["sources"][2] == {"task": "c", "requirement": 0.6, "origin": "examples", "train": 30, "heldout": 10,
                               "labels": ["a", "b"], "prompt": "{text}", "head": False, "images": False}
    md = (tmp_path / REPORT_MD).read_text()
    assert "3 knowledge sources -> **2 adapters** (accuracy-aware fusion); every requirement met: **yes**" in md
    assert "| accuracy-aware fusion (written) | 2 | 3/3 |" in md and "| one adapter per source | 3 | 3/3 |" in md
    assert "| one adapter for all sources | 1 | 1/3 | 0.600 |" in md
    assert "| b | 0.80 | adapter-2 | 0.900 ok | 1.000 ok | 0.500 FAIL |" in md
    assert "| 5 | adapter-1 | b | violation: rolled back | a 0.500 FAIL, b 0.500 FAIL |" in md
    assert 'fusion: {"order": "given", "tries": 2, "seed": 0, "baselines": true, "output": "best"}' in md
    # only the weights some method's adapters use stay in the checkpoint
    assert len(list((tmp_path / "checkpoint").glob("run-*"))) == 3 + 1 + 1


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least one knowledge source"):
        fuse([], FakeTrainer(), tmp_path)
    with pytest.raises(ValueError, match="given twice"):
        fuse([source("a"), source("a")], FakeTrainer(), tmp_path)

    class Short(FakeTrainer):
        def evaluate(self, state, source):
            return [True]
    with pytest.raises(RuntimeError, match="1 answers for 10 held-out examples"):
        fuse([source("a")], Short(), tmp_path / "short")
    (tmp_path / "bad" / "checkpoint").mkdir(parents=True)
    (tmp_path / "bad" / "checkpoint" / "journal.json").write_text("{oops")
    with pytest.raises(ValueError, match="journal cannot be read"):
        fuse([source("a")], FakeTrainer(), tmp_path / "bad")


def test_early_stop_progress_is_a_better_accuracy_and_the_loss_breaks_a_tie_once():
    from vlora.adapters.trainer import EarlyStop

    stop = EarlyStop([0.8, 0.8], patience=3)
    assert stop.check([0.5, 0.5], 1.0) and stop.waited == 0
    assert stop.check([0.5, 0.5], 0.5) and stop.waited == 0            # the best accuracy again, clearly lower loss:
    assert stop.check([0.5, 0.5], 0.2) and stop.waited == 1            # progress once, not twice (a tie keeps the
    assert not stop.check([0.5, 0.4], 0.1) and stop.waited == 2        # later weights); a worse accuracy: none,
    assert stop.check([0.9, 0.7], 0.3) and stop.waited == 0            # whatever its loss; a better one: progress,
    assert stop.check([0.9, 0.7], 0.05) and stop.waited == 0           # and the loss may break a tie once again
    assert stop.check([0.9, 0.7], 0.049) and stop.waited == 1          # (not by less than 1%)
    assert stop.check([0.9, 0.9], 0.2) and stop.waited == 0            # every task met now:
    assert stop.check([0.9, 0.9], 0.01) and stop.waited == 1           # a lower loss breaks no tie
    assert not stop.check([1.0, 0.7], 0.3) and stop.waited == 2        # a worse mean is not kept
    assert stop.check([0.95, 0.95], 0.3) and stop.waited == 0
    stop = EarlyStop([0.8, 0.8], patience=3)
    assert stop.check([0.5, 0.5], 1.0) and stop.waited == 0
    assert stop.check([1.0, 1.0], 0.02) and stop.waited == 3           # perfect: cannot get better, the run ends


def test_a_task_that_never_meets_its_requirement_does_not_keep_a_run_going_on_its_falling_loss():
    """The one-for-all run's failure: one task stays below its requirement on validation, the others are
    learnt, the mean accuracy stays flat and the loss keeps falling; the run ends after ``patience`` checks."""
    from vlora.adapters.trainer import EarlyStop

    stop = EarlyStop([0.85] * 3, patience=3)
    stop.check([0.9, 0.9, 0.5], 1.0)
    waited = []
    for i in range(1, 10):
        stop.check([1.0, 1.0, 0.5], 1.0 / (i + 1))
        waited.append(stop.waited)
    assert waited[:5] == [0, 0, 1, 2, 3]        # better once, then the loss breaks one tie, then nothing counts


def test_time_left_is_the_budgets_still_expected_at_the_rate_so_far(tmp_path, monkeypatch):
    """Each run's log line estimates the time left from the seconds per budget step so far over the step
    budgets of the runs still expected: every solo run, one try per source to place, the one-for-all baseline."""
    import vlora.adapters.fusion as fusion

    clock = [0.0]
    monkeypatch.setattr(fusion.time, "perf_counter", lambda: clock[0])

    class Timed(FakeTrainer):           # 6 s a step; every run stops at half its budget: 3 s per budget step
        def fit(self, state, new, replay, seed, desc):
            clock[0] += 6 * self.budget(new, replay) / 2
            return super().fit(state, new, replay, seed, desc)

    sources = [source("a", n=40), source("b", n=80), source("c", n=40)]      # 30, 60, 30 training examples
    logs = []
    fuse(sources, Timed(), tmp_path, FusionConfig(order="given"), log=logs.append)
    left = [float(m.split("about ")[1].split(" min")[0]) for m in logs if "min left" in m]
    # after a's solo run: the solo runs of b and c, a try for each source (a's is not needed: it
    # opens adapter-1), the baseline over all 120 examples
    assert left[0] == round((60 + 30 + 60 + 120 + 60 + 120) * 3 / 60, 1)
    assert left[-1] == 0.0 and len(left) == 6 and left == sorted(left, reverse=True)


def test_idle_cores_leave_busy_cores_alone():
    from vlora.adapters.trainer import idle_cores

    assert idle_cores(2, 0.1) == 2 and idle_cores(2, 1.2) == 1 and idle_cores(2, 7.5) == 1 and idle_cores(16, 3.6) == 12
