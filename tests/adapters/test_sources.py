"""Knowledge sources: dataset formats, teachers, the held-out split, the spec file and every refusal."""

from __future__ import annotations

import json

import pytest

from vlora.adapters.sources import (Example, SourceError, load_sources, load_teacher, make_source, read_folder,
                                    read_jsonl, split)


def teacher(texts):
    """A stand-in small model: labels a text by its length."""
    return ["long" if len(t) > 5 else "short" for t in texts]


def not_a_list(texts):
    return 3


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def examples(n=20, labels="ab"):
    return [Example(f"text {i}", labels[i % len(labels)]) for i in range(n)]


def test_split_is_stratified_seeded_and_order_free():
    ex = examples(40, "abc")
    train, held = split(ex, 0.25, "s")
    assert sorted(train + held, key=lambda e: e.text) == sorted(ex, key=lambda e: e.text)
    assert not set(train) & set(held)
    assert {e.label for e in held} == {"a", "b", "c"} and len(held) == 4 + 3 + 3   # round(14 * .25) + 2 * round(13 * .25)
    assert split(list(reversed(ex)), 0.25, "s") == (train, held)
    assert split(ex, 0.25, "t")[1] != held
    t2, h2 = split([Example("x", "a"), Example("y", "b")], 0.25, "s")       # single examples per label
    assert len(h2) == 1 and len(t2) == 1


def test_make_source_validates():
    s = make_source("t", 0.5, examples(), prompt="Q: {text}")
    assert s.labels == ("a", "b") and s.message(Example("hi", "a")) == "Q: hi"
    assert len(s.train) + len(s.heldout) == 20 and s.fingerprint() == make_source("t", 0.5, examples(),
                                                                                  prompt="Q: {text}").fingerprint()
    assert s.fingerprint() != make_source("t", 0.6, examples(), prompt="Q: {text}").fingerprint()
    for req in (-0.1, 1.5, "0.9", True, float("nan")):
        with pytest.raises(SourceError, match=r"requirement must be an accuracy in \[0, 1\]"):
            make_source("t", req, examples())
    with pytest.raises(SourceError, match="must be a string containing"):
        make_source("t", 0.5, examples(), prompt="no slot")
    with pytest.raises(SourceError, match=r"labels \['b'\] are not in the label list"):
        make_source("t", 0.5, examples(), labels=["a"])
    with pytest.raises(SourceError, match="at least 2 examples"):
        make_source("t", 0.5, examples(1))
    with pytest.raises(SourceError, match="task name"):
        make_source(" t", 0.5, examples())


def test_jsonl_dataset_and_its_errors(tmp_path):
    good = write_jsonl(tmp_path / "d.jsonl", [{"text": "soup was cold", "label": "neg"}, "",
                                              {"text": "lovely", "label": "pos"}])
    assert read_jsonl(good, labelled=True) == [Example("soup was cold", "neg"), Example("lovely", "pos")]
    cases = [
        (["{\"text\": \"a\", \"label\": \"x\"}", "{not json"], r"d.jsonl:2: not valid JSON"),
        ([{"text": "a", "label": "x"}, [1, 2]], r"d.jsonl:2: expected a JSON object"),
        ([{"text": "", "label": "x"}], r"d.jsonl:1: 'text' must be a non-empty string"),
        ([{"text": "a"}], r"d.jsonl:1: 'label' must be a non-empty string"),
        ([{"text": "a", "label": " x"}], r"d.jsonl:1: 'label' must be a non-empty string without surrounding"),
        ([{"text": "a", "label": "x"}, {"text": "b", "label": "zzz"}], r"d.jsonl:2: label 'zzz' is not in the label"),
        ([{"image": "cat.png", "label": "x"}], r"d.jsonl:1: 'image': no such image file .*cat.png"),
        ([""], r"holds no examples"),
    ]
    for rows, match in cases:
        path = write_jsonl(tmp_path / "d.jsonl", rows)
        with pytest.raises(SourceError, match=match):
            read_jsonl(path, labelled=True, labels=["x"])
    with pytest.raises(SourceError, match="no such file"):
        read_jsonl(tmp_path / "missing.jsonl", labelled=True)
    (tmp_path / "bad.jsonl").write_bytes(b"\xff\xfe")
    with pytest.raises(SourceError, match="cannot be read"):
        read_jsonl(tmp_path / "bad.jsonl", labelled=True)


