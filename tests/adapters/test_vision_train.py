"""Image tasks and task heads, end to end on a tiny random LLaVA: PEFT LoRA on the language model and a task head
trained jointly through the fusion loop, the adapters registered in the engine, and the engine's answers
(``LLM.classify`` for head tasks, greedy text otherwise) equal to the training-time evaluation."""

from __future__ import annotations

import json

import pytest
import torch

from tests.adapters.tiny import (assert_engine_answers_equal_evaluation, assert_sharing_changes_nothing,
                                make_tiny_chat_llava, make_tiny_chat_model, tiny_image_sources, train_and_fuse)
from vlora import LLM
from vlora.adapters.trainer import Head, LoraTrainer, TrainConfig, _TrainableHead

CONFIG = dict(epochs=12, lr=3e-3, batch_size=8, rank=8, threads=1, last_layers=1, patience=0)


@pytest.fixture(scope="module")
def fused(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("vision-fusion")
    model, sources = make_tiny_chat_llava(root), tiny_image_sources(root / "images")
    trainer, result, out = train_and_fuse(root, model, sources, **CONFIG)
    return model, sources, trainer, result, out


def test_image_tasks_fuse_with_a_joint_head(fused):
    _, sources, _, r, out = fused
    assert r.all_met, r.fused_accuracy()
    by_task = {s.task: s for s in sources}
    for a in r.output:
        head_tasks = [t for t in a.tasks if by_task[t].head]
        files = {p.name for p in (out / a.name).iterdir()}
        if not head_tasks:
            assert "vlora_head.json" not in files
            continue
        # one head per adapter over the sorted union of its head tasks' labels
        cfg = json.loads((out / a.name / "vlora_head.json").read_text())
        assert cfg == {"labels": sorted({lab for t in head_tasks for lab in by_task[t].labels}), "token": "last"}
        manifest = json.loads((out / a.name / "vlora_tasks.json").read_text())
        assert {t["task"]: t["head"] for t in manifest["tasks"]} == {t: by_task[t].head for t in a.tasks}
    adapter_cfg = json.loads((out / r.output[0].name / "adapter_config.json").read_text())
    assert "language_model" in adapter_cfg["target_modules"]          # the vision tower gets no LoRA
    assert "head" in json.loads((out / "fusion-report.json").read_text())["sources"][0]


def test_engine_answers_equal_the_training_time_evaluation(fused):
    model, sources, trainer, r, out = fused
    by_task = {s.task: s for s in sources}
    llm = LLM(str(model), adapters={a.name: out / a.name for a in r.output}, num_blocks=256, block_size=8,
              max_model_len=128, dtype="float32")
    assert set(llm.engine.adapters.heads) == {a.name for a in r.output if any(by_task[t].head for t in a.tasks)}
    assert_engine_answers_equal_evaluation(llm, trainer, r, by_task, out)


def test_shared_leading_tokens_run_once_with_the_same_results(fused):
    _, sources, trainer, result, out = fused
    assert_sharing_changes_nothing(trainer, sources, out / result.output[0].name)


def test_head_growth_and_standardised_training_keep_the_linear_map():
    g = torch.Generator().manual_seed(0)
    head = Head(("no", "yes"), torch.randn(2, 6, generator=g), torch.randn(2, generator=g))
    mu, sigma = torch.randn(6, generator=g), torch.rand(6, generator=g) + 0.1
    t = _TrainableHead(head, mu, sigma)
    h = torch.randn(5, 6, generator=g)
    torch.testing.assert_close(t.scores(h), h @ head.weight.T + head.bias)
    back = t.export()
    torch.testing.assert_close(back.weight, head.weight)
    torch.testing.assert_close(back.bias, head.bias)

    trainer = LoraTrainer.__new__(LoraTrainer)            # _grow_head needs only these two attributes
    trainer.hidden_size, trainer.device = 6, torch.device("cpu")
    src = type("S", (), {"labels": ("blue", "red", "yes")})()
    grown = trainer._grow_head(head, [src])
    assert grown.labels == ("blue", "no", "red", "yes")
    torch.testing.assert_close(grown.weight[[1, 3]], head.weight)
    assert not grown.weight[[0, 2]].any() and not grown.bias[[0, 2]].any()
    assert trainer._grow_head(None, []) is None


def test_image_tasks_are_refused_on_a_text_model(tmp_path, one_thread):
    model = make_tiny_chat_model(tmp_path)
    trainer = LoraTrainer(TrainConfig(model=str(model), **CONFIG), progress=False)
    with pytest.raises(ValueError, match="has image inputs but model .* reads text only"):
        trainer.check(tiny_image_sources(tmp_path / "images", n=4))
