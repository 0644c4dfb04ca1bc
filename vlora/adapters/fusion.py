"""Accuracy-aware knowledge fusion (V-LoRA §4.2.1): pack knowledge sources into the fewest LoRA adapters
such that every task still meets its accuracy requirement on its held-out split.

The loop::

    every source is trained alone first                      (= the per-source baseline; reused, never repeated)
    for s in order (easiest first: highest solo accuracy above the requirement; sources missing it alone last):
        for adapter in the adapters so far, most recent first (s met alone: the first --tries; else all):
            candidate = train(adapter, [s], replay = the tasks adapter holds)
            if every task of adapter + s meets its requirement on candidate:  adapter = candidate; next s   (fuse)
            (else the candidate is dropped: rollback)
        s missed alone and fits nowhere: it joins the adapter where it scored best, if that kept the adapter's
            tasks met and s at least as accurate as alone (park); else
        s opens its own adapter with its solo weights                                                   (open)
    then the one-for-all baseline; the method meeting the most requirements (then: fewest adapters) is written

A source that misses its requirement alone is not given up: fusion can help
it (the other tasks' examples teach the adapter the answer format), so it is
tried in every adapter. Opening an adapter costs nothing (the solo run is
reused), so there are never more adapters than sources. Training and evaluation are a
:class:`Trainer`'s business (``trainer.LoraTrainer``: PEFT LoRA on the served
model; the tests use a fake), so the loop is tested without a model. Every
training run's outcome is journaled in the checkpoint directory under a key
naming what it trained (e.g. ``fuse:a+b+c``), with the weights the loop may
still need; a rerun replays the journal instead of training, so an interrupted
run resumes where it stopped and ends exactly as an uninterrupted one.

The report carries the two baselines of V-LoRA Fig. 5: one adapter per source
(the most adapters; not an accuracy ceiling: a source can do better fused
than alone) and one adapter for all sources (the fewest adapters; when it meets
as many requirements as the fusion, it wins).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vlora.adapters.sources import KnowledgeSource, check_unique, meets

State = Any                     # a trainer's adapter weights; opaque to the loop
ORDERS = ("easiest", "given", "random")
OUTPUTS = ("best", "fusion")
JOURNAL = "journal.json"
MANIFEST = "vlora_tasks.json"   # written into every output adapter: its tasks, prompts, labels, accuracy
METHOD_NAMES = {"fusion": "accuracy-aware fusion", "per-source": "one adapter per source",
                "all-in-one": "one adapter for all sources"}


class Trainer(Protocol):
    def init(self, seed: int) -> State:
        """Fresh adapter weights (seeded)."""

    def fit(self, state: State, new: Sequence[KnowledgeSource], replay: Sequence[KnowledgeSource],
            seed: int, desc: str) -> State:
        """Train a copy of ``state`` on the training split of ``new``, mixing in examples of ``replay`` (the
        tasks the adapter already holds) so it keeps them; ``state`` itself is left unchanged."""

    def evaluate(self, state: State, source: KnowledgeSource) -> list[bool]:
        """Per held-out example of ``source``: is the adapter's answer exactly the label."""

    def save(self, state: State, path: Path) -> None:
        """Write ``state`` as an adapter directory (PEFT format for real trainers)."""

    def load(self, path: Path) -> State:
        """Read back what :meth:`save` wrote."""

    def size_bytes(self, state: State) -> int:
        """Bytes of the adapter's weights."""

    def settings(self) -> dict:
        """JSON-able settings: part of the checkpoint's identity and of the report."""

    def budget(self, new: Sequence[KnowledgeSource], replay: Sequence[KnowledgeSource]) -> int:
        """Most optimizer steps :meth:`fit` takes on these sources: the unit of the time-left estimate."""


@dataclass(frozen=True)
class FusionConfig:
    order: str = "easiest"
    """Order in which sources are packed once each has been trained alone: easiest (highest held-out accuracy above its requirement alone first; sources missing it alone last), given (as listed) or random (seeded shuffle, as in V-LoRA)."""
    tries: int = 2
    """Adapters (most recently opened first) a source that meets its requirement alone is fused into before it opens its own; a source that misses it alone is tried in every adapter."""
    seed: int = 0
    """Seed of the random order and of every training run (each run's seed also depends on what it trains)."""
    baselines: bool = True
    """Also train one adapter for all sources (V-LoRA Fig. 5); the one-adapter-per-source baseline is the solo runs the fusion makes anyway."""
    output: str = "best"
    """Adapters written to --out: best (the method meeting the most requirements, then with the fewest adapters; the fusion on a tie) or fusion (the fusion's, even when a baseline wins)."""

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(OUTPUTS)}, got {self.output!r}")
        if not isinstance(self.tries, int) or isinstance(self.tries, bool) or self.tries < 1:
            raise ValueError(f"tries must be an integer >= 1, got {self.tries!r}")