def test_folder_dataset(tmp_path):
    for label, texts in {"pos": ["great", "lovely"], "neg": ["awful"]}.items():
        (tmp_path / "d" / label).mkdir(parents=True)
        for i, t in enumerate(texts):
            (tmp_path / "d" / label / f"{i}.txt").write_text(t + "\n")
    assert read_folder(tmp_path / "d") == [Example("awful", "neg"), Example("great", "pos"), Example("lovely", "pos")]
    with pytest.raises(SourceError, match=r"d/pos: label 'pos' is not in the label list"):
        read_folder(tmp_path / "d", labels=["neg"])
    (tmp_path / "d" / "neg" / "x.png").write_bytes(b"")
    with pytest.raises(SourceError, match="x.png cannot be decoded as an image"):
        read_folder(tmp_path / "d")
    with pytest.raises(SourceError, match="no such folder"):
        read_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="holds no examples"):
        read_folder(tmp_path / "empty")


def test_teacher_labels_unlabelled_inputs(tmp_path):
    assert load_teacher("tests.adapters.test_sources:teacher") is teacher
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in ("hi", "hello there", "yo", "good morning")])
    spec = {"sources": [{"task": "len", "requirement": 0.8, "teacher": "tests.adapters.test_sources:teacher",
                         "inputs": "in.jsonl"}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    [s] = load_sources(tmp_path / "spec.json")
    assert s.labels == ("long", "short") and s.origin.startswith("teacher tests.adapters.test_sources:teacher")
    assert sorted((e.text, e.label) for e in s.train + s.heldout) == [
        ("good morning", "long"), ("hello there", "long"), ("hi", "short"), ("yo", "short")]
    for spec_, match in [("nocolon", "module:function"), ("no.such.module:f", "cannot import module"),
                         ("tests.adapters.test_sources:missing", "has no attribute"),
                         ("tests.adapters.test_sources:json", "has no attribute|not callable")]:
        with pytest.raises(SourceError, match=match):
            load_teacher(spec_)
    spec["sources"][0]["teacher"] = "tests.adapters.test_sources:not_a_list"
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(SourceError, match="teacher returned int"):
        load_sources(tmp_path / "spec.json")


def test_spec_file_and_its_errors(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"t{i}", "label": "xy"[i % 2]} for i in range(8)])
    base = {"task": "a", "requirement": 0.9, "dataset": "a.jsonl", "prompt": "Say: {text}"}
    (tmp_path / "spec.json").write_text(json.dumps({"sources": [base]}))
    [s] = load_sources(tmp_path / "spec.json")
    assert (s.task, s.requirement, s.prompt, len(s.train), len(s.heldout)) == ("a", 0.9, "Say: {text}", 6, 2)
    bad = [
        ({"sources": [base, base]}, "task 'a' is given twice"),
        ({"sources": [{**base, "requirement": 1.2}]}, r"requirement must be an accuracy in \[0, 1\]"),
        ({"sources": [{k: v for k, v in base.items() if k != "requirement"}]}, "'requirement' .* is missing"),
        ({"sources": [{**base, "colour": 1}]}, r"unknown fields \['colour'\]"),
        ({"sources": [{**base, "teacher": "m:f"}]}, "exactly one of 'dataset'"),
        ({"sources": [{**base, "dataset": "missing.jsonl"}]}, "missing.jsonl: no such file"),
        ({"sources": [{**base, "labels": ["x"]}]}, r"a.jsonl:2: label 'y' is not in the label list"),
        ({"sources": [{"task": "b", "requirement": 0.5, "teacher": "m:f"}]}, "a teacher needs 'inputs'"),
        ({"sources": []}, "at least one source"),
        ({"nope": 1}, "at least one source"),
    ]
    for spec, match in bad:
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        with pytest.raises(SourceError, match=match):
            load_sources(tmp_path / "spec.json")
    (tmp_path / "spec.json").write_text("{")
    with pytest.raises(SourceError, match="cannot be read as JSON"):
        load_sources(tmp_path / "spec.json")


