"""`vlora adapters fuse|demo` and the demo adapters the serve/generate commands pick up."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from tests.adapters.tiny import make_tiny_chat_model, tiny_sources
from vlora.adapters.demo import TRAINED, demo_sources, trained_adapters
from vlora.cli import _demo_adapters, main


def test_fuse_command_trains_from_a_spec_file(tmp_path, capsys, one_thread):
    model = make_tiny_chat_model(tmp_path)
    entries = []
    for s in tiny_sources():
        if s.task == "clash":
            continue
        rows = [{"text": e.text, "label": e.label} for e in s.train + s.heldout]
        (tmp_path / f"{s.task}.jsonl").write_text("\n".join(map(json.dumps, rows)))
        entries.append({"task": s.task, "requirement": 0.75, "dataset": f"{s.task}.jsonl", "prompt": s.prompt})
    (tmp_path / "spec.json").write_text(json.dumps({"sources": entries}))
    out = tmp_path / "out"
    code = main(["adapters", "fuse", str(tmp_path / "spec.json"), "--out", str(out), "--model", str(model),
                 "--epochs", "20", "--patience", "0", "--lr", "3e-3", "--batch-size", "8", "--threads", "1",
                 "--last-layers", "1",
                 "--no-baselines", "--quiet"])
    err = capsys.readouterr().err
    report = json.loads((out / "fusion-report.json").read_text())
    assert code == 0 and "2 sources -> 1 adapters (accuracy-aware fusion)" in err and "every requirement met: yes" in err
    assert sorted(report["adapters"][0]["tasks"]) == ["farm", "hue"] and list(report["methods"]) == ["fusion", "per-source"]
    assert report["settings"]["trainer"]["layers"] == [1] and report["settings"]["trainer"]["epochs"] == 20
    assert (out / "adapter-1" / "adapter_model.safetensors").is_file() and (out / "fusion-report.md").is_file()


@pytest.mark.parametrize("args,match", [
    (["--epochs", "0"], "epochs must be an integer >= 1"),
    (["--order", "best"], "order must be one of easiest, given, random"),
    (["--patience", "-1"], "patience must be an integer >= 0"),
    (["--val-fraction", "1"], r"val_fraction must be in \[0, 1\)"),
    (["--target", "lm_head"], r"targets \['lm_head'\] cannot be served"),
])
def test_fuse_command_refuses_bad_settings(tmp_path, capsys, args, match):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n')
    (tmp_path / "spec.json").write_text(json.dumps({"sources": [{"task": "t", "requirement": 0.5,
                                                                 "dataset": "d.jsonl"}]}))
    assert main(["adapters", "fuse", str(tmp_path / "spec.json"), "--out", str(tmp_path / "o"), *args]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_fuse_command_reports_bad_sources_before_loading_a_model(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": "x"}\n{"text": "b"\n')
    (tmp_path / "spec.json").write_text(json.dumps({"sources": [{"task": "t", "requirement": 0.5,
                                                                 "dataset": "d.jsonl"}]}))
    code = main(["adapters", "fuse", str(tmp_path / "spec.json"), "--out", str(tmp_path / "o"),
                 "--model", str(tmp_path / "no-model")])
    assert code == 2 and "d.jsonl:2: not valid JSON" in capsys.readouterr().err


def test_serve_picks_the_trained_demo_adapters_when_built(tmp_path, capsys):
    engine = SimpleNamespace(adapters=SimpleNamespace(shape=SimpleNamespace(name="tiny-llama", num_layers=2,
                                                                            in_features={}, out_features={})))
    folder = tmp_path / "tiny-llama" / TRAINED
    for name in ("adapter-1", "adapter-2"):
        (folder / name).mkdir(parents=True)
        (folder / name / "adapter_model.safetensors").write_bytes(b"")
    (folder / "fusion-report.json").write_text(json.dumps({"adapters": [
        {"name": "adapter-1", "tasks": ["sentiment"]}, {"name": "adapter-2", "tasks": ["topic", "language"]}]}))
    adapters, trained = _demo_adapters(engine, tmp_path)
    assert trained and adapters == {"demo-sentiment": str(folder / "adapter-1"),
                                    "demo-topic-language": str(folder / "adapter-2")}
    assert "trained demo adapters demo-sentiment, demo-topic-language" in capsys.readouterr().err
    assert trained_adapters(tmp_path / "elsewhere") == {}


def test_demo_sources_conflict_by_design():
    sentiment, topic, language = demo_sources()
    assert sentiment.prompt == topic.prompt != language.prompt
    assert sentiment.labels == ("negative", "positive") and topic.labels == ("food", "music", "sports", "travel")
    assert language.labels == ("English", "French", "German", "Spanish")
    assert all(len(s.train) + len(s.heldout) == 80 and 18 <= len(s.heldout) <= 22 for s in (sentiment, topic, language))
    assert demo_sources()[0].fingerprint() == sentiment.fingerprint()          # deterministic


def test_vision_demo_sources_are_drawn_deterministically(tmp_path):
    from vlora.adapters.demo import DETECTED_DIGITS, vision_sources

    sources = vision_sources(tmp_path / "a", per_task=12)
    assert [s.task for s in sources] == [f"digit-{k}" for k in DETECTED_DIGITS] + ["colour"]
    assert all(s.head and s.has_images and len(s.train) + len(s.heldout) == 12 for s in sources)
    assert sources[0].labels == ("no", "yes") and sources[-1].labels == ("blue", "green", "red")
    assert sources[0].prompt == f"Is there a {DETECTED_DIGITS[0]} in the picture?"
    again = vision_sources(tmp_path / "b", per_task=12)                 # same pixels, other folder
    assert [(e.label, open(e.image, "rb").read()) for e in sources[0].train] == \
        [(e.label, open(e.image, "rb").read()) for e in again[0].train]


def test_fuse_command_refuses_image_tasks_on_a_text_model_before_training(tmp_path, capsys):
    from PIL import Image

    model = make_tiny_chat_model(tmp_path)
    for i, colour in enumerate(("red", "blue")):
        Image.new("RGB", (8, 8), colour).save(tmp_path / f"{i}.png")
    (tmp_path / "d.jsonl").write_text('{"image": "0.png", "label": "red"}\n{"image": "1.png", "label": "blue"}\n')
    (tmp_path / "spec.json").write_text(json.dumps({"sources": [{"task": "colour", "requirement": 0.5,
                                                                 "dataset": "d.jsonl", "head": True}]}))
    code = main(["adapters", "fuse", str(tmp_path / "spec.json"), "--out", str(tmp_path / "o"), "--model", str(model),
                 "--quiet"])
    assert code == 2 and "has image inputs but model" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["fuse", "demo"])
def test_help_shows_the_training_defaults_shared_by_fuse_and_demo(capsys, command):
    with pytest.raises(SystemExit):
        main(["adapters", command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("--epochs EPOCHS", "(default: 12)", "--patience PATIENCE", "(default: 3)",
                    "(default: 0.2)", "(default: 0.003)", "(default: easiest)", "(default: best)"):
        assert default in text, default