@dataclass
class Attempt:
    """One step of the fusion loop and the held-out accuracies behind it."""

    adapter: int                    # 1-based index of the fusion's adapter concerned; 0 for a run alone
    source: str                     # the task trained (or placed)
    kind: str                       # alone, open, fuse, rollback (violated, undone) or park (see the module doc)
    accuracy: dict[str, float]      # every task of the adapter (or the source alone)
    train_s: float                  # 0 for steps that reuse a run (open, park)
    steps: int | None = None        # optimizer steps of its training run (None: reused, or not told)


@dataclass
class AdapterResult:
    name: str                       # directory name under the output folder
    tasks: list[str]
    accuracy: dict[str, float]      # held-out accuracy of each task on this adapter's final state
    size_bytes: int
    state_dir: str = ""             # checkpoint directory of its weights


@dataclass
class BaselineResult:
    adapters: int
    accuracy: dict[str, float]
    train_s: float
    size_bytes: int                 # all its adapters together
    note: str = ""


@dataclass
class FusionResult:
    sources: list[dict]             # per source: task, requirement, origin, sizes, labels, prompt
    order: list[str]
    adapters: list[AdapterResult]   # the fusion's
    attempts: list[Attempt]
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    wall_s: float = 0.0
    out_dir: str = ""
    best: str = "fusion"            # the method meeting the most requirements, then with the fewest adapters
    chosen: str = "fusion"          # the method whose adapters were written to out_dir
    output: list[AdapterResult] = field(default_factory=list)       # those adapters

    @property
    def requirement(self) -> dict[str, float]:
        return {s["task"]: s["requirement"] for s in self.sources}

    def met(self, accuracy: dict[str, float]) -> dict[str, bool]:
        return {t: meets(a, self.requirement[t]) for t, a in accuracy.items()}

    def fused_accuracy(self) -> dict[str, float]:
        return {t: a.accuracy[t] for a in self.adapters for t in a.tasks}

    def output_accuracy(self) -> dict[str, float]:
        return {t: a.accuracy[t] for a in self.output for t in a.tasks}

    @property
    def all_met(self) -> bool:
        """Every requirement met by the adapters written."""
        return all(self.met(self.output_accuracy()).values())

    @property
    def train_s(self) -> float:
        return sum(a.train_s for a in self.attempts)

    def unmet(self) -> dict[str, str]:
        """Why each task the written adapters miss is missed: what it reached alone, fused and in the baselines."""
        out = {}
        for t, acc in self.output_accuracy().items():
            req = self.requirement[t]
            if meets(acc, req):
                continue
            alone = next((a.accuracy[t] for a in self.attempts if a.kind == "alone" and a.source == t), None)
            fused = [f"adapter-{a.adapter} {a.accuracy[t]:.2f}" for a in self.attempts
                     if a.kind in ("fuse", "rollback") and a.source == t]
            parts = [f"needs {req:.2f}; gets {acc:.2f} in the written adapters"]
            if alone is not None:
                parts.append(f"{alone:.2f} trained alone")
            parts.append(f"fused into {', '.join(fused)}" if fused else "not tried in another adapter")
            parts += [f"{b.accuracy[t]:.2f} in {METHOD_NAMES[k]}" for k, b in self.baselines.items()
                      if k != "per-source" and t in b.accuracy]
            out[t] = "; ".join(parts)
        return out


def plan_order(sources: Sequence[KnowledgeSource], order: str, seed: int,
               alone: dict[str, float] | None = None) -> list[KnowledgeSource]:
    """The packing order. ``easiest``: by the held-out accuracy each source reached alone (``alone``) above
    its requirement, largest margin first, so sources missing it alone come last, when every adapter they
    can be tried in exists; ties keep the given order."""
    out = list(sources)
    if order == "random":
        random.Random(f"order:{seed}").shuffle(out)
    elif order == "easiest":
        if alone is None:
            raise ValueError("order 'easiest' needs each source's accuracy alone")
        out.sort(key=lambda s: -(alone[s.task] - s.requirement))
    return out


def run_seed(seed: int, *parts: str) -> int:
    """Seed of one training run: stable across resumes."""
    return zlib.crc32(":".join((str(seed),) + parts).encode())


@dataclass
class _Packed:
    """An adapter of the fusion being built: its tasks and the journaled run holding its weights."""

    index: int
    tasks: list[str]
    run: str
    accuracy: dict[str, float]


