"""The demo adapters shipped with vlora (``vlora/adapters/demo_weights/``): served by the engine on the embedded
model, they still reach the held-out accuracy their fusion report states."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vlora import LLM, SamplingParams
from vlora.adapters.demo import SHIPPED, demo_sources, ship, trained_adapters
from vlora.adapters.report import REPORT_JSON
from vlora.adapters.trainer import prompt_ids
from vlora.cli import _demo_adapters

MODEL = "SmolLM2-135M-Instruct"


def test_serve_falls_back_to_the_shipped_adapters(tmp_path, capsys):
    engine = SimpleNamespace(adapters=SimpleNamespace(shape=SimpleNamespace(name=MODEL)))
    adapters, trained = _demo_adapters(engine, tmp_path / "nothing-built")
    assert trained and adapters == trained_adapters(SHIPPED / MODEL)
    assert set(adapters) == {"demo-sentiment", "demo-topic-language"}
    assert f"serving the trained demo adapters demo-sentiment, demo-topic-language (from {SHIPPED / MODEL}" \
        in capsys.readouterr().err


def test_ship_writes_float16_weights_and_drops_the_build_paths(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    build, local = tmp_path / "build", "/home/me/.cache/vlora/gguf/abc/tiny"
    (build / "adapter-1").mkdir(parents=True)
    (build / "checkpoint").mkdir()
    save_file({"a": torch.ones(2, 3)}, str(build / "adapter-1" / "adapter_model.safetensors"))
    (build / "adapter-1" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": local}))
    (build / "adapter-1" / "README.md").write_text("model card")
    report = {"adapters": [{"name": "adapter-1", "tasks": ["sentiment"]}], "settings": {"trainer": {"model_path": local}}}
    (build / REPORT_JSON).write_text(json.dumps(report))
    (build / "fusion-report.md").write_text(f"trainer: {local}")
    folder = ship(build, "tiny", tmp_path / "shipped")
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "adapter-1/adapter_config.json", "adapter-1/adapter_model.safetensors", "fusion-report.json",
        "fusion-report.md"]
    assert load_file(str(folder / "adapter-1" / "adapter_model.safetensors"))["a"].dtype == torch.float16
    assert json.loads((folder / "adapter-1" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    assert (folder / "fusion-report.md").read_text() == "trainer: tiny"
    assert trained_adapters(folder) == {"demo-sentiment": str(folder / "adapter-1")}
    with pytest.raises(ValueError, match="holds no finished demo build"):
        ship(tmp_path / "empty", "tiny", tmp_path / "shipped")


@pytest.mark.slow
def test_shipped_adapters_reach_their_reported_heldout_accuracy():
    folder = SHIPPED / MODEL
    adapters = trained_adapters(folder)
    report = json.loads((folder / REPORT_JSON).read_text(encoding="utf-8"))
    assert report["all_met"] and "demo-sentiment" in adapters
    assert sorted(t for a in report["adapters"] for t in a["tasks"]) == ["language", "sentiment", "topic"]
    assert sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file()) < 4 * 2**20
    llm = LLM(adapters=adapters, kv_cache_memory_gb=0.25, dtype="float32")      # the report's accuracy is float32
    assert llm.engine.model_name == MODEL
    by_task, described = {s.task: s for s in demo_sources()}, {s["task"]: s for s in report["sources"]}
    # every held-out question through its adapter, and the sentiment ones through the base model, in one batch
    asked = [("demo-" + "-".join(a["tasks"]), by_task[t], a["accuracy"][t]) for a in report["adapters"]
             for t in a["tasks"]] + [(None, by_task["sentiment"], None)]
    jobs = [(name, source, e) for name, source, _ in asked for e in source.heldout[:8 if name is None else None]]
    outs = llm.generate([prompt_ids(llm.tokenizer, source.message(e)) for _, source, e in jobs],
                        [name for name, _, _ in jobs], SamplingParams(max_tokens=4, temperature=0.0))
    answers = iter(o.text for o in outs)
    for name, source, stated in asked:
        # the same built-in examples and split as the build
        assert (len(source.train), len(source.heldout)) == (described[source.task]["train"],
                                                            described[source.task]["heldout"])
        examples = source.heldout[:8 if name is None else None]
        got = [next(answers) for _ in examples]
        accuracy = sum(g == e.label for g, e in zip(got, examples)) / len(got)
        if name is None:
            assert accuracy < 0.5, got              # the base model does not answer the task; the adapter does
        else:
            assert accuracy >= stated - 1e-9 and accuracy >= source.requirement, (name, source.task, got)
