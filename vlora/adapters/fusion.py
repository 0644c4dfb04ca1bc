"""Accuracy-aware knowledge fusion (V-LoRA §4.2.1): pack knowledge sources into the fewest LoRA adapters
such that every task still meets its accuracy requirement on its held-out split.

The loop, for sources in the chosen order::

    adapter = train(fresh, [s0])
    for s in rest:
        candidate = train(adapter, [s], replay=tasks already in adapter)
        if every task of adapter + s meets its requirement on candidate:  adapter = candidate   (fuse)
        else: close adapter at its last good state (rollback); adapter = train(fresh, [s])      (open)

A source that misses its requirement even alone keeps its own adapter, is
reported unmet, and nothing is fused into it. Training and evaluation are a
:class:`Trainer`'s business (``trainer.LoraTrainer``: PEFT LoRA on the served
model; the tests use a fake), so the loop fits on a screen and is tested
without a model. Every decision is journaled in the checkpoint directory
together with each adapter's last good state, so an interrupted run resumes at
the next source and ends exactly as an uninterrupted one.

The report also carries the two baselines of V-LoRA Fig. 5: one adapter per
source (the accuracy ceiling, most adapters) and one adapter for all sources
(fewest adapters, the accuracy floor). The per-source baseline reuses the solo
trainings the fusion already made (same seed, same data, same result).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vlora.adapters.sources import KnowledgeSource, check_unique

State = Any                     # a trainer's adapter weights; opaque to the loop
ORDERS = ("given", "random")
JOURNAL = "journal.json"
MANIFEST = "vlora_tasks.json"   # written into every output adapter: its tasks, prompts, labels, accuracy


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


@dataclass(frozen=True)
class FusionConfig:
    order: str = "given"
    """Order in which sources are fused: given (as listed) or random (seeded shuffle, as in V-LoRA)."""
    seed: int = 0
    """Seed of the random order and of every training run (each run's seed also depends on its task)."""
    baselines: bool = True
    """Also train the two baselines of V-LoRA Fig. 5: one adapter per source, and one adapter for all sources."""

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")


@dataclass
class Attempt:
    """One training run of the fusion loop and the accuracies it reached on the held-out splits."""

    adapter: int                    # 1-based index of the adapter trained
    source: str                     # the task trained into it
    kind: str                       # "open" (fresh adapter), "fuse" (kept) or "rollback" (violated, undone)
    accuracy: dict[str, float]      # every task of the adapter, including the new one
    train_s: float


@dataclass
class AdapterResult:
    name: str                       # directory name under the output folder
    tasks: list[str]
    accuracy: dict[str, float]      # held-out accuracy of each task on this adapter's final state
    size_bytes: int
    state_dir: str = ""             # checkpoint directory of the last good state


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
    adapters: list[AdapterResult]
    attempts: list[Attempt]
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    wall_s: float = 0.0
    out_dir: str = ""

    @property
    def requirement(self) -> dict[str, float]:
        return {s["task"]: s["requirement"] for s in self.sources}

    def met(self, accuracy: dict[str, float]) -> dict[str, bool]:
        return {t: meets(a, self.requirement[t]) for t, a in accuracy.items()}

    def fused_accuracy(self) -> dict[str, float]:
        return {t: a.accuracy[t] for a in self.adapters for t in a.tasks}

    @property
    def all_met(self) -> bool:
        return all(self.met(self.fused_accuracy()).values())

    @property
    def train_s(self) -> float:
        return sum(a.train_s for a in self.attempts)


def meets(accuracy: float, requirement: float) -> bool:
    return accuracy + 1e-9 >= requirement


def plan_order(sources: Sequence[KnowledgeSource], order: str, seed: int) -> list[KnowledgeSource]:
    out = list(sources)
    if order == "random":
        random.Random(f"order:{seed}").shuffle(out)
    return out


def run_seed(seed: int, *parts: str) -> int:
    """Seed of one training run: stable across resumes, the same for the same run in the fusion and a baseline."""
    return zlib.crc32(":".join((str(seed),) + parts).encode())


def fuse(sources: Sequence[KnowledgeSource], trainer: Trainer, out_dir: str | Path,
         config: FusionConfig = FusionConfig(), checkpoint_dir: str | Path | None = None,
         log: Callable[[str], None] = lambda m: None) -> FusionResult:
    """Run the fusion (and the baselines), write the adapters to ``out_dir/adapter-N``; return the result.
    ``checkpoint_dir`` (default ``out_dir/checkpoint``) holds the journal: rerunning resumes from it."""
    if not sources:
        raise ValueError("fusion needs at least one knowledge source")
    check_unique(sources)
    from vlora.adapters.report import write_report

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    ckpt = Checkpoint(Path(checkpoint_dir) if checkpoint_dir else out_dir / "checkpoint",
                      _identity(sources, trainer, config), log)
    order = plan_order(sources, config.order, config.seed)
    j = ckpt.journal
    adapters = [AdapterResult(**a) for a in j["adapters"]]
    attempts = [Attempt(**a) for a in j["attempts"]]
    by_task = {s.task: s for s in sources}
    state = trainer.load(ckpt.dir / adapters[-1].state_dir) if adapters and j["open"] else None
    for i in range(j["next"], len(order)):
        src = order[i]
        if state is not None:
            candidate = _try_fuse(trainer, state, src, adapters, attempts, by_task, config.seed, log)
            if candidate is not None:
                state = candidate
                ckpt.save_state(trainer, state, adapters[-1], len(attempts))
                ckpt.commit(adapters, attempts, i + 1, True)
                continue
        state = _open(trainer, src, len(adapters) + 1, config.seed, adapters, attempts, ckpt, by_task, log)
        if not meets(adapters[-1].accuracy[src.task], src.requirement):
            log(f"adapter-{len(adapters)}: {src.task} misses its requirement even alone; nothing is fused into it")
            state = None
        ckpt.commit(adapters, attempts, i + 1, state is not None)
    baselines = _baselines(sources, trainer, config, ckpt, log) if config.baselines else {}
    result = FusionResult(sources=[_describe(s) for s in sources], order=[s.task for s in order],
                          adapters=adapters, attempts=attempts, baselines=baselines,
                          settings={"trainer": trainer.settings(), "fusion": asdict(config)}, out_dir=str(out_dir))
    _export(result, trainer, ckpt, by_task, out_dir)
    result.wall_s = ckpt.prior_wall_s + time.perf_counter() - t0
    write_report(result, out_dir)
    return result


def _try_fuse(trainer, state, src, adapters, attempts, by_task, seed, log):
    """Train ``src`` into the open adapter; the new state if every task of it still meets its requirement
    (the adapter's entry is updated), else None (the adapter stays at ``state``: rollback)."""
    current = [by_task[t] for t in adapters[-1].tasks]
    t1 = time.perf_counter()
    candidate = trainer.fit(state, [src], current, run_seed(seed, "fuse", src.task),
                            f"adapter-{len(adapters)} + {src.task}")
    dt = time.perf_counter() - t1
    acc = _evaluate(trainer, candidate, current + [src])
    ok = all(meets(acc[s.task], s.requirement) for s in current + [src])
    attempts.append(Attempt(len(adapters), src.task, "fuse" if ok else "rollback", acc, dt))
    log(f"adapter-{len(adapters)} + {src.task}: {_fmt(acc, by_task)} -> "
        f"{'fused' if ok else 'requirement violated, rolled back'}")
    if not ok:
        return None
    adapters[-1] = AdapterResult(adapters[-1].name, adapters[-1].tasks + [src.task], acc,
                                 trainer.size_bytes(candidate))
    return candidate


def _open(trainer, src, index, seed, adapters, attempts, ckpt, by_task, log):
    """A fresh adapter trained on ``src`` alone; the same run as that source's per-source baseline."""
    t1 = time.perf_counter()
    state = trainer.fit(trainer.init(run_seed(seed, "init", src.task)), [src], [],
                        run_seed(seed, "solo", src.task), f"adapter-{index}: {src.task}")
    dt = time.perf_counter() - t1
    acc = _evaluate(trainer, state, [src])
    attempts.append(Attempt(index, src.task, "open", acc, dt))
    adapters.append(AdapterResult(f"adapter-{index}", [src.task], acc, trainer.size_bytes(state)))
    ckpt.save_state(trainer, state, adapters[-1], len(attempts))
    ckpt.journal["solo"][src.task] = {"accuracy": acc[src.task], "train_s": dt, "size_bytes": adapters[-1].size_bytes}
    log(f"adapter-{index} opened with {src.task}: {_fmt(acc, by_task)}")
    return state


def _baselines(sources, trainer, config, ckpt, log) -> dict[str, BaselineResult]:
    j = ckpt.journal
    for src in sources:             # one adapter per source: reuse the solo runs the fusion made
        if src.task not in j["solo"]:
            t1 = time.perf_counter()
            state = trainer.fit(trainer.init(run_seed(config.seed, "init", src.task)), [src], [],
                                run_seed(config.seed, "solo", src.task), f"baseline per-source: {src.task}")
            dt = time.perf_counter() - t1
            j["solo"][src.task] = {"accuracy": _evaluate(trainer, state, [src])[src.task], "train_s": dt,
                                   "size_bytes": trainer.size_bytes(state)}
            ckpt.write()
    solo = j["solo"]
    per_source = BaselineResult(len(sources), {s.task: solo[s.task]["accuracy"] for s in sources},
                                sum(solo[s.task]["train_s"] for s in sources),
                                sum(solo[s.task]["size_bytes"] for s in sources),
                                "the solo trainings the fusion made when it opened adapters are reused (same seed and "
                                "data), not repeated; their time is counted in both")
    if "all" not in j["baselines"]:
        t1 = time.perf_counter()
        state = trainer.fit(trainer.init(run_seed(config.seed, "init", "all")), list(sources), [],
                            run_seed(config.seed, "all"), "baseline all-in-one")
        dt = time.perf_counter() - t1
        acc = _evaluate(trainer, state, sources)
        j["baselines"]["all"] = asdict(BaselineResult(1, acc, dt, trainer.size_bytes(state)))
        ckpt.write()
        log(f"baseline all-in-one: {acc}")
    return {"per-source": per_source, "all-in-one": BaselineResult(**j["baselines"]["all"])}


def _evaluate(trainer, state, sources) -> dict[str, float]:
    out = {}
    for s in sources:
        hits = trainer.evaluate(state, s)
        if len(hits) != len(s.heldout):
            raise RuntimeError(f"trainer evaluated {len(hits)} answers for {len(s.heldout)} held-out examples "
                               f"of task {s.task!r}")
        out[s.task] = sum(map(bool, hits)) / len(hits)
    return out


def _export(result: FusionResult, trainer, ckpt, by_task, out_dir: Path) -> None:
    """Copy each adapter's last good state to ``out_dir/<name>`` with its task manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for a in result.adapters:
        dest = out_dir / a.name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(ckpt.dir / a.state_dir, dest)
        tasks = [{"task": t, "prompt": by_task[t].prompt, "labels": list(by_task[t].labels), "head": by_task[t].head,
                  "images": by_task[t].has_images, "requirement": by_task[t].requirement,
                  "accuracy": a.accuracy[t]} for t in a.tasks]
        _write_json(dest / MANIFEST, {"tasks": tasks})
    for stale in sorted(out_dir.glob("adapter-*")):      # adapters of an earlier run with other sources
        if stale.name not in {a.name for a in result.adapters} and (stale / MANIFEST).is_file():
            shutil.rmtree(stale)


def _describe(s: KnowledgeSource) -> dict:
    return {"task": s.task, "requirement": s.requirement, "origin": s.origin, "train": len(s.train),
            "heldout": len(s.heldout), "labels": list(s.labels), "prompt": s.prompt, "head": s.head,
            "images": s.has_images}


def _fmt(acc: dict[str, float], by_task) -> str:
    return ", ".join(f"{t} {a:.2f}/{by_task[t].requirement:.2f}" for t, a in acc.items())


def _identity(sources, trainer, config) -> dict:
    return {"sources": [s.fingerprint() for s in sources], "trainer": trainer.settings(), "fusion": asdict(config)}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class Checkpoint:
    """The journal (decisions so far, the next source, solo and baseline results) and the adapters' last good
    states. A journal made with other sources or settings is not resumed: it is started afresh."""

    def __init__(self, path: Path, identity: dict, log: Callable[[str], None]):
        self.dir = path
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        fresh = {"identity": identity, "adapters": [], "attempts": [], "next": 0, "open": False, "solo": {},
                 "baselines": {}, "wall_s": 0.0}
        self.journal = fresh
        self._t0 = time.perf_counter()
        self.prior_wall_s = 0.0         # wall time of the runs this one resumes
        file = self.dir / JOURNAL
        if file.is_file():
            try:
                old = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"{file}: checkpoint journal cannot be read ({e}); remove it to start afresh") \
                    from None
            if old.get("identity") == identity:
                self.journal = old
                self.prior_wall_s = float(old.get("wall_s", 0.0))
                log(f"resuming from {self.dir}: {old['next']} sources done, {len(old['adapters'])} adapters")
            else:
                log(f"{self.dir}: checkpoint of other sources or settings; starting afresh")
                for d in self.dir.iterdir():
                    if d.is_dir() and d.name.startswith("adapter-"):
                        shutil.rmtree(d)

    def save_state(self, trainer: Trainer, state: State, adapter: AdapterResult, step: int) -> None:
        """Write a new last good state beside the old one; the journal switches to it on :meth:`commit`."""
        adapter.state_dir = f"{adapter.name}.step{step}"
        path = self.dir / adapter.state_dir
        shutil.rmtree(path, ignore_errors=True)
        trainer.save(state, path)

    def commit(self, adapters: list[AdapterResult], attempts: list[Attempt], next_index: int, open_: bool) -> None:
        j = self.journal
        j.update(adapters=[asdict(a) for a in adapters], attempts=[asdict(a) for a in attempts],
                 next=next_index, open=open_)
        self.write()
        keep = {a.state_dir for a in adapters}
        for d in self.dir.iterdir():          # states no adapter points to any more
            if d.is_dir() and d.name.startswith("adapter-") and d.name not in keep:
                shutil.rmtree(d)

    def write(self) -> None:
        self.journal["wall_s"] = self.prior_wall_s + time.perf_counter() - self._t0
        _write_json(self.dir / JOURNAL, self.journal)