def fuse(sources: Sequence[KnowledgeSource], trainer: Trainer, out_dir: str | Path,
         config: FusionConfig = FusionConfig(), checkpoint_dir: str | Path | None = None,
         log: Callable[[str], None] = lambda m: None) -> FusionResult:
    """Run the fusion (and the baselines), write the chosen method's adapters to ``out_dir/adapter-N``;
    return the result. ``checkpoint_dir`` (default ``out_dir/checkpoint``) holds the journal: rerunning
    resumes from it."""
    if not sources:
        raise ValueError("fusion needs at least one knowledge source")
    check_unique(sources)
    from vlora.adapters.report import write_report

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    ckpt = Checkpoint(Path(checkpoint_dir) if checkpoint_dir else out_dir / "checkpoint",
                      _identity(sources, trainer, config), log)
    by_task = {s.task: s for s in sources}
    req = {s.task: s.requirement for s in sources}
    runs = _Runs(trainer, ckpt, log)
    for s in sources:           # the work expected: every solo run, one fusion try per source, the baseline
        runs.expect(f"alone:{s.task}", trainer.budget([s], []))
        runs.expect(f"place:{s.task}", trainer.budget([s], [s]))
    if config.baselines:
        runs.expect("all", trainer.budget(sources, []))
    attempts: list[Attempt] = []
    alone = {}
    for s in sources:
        e = runs.train(f"alone:{s.task}", lambda s=s: trainer.init(run_seed(config.seed, "init", s.task)), [s], [],
                       run_seed(config.seed, "solo", s.task), f"{s.task} alone")
        alone[s.task] = e
        attempts.append(Attempt(0, s.task, "alone", e["accuracy"], e["train_s"], e.get("steps")))
    order = plan_order(sources, config.order, config.seed, {t: e["accuracy"][t] for t, e in alone.items()})
    packed: list[_Packed] = []
    for s in order:
        runs.expect(f"place:{s.task}", 0.0)
        alone_acc = alone[s.task]["accuracy"][s.task]
        alone_ok = meets(alone_acc, s.requirement)
        park = None
        for p in (packed[::-1] if not alone_ok else packed[::-1][:config.tries]):
            key = f"fuse:{'+'.join(p.tasks)}+{s.task}"
            was_met = [t for t in p.tasks if meets(p.accuracy[t], req[t])]
            e = runs.train(key, lambda p=p: runs.state(p.run), [s], [by_task[t] for t in p.tasks],
                           run_seed(config.seed, "fuse", key), f"adapter-{p.index} + {s.task}")
            acc = e["accuracy"]
            kept = all(meets(acc[t], req[t]) for t in was_met)
            ok = kept and meets(acc[s.task], s.requirement)
            attempts.append(Attempt(p.index, s.task, "fuse" if ok else "rollback", acc, e["train_s"], e.get("steps")))
            log(f"adapter-{p.index} + {s.task}: {_fmt(acc, req)} -> "
                f"{'fused' if ok else 'requirement violated, rolled back'}")
            if ok:
                p.tasks, p.run, p.accuracy = p.tasks + [s.task], key, acc
                break
            if not alone_ok and kept and acc[s.task] + 1e-9 >= alone_acc and \
                    (park is None or acc[s.task] > park[2][s.task]):
                park = (p, key, acc)
        else:
            if park is not None:        # misses everywhere: join the adapter where it does best, one adapter fewer
                p, key, acc = park
                p.tasks, p.run, p.accuracy = p.tasks + [s.task], key, acc
                attempts.append(Attempt(p.index, s.task, "park", acc, 0.0))
                log(f"adapter-{p.index} takes {s.task}, which misses its requirement everywhere, at "
                    f"{acc[s.task]:.2f} (alone {alone_acc:.2f}): one adapter fewer, its other tasks still met")
            else:
                packed.append(_Packed(len(packed) + 1, [s.task], f"alone:{s.task}", alone[s.task]["accuracy"]))
                attempts.append(Attempt(len(packed), s.task, "open", alone[s.task]["accuracy"], 0.0))
                log(f"adapter-{len(packed)} opened with {s.task} (its solo run): {_fmt(alone[s.task]['accuracy'], req)}"
                    + ("" if alone_ok else " -- misses its requirement alone and in every other adapter"))
    adapters = [AdapterResult(f"adapter-{p.index}", p.tasks, p.accuracy, runs.entry(p.run)["size_bytes"],
                              runs.entry(p.run)["state"]) for p in packed]
    per_source = [AdapterResult(f"adapter-{i}", [s.task], alone[s.task]["accuracy"], alone[s.task]["size_bytes"],
                                alone[s.task]["state"]) for i, s in enumerate(sources, 1)]
    candidates = {"fusion": adapters, "per-source": per_source}
    baselines = {"per-source": BaselineResult(len(sources), {t: e["accuracy"][t] for t, e in alone.items()},
                                              sum(e["train_s"] for e in alone.values()),
                                              sum(e["size_bytes"] for e in alone.values()),
                                              "the solo runs the fusion starts from (trained once, counted in both)")}
    if config.baselines:
        e = runs.train("all", lambda: trainer.init(run_seed(config.seed, "init", "all")), list(sources), [],
                       run_seed(config.seed, "all"), "all sources in one adapter")
        baselines["all-in-one"] = BaselineResult(1, e["accuracy"], e["train_s"], e["size_bytes"])
        candidates["all-in-one"] = [AdapterResult("adapter-1", [s.task for s in sources], e["accuracy"],
                                                  e["size_bytes"], e["state"])]
    best = max(candidates, key=lambda m: _rank(candidates[m], req))       # max keeps the first (fusion) on ties
    chosen = best if config.output == "best" else "fusion"
    if best != "fusion":
        log(f"the baseline '{METHOD_NAMES[best]}' beats the fusion ({_summary(candidates[best], req)} against "
            f"{_summary(adapters, req)}); " + ("its adapters are written" if chosen == best else
                                                "the fusion's adapters are written (--output fusion)"))
    result = FusionResult(sources=[_describe(s) for s in sources], order=[s.task for s in order],
                          adapters=adapters, attempts=attempts, baselines=baselines,
                          settings={"trainer": trainer.settings(), "fusion": asdict(config)}, out_dir=str(out_dir),
                          best=best, chosen=chosen, output=candidates[chosen])
    _export(result, ckpt, by_task, out_dir)
    ckpt.drop_states_but({a.state_dir for method in candidates.values() for a in method})
    result.wall_s = ckpt.prior_wall_s + time.perf_counter() - t0
    ckpt.write()
    write_report(result, out_dir)
    return result


