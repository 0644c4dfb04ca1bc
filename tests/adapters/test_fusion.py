"""The fusion loop with a fake trainer: rollback on violation, new adapters, requirements, resume, baselines,
and the report's contents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlora.adapters.fusion import FusionConfig, fuse, plan_order
from vlora.adapters.report import REPORT_JSON, REPORT_MD
from vlora.adapters.sources import Example, make_source


def source(task: str, requirement: float = 0.8, n: int = 40):
    return make_source(task, requirement, [Example(f"{task} {i}", "ab"[i % 2]) for i in range(n)])


class FakeTrainer:
    """An adapter state is the tuple of tasks trained into it. A task's held-out accuracy is 1.0, minus
    ``drop`` for every other task in the adapter, and 0.5 when a task it conflicts with is in it too."""

    def __init__(self, drop: float = 0.0, conflicts=(), solo: dict | None = None, crash_after: int | None = None):
        self.drop, self.conflicts, self.solo = drop, {frozenset(c) for c in conflicts}, solo or {}
        self.crash_after = crash_after
        self.fits: list[tuple[tuple, tuple, tuple]] = []        # (state, new, replay)

    def init(self, seed):
        return ()

    def fit(self, state, new, replay, seed, desc):
        if self.crash_after is not None and len(self.fits) >= self.crash_after:
            raise KeyboardInterrupt("simulated crash")
        self.fits.append((state, tuple(s.task for s in new), tuple(s.task for s in replay)))
        return state + tuple(s.task for s in new)

    def accuracy(self, state, task):
        if any(frozenset((task, other)) in self.conflicts for other in state if other != task):
            return 0.5
        return self.solo.get(task, 1.0) - self.drop * (len(state) - 1)

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


def saved(out: Path, name: str) -> list[str]:
    return json.loads((out / name / "state.json").read_text())


def test_violation_rolls_back_and_opens_a_new_adapter(tmp_path):
    sources = [source("a"), source("b"), source("c"), source("d")]
    trainer = FakeTrainer(conflicts=[("a", "c")])
    r = fuse(sources, trainer, tmp_path, FusionConfig(baselines=False))
    assert [(a.adapter, a.source, a.kind) for a in r.attempts] == [
        (1, "a", "open"), (1, "b", "fuse"), (1, "c", "rollback"), (2, "c", "open"), (2, "d", "fuse")]
    assert [a.tasks for a in r.adapters] == [["a", "b"], ["c", "d"]]
    assert r.attempts[2].accuracy == {"a": 0.5, "b": 1.0, "c": 0.5}       # what the violating candidate reached
    assert saved(tmp_path, "adapter-1") == ["a", "b"]                       # the last good state, not a+b+c
    assert saved(tmp_path, "adapter-2") == ["c", "d"]
    # fusing trains the last good state on the new source while replaying the tasks it holds
    assert trainer.fits == [((), ("a",), ()), (("a",), ("b",), ("a",)), (("a", "b"), ("c",), ("a", "b")),
                            ((), ("c",), ()), (("c",), ("d",), ("c",))]
    assert r.all_met and r.fused_accuracy() == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}
    manifest = json.loads((tmp_path / "adapter-2" / "vlora_tasks.json").read_text())
    assert [t["task"] for t in manifest["tasks"]] == ["c", "d"] and manifest["tasks"][0]["requirement"] == 0.8


def test_capacity_limits_each_adapter_and_every_requirement_holds(tmp_path):
    # each extra task costs every task 0.1 accuracy; requirement 0.75 -> at most 3 tasks per adapter
    sources = [source(t, 0.75) for t in "abcdefg"]
    r = fuse(sources, FakeTrainer(drop=0.1), tmp_path, FusionConfig(baselines=False))
    assert [a.tasks for a in r.adapters] == [list("abc"), list("def"), ["g"]]
    assert r.all_met and all(a >= 0.75 for a in r.fused_accuracy().values())
    assert [a.kind for a in r.attempts].count("rollback") == 2


def test_stricter_requirement_packs_fewer_tasks(tmp_path):
    sources = [source(t, 0.75) for t in "abcd"] + [source("e", 0.95)]
    r = fuse(sources, FakeTrainer(drop=0.1), tmp_path, FusionConfig(baselines=False))
    assert [a.tasks for a in r.adapters] == [list("abc"), ["d"], ["e"]]     # d+e would put e at 0.9 < 0.95
    assert r.all_met


def test_source_missing_its_requirement_alone_keeps_its_own_adapter(tmp_path):
    sources = [source("a"), source("hard", 0.9), source("b")]
    r = fuse(sources, FakeTrainer(solo={"hard": 0.6}), tmp_path, FusionConfig(baselines=False))
    assert [a.tasks for a in r.adapters] == [["a"], ["hard"], ["b"]]
    assert [a.kind for a in r.attempts] == ["open", "rollback", "open", "open"]   # nothing fused into "hard"
    assert not r.all_met and r.met(r.fused_accuracy()) == {"a": True, "hard": False, "b": True}
    md = (tmp_path / REPORT_MD).read_text()
    assert "every requirement met: **NO**" in md and "| hard | 0.90 | adapter-2 | 0.600 FAIL |" in md
    assert "| 3 | adapter-2 | hard | opened adapter (misses its requirement alone: closed) |" in md


def test_random_order_is_a_seeded_permutation():
    sources = [source(t) for t in "abcdefgh"]
    orders = {s: [x.task for x in plan_order(sources, "random", s)] for s in range(4)}
    assert all(sorted(o) == list("abcdefgh") for o in orders.values())
    assert orders[1] == [x.task for x in plan_order(sources, "random", 1)]
    assert len({tuple(o) for o in orders.values()}) > 1
    assert [x.task for x in plan_order(sources, "given", 3)] == list("abcdefgh")
    with pytest.raises(ValueError, match="order must be one of"):
        FusionConfig(order="best")


def test_random_order_decides_the_packing(tmp_path):
    sources = [source(t) for t in "abcdef"]
    cfg = FusionConfig(order="random", seed=1, baselines=False)
    r = fuse(sources, FakeTrainer(conflicts=[("a", "b")]), tmp_path, cfg)
    assert r.order == [x.task for x in plan_order(sources, "random", 1)] and r.order != list("abcdef")
    assert r.attempts[0].source == r.order[0]
    assert sorted(t for a in r.adapters for t in a.tasks) == list("abcdef")


def test_interrupted_run_resumes_where_it_stopped(tmp_path):
    sources = [source(t, 0.75) for t in "abcdef"]
    first = FakeTrainer(drop=0.1)
    full = fuse(sources, first, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        fuse(sources, FakeTrainer(drop=0.1, crash_after=4), tmp_path / "part")
    again = FakeTrainer(drop=0.1)
    resumed = fuse(sources, again, tmp_path / "part")
    assert [a.tasks for a in resumed.adapters] == [a.tasks for a in full.adapters]
    assert [(a.adapter, a.source, a.kind) for a in resumed.attempts] == \
        [(a.adapter, a.source, a.kind) for a in full.attempts]
    # the crash came in "open d", after the rollback of d: the resumed run starts from adapter-1's last good
    # state (a, b, c), redoes the uncommitted rollback and skips the three committed runs
    assert again.fits[0] == (("a", "b", "c"), ("d",), ("a", "b", "c"))
    assert len(first.fits) == 12 and len(again.fits) == 12 - 3
    assert saved(tmp_path / "part", "adapter-1") == ["a", "b", "c"]
    # a finished run reruns for free
    rerun = FakeTrainer(drop=0.1)
    fuse(sources, rerun, tmp_path / "part")
    assert rerun.fits == []


def test_checkpoint_of_other_sources_is_not_resumed(tmp_path):
    fuse([source("a"), source("b")], FakeTrainer(), tmp_path)
    other = FakeTrainer()
    r = fuse([source("a"), source("c")], other, tmp_path)
    assert [a.tasks for a in r.adapters] == [["a", "c"]] and len(other.fits) == 4
    assert sorted(p.name for p in tmp_path.glob("adapter-*")) == ["adapter-1"]


def test_baselines_and_report(tmp_path):
    sources = [source("a"), source("b"), source("c", 0.6)]
    trainer = FakeTrainer(drop=0.1, conflicts=[("a", "b")])
    r = fuse(sources, trainer, tmp_path)
    assert [a.tasks for a in r.adapters] == [["a"], ["b", "c"]]
    per, alone = r.baselines["per-source"], r.baselines["all-in-one"]
    assert per.adapters == 3 and per.accuracy == {"a": 1.0, "b": 1.0, "c": 1.0} and per.size_bytes == 3000
    assert alone.adapters == 1 and alone.accuracy == {"a": 0.5, "b": 0.5, "c": 0.8}
    # solo runs of a, b (opened adapters) are reused; c was only fused, so the per-source baseline trains it
    assert [f for f in trainer.fits if f[0] == ()] == [((), ("a",), ()), ((), ("b",), ()), ((), ("c",), ()),
                                                        ((), ("a", "b", "c"), ())]
    j = json.loads((tmp_path / REPORT_JSON).read_text())
    assert j["all_met"] is True and j["order"] == ["a", "b", "c"]
    assert j["adapters"] == [{"name": "adapter-1", "tasks": ["a"], "accuracy": {"a": 1.0}, "size_bytes": 1000},
                             {"name": "adapter-2", "tasks": ["b", "c"], "accuracy": {"b": 0.9, "c": 0.9},
                              "size_bytes": 1000}]
    m = j["methods"]
    assert (m["fusion"]["adapters"], m["per-source"]["adapters"], m["all-in-one"]["adapters"]) == (2, 3, 1)
    assert m["fusion"]["all_met"] and m["per-source"]["all_met"] and not m["all-in-one"]["all_met"]
    assert m["all-in-one"]["met"] == {"a": False, "b": False, "c": True}
    assert [a["kind"] for a in j["attempts"]] == ["open", "rollback", "open", "fuse"]
    assert all(a["train_s"] >= 0 for a in j["attempts"]) and j["wall_s"] >= j["train_s"] >= 0
    assert j["sources"][2] == {"task": "c", "requirement": 0.6, "origin": "examples", "train": 30, "heldout": 10,
                               "labels": ["a", "b"], "prompt": "{text}", "head": False, "images": False}
    md = (tmp_path / REPORT_MD).read_text()
    assert "3 knowledge sources -> **2 adapters**; every requirement met: **yes**" in md
    assert "| accuracy-aware fusion | 2 | 3/3 |" in md and "| one adapter per source | 3 | 3/3 |" in md
    assert "| one adapter for all sources | 1 | 1/3 | 0.600 |" in md
    assert "| b | 0.80 | adapter-2 | 0.900 ok | 1.000 ok | 0.500 FAIL |" in md
    assert "| 2 | adapter-1 | b | violation: rolled back | a 0.500 FAIL, b 0.500 FAIL |" in md
    assert 'fusion: {"order": "given", "seed": 0, "baselines": true}' in md


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
