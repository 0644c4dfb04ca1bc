"""End to end on a tiny random chat model: real PEFT LoRA training through the fusion loop, the adapters
registered in the engine, and the engine's greedy answers equal to the training-time evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.adapters.tiny import (assert_engine_answers_equal_evaluation, assert_sharing_changes_nothing,
                                make_tiny_chat_model, tiny_sources, train_and_fuse)
from vlora import LLM
from vlora.adapters.trainer import LoraTrainer, TrainConfig, engine_answers, prompt_ids

CONFIG = dict(epochs=20, lr=3e-3, batch_size=8, rank=8, threads=1, patience=0)     # the whole budget: known steps


@pytest.fixture(scope="module")
def fused(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("fusion")
    model, sources = make_tiny_chat_model(root), tiny_sources()
    trainer, result, out = train_and_fuse(root, model, sources, last_layers=1, **CONFIG)
    return model, sources, trainer, result, out


def test_fusion_packs_the_tasks_and_meets_every_requirement(fused):
    _, _, _, r, out = fused
    # farm and clash answer the same prompt oppositely: fusing clash into farm's adapter violates and rolls back
    assert [(a.adapter, a.source, a.kind) for a in r.attempts] == [
        (0, "farm", "alone"), (0, "clash", "alone"), (0, "hue", "alone"),
        (1, "farm", "open"), (1, "clash", "rollback"), (2, "clash", "open"), (2, "hue", "fuse")]
    assert [a.tasks for a in r.adapters] == [["farm"], ["clash", "hue"]]
    assert r.all_met and min(r.fused_accuracy().values()) >= 0.75
    assert r.baselines["per-source"].adapters == 3 and r.baselines["per-source"].size_bytes > 0
    assert not all(r.met(r.baselines["all-in-one"].accuracy).values())      # one adapter cannot serve all
    cfg = json.loads((out / "adapter-2" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["layers_to_transform"] == [1] and cfg["base_model_name_or_path"].endswith("tiny-chat")
    assert (out / "fusion-report.md").is_file() and json.loads((out / "fusion-report.json").read_text())["all_met"]


def test_engine_answers_equal_the_training_time_evaluation(fused):
    model, sources, trainer, r, out = fused
    by_task = {s.task: s for s in sources}
    llm = LLM(str(model), adapters={a.name: out / a.name for a in r.output}, num_blocks=256, block_size=8,
              max_model_len=128, dtype="float32")            # evaluation is float32 (a GPU engine defaults to bf16)
    assert_engine_answers_equal_evaluation(llm, trainer, r, by_task, out)
    # the base model does not answer the tasks; the adapters do
    base = engine_answers(llm, None, by_task["farm"])
    assert sum(b == e.label for b, e in zip(base, by_task["farm"].heldout)) < len(base) * 0.75
    # chat requests (the server's path) send the same prompt as training
    e = by_task["hue"].heldout[0]
    [out_chat] = llm.chat([{"role": "user", "content": by_task["hue"].message(e)}], "adapter-2")
    assert llm.apply_chat_template([{"role": "user", "content": "H red cow"}]) == prompt_ids(llm.tokenizer, "H red cow")
    assert out_chat.text == engine_answers(llm, "adapter-2", by_task["hue"], [e])[0]


def test_cached_prefix_changes_nothing(fused):
    """LoRA on the last layer only: training and evaluation run that layer over cached inputs; a trainer
    that runs every layer each step reaches the same weights and verdicts."""
    model, sources, trainer, _, _ = fused
    full = LoraTrainer(TrainConfig(model=str(model), last_layers=1, **CONFIG), progress=False)
    full.first = 0                                   # no cache: every layer runs each step
    src = sources[2]
    a = trainer.fit(trainer.init(5), [src], [], 5, "cached")
    b = full.fit(full.init(5), [src], [], 5, "uncached")
    assert all(torch.allclose(a.lora[k], b.lora[k], atol=1e-5) for k in a.lora)
    assert trainer.evaluate(a, src) == full.evaluate(a, src)


def test_shared_leading_tokens_run_once_with_the_same_results(fused):
    """A batch's leading tokens common to every example (chat template, prompt words) run once through a
    key-value cache: the hidden states, the loss's gradients and the verdicts equal the plain padded batch."""
    _, sources, trainer, result, out = fused
    assert_sharing_changes_nothing(trainer, sources, out / result.output[0].name)


def test_budget_is_the_steps_a_run_takes_without_early_stopping(fused):
    _, sources, trainer, r, _ = fused
    by_task = {s.task: s for s in sources}
    trained = [a for a in r.attempts if a.steps is not None]
    assert {a.kind for a in trained} >= {"alone", "fuse", "rollback"}
    for a in trained:
        replay = [by_task[t] for t in a.accuracy if t != a.source]
        assert a.steps == trainer.budget([by_task[a.source]], replay)


def test_early_stopping_ends_a_run_on_its_validation_split(fused):
    model, sources, _, _, _ = fused
    trainer = LoraTrainer(TrainConfig(model=str(model), last_layers=1, **{**CONFIG, "epochs": 60, "patience": 2,
                                                                             "min_steps": 100}),
                          progress=False)
    src = sources[2]
    train, val = trainer._splits(src)
    # the validation split comes out of the training split, per label, and never from the held-out split
    assert sorted(train + val, key=str) == sorted(src.train, key=str) and not set(val) & set(src.heldout)
    assert {e.label for e in val} == set(src.labels) and len(val) == round(0.2 * len(src.train))
    state = trainer.fit(trainer.init(5), [src], [], 5, "early")
    budget = 60 * math.ceil(len(train) / CONFIG["batch_size"])
    assert 0 < trainer.last_steps < budget == trainer.budget([src], [])
    assert sum(trainer.evaluate(state, src)) / len(src.heldout) >= src.requirement