def _rank(adapters: list[AdapterResult], req: dict[str, float]) -> tuple:
    acc = [a.accuracy[t] for a in adapters for t in a.tasks]
    met = sum(meets(a.accuracy[t], req[t]) for a in adapters for t in a.tasks)
    return met, -len(adapters), sum(acc) / len(acc)


def _summary(adapters: list[AdapterResult], req: dict[str, float]) -> str:
    met, n, _ = _rank(adapters, req)
    return f"{met}/{len(req)} requirements met with {-n} adapter{'s' * (n != -1)}"


class _Runs:
    """Training runs, journaled by key: a run already in the journal is not repeated (its outcome is read
    back), so a rerun after an interruption replays the decisions and trains only what is missing. The time
    left is the step budgets of the runs still expected (every solo run, one try per source to place, the
    one-for-all baseline) at the seconds per budget step so far: early stopping ends most runs before their
    budget, about as much in the runs done as in those to come; extra tries (a rollback, a source missing its
    requirement alone, which is tried in every adapter) cannot be foreseen and make it an underestimate."""

    def __init__(self, trainer: Trainer, ckpt: Checkpoint, log: Callable[[str], None]):
        self.trainer, self.ckpt, self.log = trainer, ckpt, log
        self.expected: dict[str, float] = {}        # work still expected, by what it is for
        self.trained, self.spent, self.done = 0, 0.0, 0.0
        self._states: dict[str, State] = {}

    def expect(self, what: str, work: float) -> None:
        self.expected[what] = work

    def entry(self, key: str) -> dict:
        return self.ckpt.journal["runs"][key]

    def state(self, key: str) -> State:
        if key not in self._states:
            self._states[key] = self.trainer.load(self.ckpt.dir / self.entry(key)["state"])
        return self._states[key]

    def train(self, key: str, base: Callable[[], State], new: list[KnowledgeSource],
              replay: list[KnowledgeSource], seed: int, desc: str) -> dict:
        runs = self.ckpt.journal["runs"]
        self.expected.pop(key, None)
        if key in runs:
            return runs[key]
        t1 = time.perf_counter()
        state = self.trainer.fit(base(), new, replay, seed, desc)
        dt = time.perf_counter() - t1
        accuracy = _evaluate(self.trainer, state, replay + new)
        folder = f"run-{len(runs) + 1}"
        shutil.rmtree(self.ckpt.dir / folder, ignore_errors=True)
        self.trainer.save(state, self.ckpt.dir / folder)
        self._states[key] = state
        steps = getattr(self.trainer, "last_steps", None)         # optimizer steps, if the trainer tells
        runs[key] = {"accuracy": accuracy, "train_s": dt, "size_bytes": self.trainer.size_bytes(state),
                     "state": folder, "steps": steps,
                     "validation": getattr(self.trainer, "last_history", None)}    # (step, accuracy, loss) per check
        self.ckpt.write()
        self.trained, self.spent = self.trained + 1, self.spent + dt
        self.done += self.trainer.budget(new, replay)
        left = sum(self.expected.values()) * self.spent / max(self.done, 1)
        self.log(f"[{desc}: {dt:.0f} s{'' if steps is None else f', {steps} steps'}; {self.trained} runs trained in "
                 f"{self.spent / 60:.1f} min, about {left / 60:.1f} min left]")
        return runs[key]