def png(path, colour=(255, 0, 0)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)
    return path


def test_image_datasets_jsonl_and_folder(tmp_path):
    png(tmp_path / "img" / "a.png")
    png(tmp_path / "img" / "b.png", (0, 0, 255))
    good = write_jsonl(tmp_path / "d.jsonl", [{"image": "img/a.png", "label": "red"},
                                              {"image": "img/b.png", "text": "the square", "label": "blue"}])
    assert read_jsonl(good, labelled=True) == [Example("", "red", str(tmp_path / "img" / "a.png")),
                                               Example("the square", "blue", str(tmp_path / "img" / "b.png"))]
    (tmp_path / "img" / "junk.png").write_bytes(b"not an image")
    cases = [
        ([{"image": "img/junk.png", "label": "red"}], r"d.jsonl:1: 'image': .*junk.png cannot be decoded as an image"),
        ([{"image": "", "label": "red"}], r"d.jsonl:1: 'image' must be a non-empty path"),
        ([{"image": "img/a.png", "text": 3, "label": "red"}], r"d.jsonl:1: 'text' must be a string"),
    ]
    for rows, match in cases:
        with pytest.raises(SourceError, match=match):
            read_jsonl(write_jsonl(tmp_path / "d.jsonl", rows), labelled=True)
    with pytest.raises(SourceError, match=r"in.jsonl:1: a teacher labels texts only"):
        read_jsonl(write_jsonl(tmp_path / "in.jsonl", [{"image": "img/a.png"}]), labelled=False)

    png(tmp_path / "f" / "red" / "1.png")
    (tmp_path / "f" / "red" / "1.txt").write_text("caption\n")
    png(tmp_path / "f" / "blue" / "2.jpg", (0, 0, 255))
    assert read_folder(tmp_path / "f") == [Example("", "blue", str(tmp_path / "f" / "blue" / "2.jpg")),
                                           Example("caption", "red", str(tmp_path / "f" / "red" / "1.png"))]


def test_image_sources_prompts_and_heads(tmp_path):
    a, b = png(tmp_path / "a.png"), png(tmp_path / "b.png", (0, 0, 255))
    ex = [Example("", "red", str(a)), Example("left", "blue", str(b))]
    s = make_source("colour", 0.5, ex, prompt="What colour?", head=True)      # image tasks need no {text}
    assert s.head and s.has_images and s.message(ex[0], "<img>") == "<img>\nWhat colour?"
    s2 = make_source("c2", 0.5, ex, prompt="Look: {image} {text}?")
    assert not s2.head and s2.message(ex[1], "<img>") == "Look: <img> left?"
    assert s.fingerprint() != make_source("colour", 0.5, ex, prompt="What colour?").fingerprint()   # head counts
    before = s.fingerprint()
    png(tmp_path / "a.png", (0, 255, 0))                               # the image's content counts too
    assert s.fingerprint() != before
    with pytest.raises(SourceError, match="mixes examples with and without images"):
        make_source("m", 0.5, ex + [Example("text", "red")], prompt="{text}")
    with pytest.raises(SourceError, match="prompt has {image} but the examples have no images"):
        make_source("m", 0.5, examples(), prompt="{image} {text}")
    with pytest.raises(SourceError, match="head must be true or false"):
        make_source("m", 0.5, ex, head="yes")
    write_jsonl(tmp_path / "d.jsonl", [{"image": "a.png", "label": "red"}, {"image": "b.png", "label": "blue"}])
    (tmp_path / "spec.json").write_text(json.dumps({"sources": [
        {"task": "colour", "requirement": 0.5, "dataset": "d.jsonl", "prompt": "What colour?", "head": True}]}))
    [s3] = load_sources(tmp_path / "spec.json")
    assert s3.head and s3.has_images and s3.labels == ("blue", "red")