def _evaluate(trainer, state, sources) -> dict[str, float]:
    out = {}
    for s in sources:
        hits = trainer.evaluate(state, s)
        if len(hits) != len(s.heldout):
            raise RuntimeError(f"trainer evaluated {len(hits)} answers for {len(s.heldout)} held-out examples "
                               f"of task {s.task!r}")
        out[s.task] = sum(map(bool, hits)) / len(hits)
    return out


def _export(result: FusionResult, ckpt: Checkpoint, by_task, out_dir: Path) -> None:
    """Copy the chosen adapters' weights to ``out_dir/<name>`` with their task manifests."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for a in result.output:
        dest = out_dir / a.name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(ckpt.dir / a.state_dir, dest)
        tasks = [{"task": t, "prompt": by_task[t].prompt, "labels": list(by_task[t].labels), "head": by_task[t].head,
                  "images": by_task[t].has_images, "requirement": by_task[t].requirement,
                  "accuracy": a.accuracy[t]} for t in a.tasks]
        _write_json(dest / MANIFEST, {"tasks": tasks})
    for stale in sorted(out_dir.glob("adapter-*")):      # adapters of an earlier run with other sources
        if stale.name not in {a.name for a in result.output} and (stale / MANIFEST).is_file():
            shutil.rmtree(stale)


def _describe(s: KnowledgeSource) -> dict:
    return {"task": s.task, "requirement": s.requirement, "origin": s.origin, "train": len(s.train),
            "heldout": len(s.heldout), "labels": list(s.labels), "prompt": s.prompt, "head": s.head,
            "images": s.has_images}


def _fmt(acc: dict[str, float], req: dict[str, float]) -> str:
    return ", ".join(f"{t} {a:.2f}/{req[t]:.2f}" for t, a in acc.items())


def _identity(sources, trainer, config) -> dict:
    fusion = {k: v for k, v in asdict(config).items() if k != "output"}     # what is written, not what is trained
    return {"sources": [s.fingerprint() for s in sources], "trainer": trainer.settings(), "fusion": fusion}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class Checkpoint:
    """The journal (every training run's outcome, by key, and the folder of its weights). A journal made with
    other sources or settings is not resumed: it is started afresh."""

    def __init__(self, path: Path, identity: dict, log: Callable[[str], None]):
        self.dir = path
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = {"identity": identity, "runs": {}, "wall_s": 0.0}
        self._t0 = time.perf_counter()
        self.prior_wall_s = 0.0         # wall time of the runs this one resumes
        file = self.dir / JOURNAL
        if file.is_file():
            try:
                old = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"{file}: checkpoint journal cannot be read ({e}); remove it to start afresh") \
                    from None
            if old.get("identity") == identity and isinstance(old.get("runs"), dict):
                self.journal = old
                self.prior_wall_s = float(old.get("wall_s", 0.0))
                log(f"resuming from {self.dir}: {len(old['runs'])} training runs done")
            else:
                log(f"{self.dir}: checkpoint of other sources or settings; starting afresh")
                for d in self.dir.iterdir():
                    if d.is_dir() and d.name.startswith(("run-", "adapter-")):
                        shutil.rmtree(d)

    def drop_states_but(self, keep: set[str]) -> None:
        """Delete the weights no method's adapters use (rolled-back candidates, states fused further)."""
        for entry in self.journal["runs"].values():
            if entry["state"] and entry["state"] not in keep:
                shutil.rmtree(self.dir / entry["state"], ignore_errors=True)
                entry["state"] = None
        self.write()

    def write(self) -> None:
        self.journal["wall_s"] = self.prior_wall_s + time.perf_counter() - self._t0
        _write_json(self.dir / JOURNAL, self.journal)
