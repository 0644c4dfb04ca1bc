"""Knowledge sources: the tasks that adapter generation packs into LoRA adapters (V-LoRA §4.2.1, Fig. 9).

A source is one task with an accuracy requirement and labelled examples, split
once, deterministically, into a training part and a held-out part; the fusion
loop checks the requirement on the held-out part only. Examples come either
from a labelled JSONL dataset or from a *teacher* (a domain-specific small
model, given as ``module:function``) run over unlabelled inputs, which is how
V-LoRA distils existing small models into an adapter.

Dataset format (JSONL, UTF-8, one JSON object per line, blank lines ignored)::

    {"text": "The soup was cold.", "label": "negative"}
    {"text": "What a lovely evening!", "label": "positive"}

``text`` is the task input (non-empty string) and ``label`` the exact answer the
adapter must produce (non-empty string without surrounding spaces). Teacher
inputs use the same format without ``label`` (a ``label`` there is ignored: the
teacher labels). A teacher is called once as
``function(texts: list[str]) -> list[str]``.

Image tasks (for a LLaVA-style LMM) give an ``image`` path (relative to the
JSONL file's folder); ``text`` is then optional (default empty)::

    {"image": "img/0001.png", "label": "yes"}
    {"image": "img/0002.png", "text": "the left one", "label": "no"}

The image file must exist and decode (checked when the source is loaded). A
source holds either image examples only or text examples only; teachers label
texts only.

A dataset may also be a folder with one subfolder per label, each holding one
UTF-8 ``.txt`` file per example (the file's text, stripped, is the input), or
one image file per example (``.png .jpg .jpeg .bmp .gif .webp``; a ``.txt``
of the same stem, if present, is that image's text)::

    reviews/positive/001.txt   reviews/negative/001.txt ...
    digits/yes/001.png   digits/no/001.png ...

The prompt (the user message) holds ``{text}`` where the example's text goes
and, for image tasks, ``{image}`` where the image goes (replaced by the model's
image placeholder token); without ``{image}`` the image comes first, on its
own line (LLaVA-1.5's layout). Image tasks need no ``{text}`` (e.g. the prompt
``"Is there a 3?"``).

A source with ``"head": true`` is answered by the adapter's task head (V-LoRA
§4.2.2: one forward pass, an argmax over the labels) instead of by generating
the label's text; the head is trained with the LoRA (see ``trainer.py``).

Tasks are closed-set: the label list is given in the spec or taken from the
data; a label outside a given list is an error, with its file and line.

A spec file (JSON) lists the sources; relative paths are relative to it::

    {"sources": [
      {"task": "sentiment", "requirement": 0.9, "dataset": "sentiment.jsonl",
       "prompt": "Is this review positive or negative?\\n{text}", "labels": ["positive", "negative"]},
      {"task": "topic", "requirement": 0.8, "teacher": "mypkg.models:topic", "inputs": "unlabelled.jsonl"}
    ]}
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SLOT, IMAGE_SLOT = "{text}", "{image}"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
_SPEC_KEYS = {"task", "requirement", "dataset", "teacher", "inputs", "prompt", "labels", "heldout_fraction", "seed",
              "head"}


class SourceError(ValueError):
    """A knowledge source cannot be used; the message names the file, line or field and why."""


@dataclass(frozen=True)
class Example:
    """One labelled input: a text, or an image (a file path) with an optional text."""

    text: str
    label: str
    image: str | None = None


@dataclass(frozen=True)
class KnowledgeSource:
    """A task, its accuracy requirement (fraction of held-out answers equal to the label) and its data."""

    task: str
    requirement: float
    train: tuple[Example, ...]
    heldout: tuple[Example, ...]
    labels: tuple[str, ...]                 # the closed label set, sorted
    prompt: str = TEXT_SLOT                 # user message template; TEXT_SLOT is replaced by the example's text
    origin: str = "examples"                # where the examples came from, for the report
    head: bool = False                      # answered by the adapter's task head (else: the label's text)
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def has_images(self) -> bool:
        return (self.train + self.heldout)[0].image is not None

    def message(self, example: Example, image_token: str = "<image>") -> str:
        """The user message the model sees for ``example``; ``image_token``: the model's image placeholder."""
        prompt = self.prompt
        if example.image is not None:
            prompt = prompt if IMAGE_SLOT in prompt else f"{IMAGE_SLOT}\n{prompt}"
            prompt = prompt.replace(IMAGE_SLOT, image_token)
        return prompt.replace(TEXT_SLOT, example.text)

    def fingerprint(self) -> str:
        """Content hash: a checkpoint made from other data or settings is never resumed. Images count by
        their path and file content."""
        payload = json.dumps([self.task, self.requirement, self.prompt, self.labels, self.head,
                              [(e.text, e.label, e.image, _file_digest(e.image))
                               for e in self.train + self.heldout]])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def make_source(task: str, requirement: float, examples: Sequence[Example], *, prompt: str = TEXT_SLOT,
                labels: Sequence[str] | None = None, heldout_fraction: float = 0.25, seed: int = 0,
                origin: str = "examples", head: bool = False) -> KnowledgeSource:
    """Validate ``examples`` and split them (per label, seeded) into train and held-out parts."""
    if not isinstance(task, str) or not task.strip() or task != task.strip():
        raise SourceError(f"task name must be a non-empty string without surrounding spaces, got {task!r}")
    if isinstance(requirement, bool) or not isinstance(requirement, (int, float)) or not 0 <= requirement <= 1:
        raise SourceError(f"task {task!r}: requirement must be an accuracy in [0, 1], got {requirement!r}")
    images = {e.image is not None for e in examples}
    if len(images) > 1:
        raise SourceError(f"task {task!r}: mixes examples with and without images; give one kind per source")
    if not isinstance(prompt, str) or (TEXT_SLOT not in prompt and images != {True}):
        raise SourceError(f"task {task!r}: prompt must be a string containing {TEXT_SLOT}, got {prompt!r}")
    if IMAGE_SLOT in prompt and images != {True}:
        raise SourceError(f"task {task!r}: prompt has {IMAGE_SLOT} but the examples have no images")
    if not isinstance(head, bool):
        raise SourceError(f"task {task!r}: head must be true or false, got {head!r}")
    if not 0 < heldout_fraction < 1:
        raise SourceError(f"task {task!r}: heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    if labels is not None:
        labels = tuple(labels)
        for label in labels:
            _check_label(label, f"task {task!r}: labels")
        if len(set(labels)) != len(labels):
            raise SourceError(f"task {task!r}: labels lists a label twice: {list(labels)}")
        unknown = sorted({e.label for e in examples} - set(labels))
        if unknown:
            raise SourceError(f"task {task!r}: labels {unknown} are not in the label list {list(labels)}")
    if len(examples) < 2:
        raise SourceError(f"task {task!r}: needs at least 2 examples (one to train, one held out), got {len(examples)}")
    train, heldout = split(examples, heldout_fraction, f"{seed}:{task}")
    return KnowledgeSource(task=task, requirement=float(requirement), train=train, heldout=heldout,
                           labels=tuple(sorted(labels if labels is not None else {e.label for e in examples})),
                           prompt=prompt, origin=origin, head=head)


def meets(accuracy: float, requirement: float) -> bool:
    """Does ``accuracy`` meet ``requirement`` (up to float rounding of a fraction of examples)?"""
    return accuracy + 1e-9 >= requirement


def split(examples: Sequence[Example], fraction: float, seed: str) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """Stratified, seeded split: each label gives round(n * fraction) examples (at least one when it has
    two or more) to the held-out part, so every label is checked; the input order does not matter."""
    by_label: dict[str, list[Example]] = {}
    for e in sorted(examples, key=lambda e: (e.label, e.text, e.image or "")):
        by_label.setdefault(e.label, []).append(e)
    rng = random.Random(seed)
    train: list[Example] = []
    heldout: list[Example] = []
    for label in sorted(by_label):
        group = by_label[label]
        rng.shuffle(group)
        k = min(len(group) - 1, max(1, round(len(group) * fraction))) if len(group) > 1 else 0
        heldout += group[:k]
        train += group[k:]
    if not heldout:          # every label has a single example: hold out one of them anyway
        heldout, train = train[:1], train[1:]
    rng.shuffle(train)
    return tuple(train), tuple(heldout)


def read_jsonl(path: str | Path, *, labelled: bool, labels: Sequence[str] | None = None) -> list[Example]:
    """Examples of a JSONL file (format in the module docstring); errors name the file and line.
    ``labels``: the closed label set, when given; a label outside it is refused with its line."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: cannot be read ({e})") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SourceError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise SourceError(f"{where}: expected a JSON object, got {type(row).__name__}")
        image = None
        if "image" in row:
            if not labelled:
                raise SourceError(f"{where}: a teacher labels texts only; 'image' inputs need a labelled dataset")
            image = _check_image(row["image"], path.parent, f"{where}: 'image'")
        text = row.get("text", "" if image else None)
        if image and not isinstance(text, str):
            raise SourceError(f"{where}: 'text' must be a string, got {text!r}")
        if not image and (not isinstance(text, str) or not text.strip()):
            raise SourceError(f"{where}: 'text' must be a non-empty string, got {text!r}")
        label = ""
        if labelled:
            label = row.get("label")
            _check_label(label, f"{where}: 'label'")
            if labels is not None and label not in labels:
                raise SourceError(f"{where}: label {label!r} is not in the label list {list(labels)}")
        out.append(Example(text=text, label=label, image=image))
    if not out:
        raise SourceError(f"{path}: holds no examples")
    return out


def read_folder(path: str | Path, labels: Sequence[str] | None = None) -> list[Example]:
    """Examples of a folder dataset: ``path/<label>/<example>.txt`` or ``<example>.png`` etc. (format in the
    module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise SourceError(f"{path}: no such folder")
    out = []
    for sub in sorted(p for p in path.iterdir() if p.is_dir()):
        _check_label(sub.name, f"{sub}: folder name (the label)")
        if labels is not None and sub.name not in labels:
            raise SourceError(f"{sub}: label {sub.name!r} is not in the label list {list(labels)}")
        files = sorted(sub.iterdir())
        image_stems = {f.stem for f in files if f.suffix.lower() in IMAGE_SUFFIXES}
        for f in files:
            if f.suffix.lower() in IMAGE_SUFFIXES:
                caption = f.with_suffix(".txt")
                text = _read_text(caption, allow_empty=True) if caption.is_file() else ""
                out.append(Example(text=text, label=sub.name, image=_check_image(f.name, sub, str(f))))
            elif f.suffix == ".txt" and f.stem not in image_stems:
                out.append(Example(text=_read_text(f), label=sub.name))
    if not out:
        raise SourceError(f"{path}: holds no examples (expected <label>/<example>.txt or image files)")
    return out


def _read_text(f: Path, allow_empty: bool = False) -> str:
    try:
        text = f.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"{f}: cannot be read ({e})") from None
    if not text and not allow_empty:
        raise SourceError(f"{f}: is empty")
    return text


def _check_image(value, base_dir: Path, where: str) -> str:
    """The absolute path of an image that exists and decodes (PIL), else SourceError naming ``where``."""
    from PIL import Image

    if not isinstance(value, str) or not value.strip():
        raise SourceError(f"{where} must be a non-empty path, got {value!r}")
    f = (base_dir / value).resolve()
    if not f.is_file():
        raise SourceError(f"{where}: no such image file {f}")
    try:
        with Image.open(f) as im:
            im.verify()
    except Exception as e:          # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
        raise SourceError(f"{where}: {f} cannot be decoded as an image ({type(e).__name__}: {e})") from None
    return str(f)


def _file_digest(path: str | None) -> str | None:
    return None if path is None else hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_teacher(spec: str) -> Callable[[list[str]], list[str]]:
    """Import the teacher callable ``module:function`` (V-LoRA Fig. 9: a domain model that labels inputs)."""
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise SourceError(f"teacher must be given as 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SourceError(f"teacher {spec!r}: cannot import module {module_name!r} ({e})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SourceError(f"teacher {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SourceError(f"teacher {spec!r}: {attr!r} is not callable")
    return obj


def distil(teacher: str | Callable[[list[str]], list[str]], texts: Sequence[str], task: str) -> list[Example]:
    """Label ``texts`` with the teacher; it must return one label string per text."""
    fn = load_teacher(teacher) if isinstance(teacher, str) else teacher
    labels = fn(list(texts))
    try:
        labels = list(labels)
    except TypeError:
        raise SourceError(f"task {task!r}: teacher returned {type(labels).__name__}, expected a list of labels") from None
    if len(labels) != len(texts):
        raise SourceError(f"task {task!r}: teacher returned {len(labels)} labels for {len(texts)} inputs")
    for text, label in zip(texts, labels):
        _check_label(label, f"task {task!r}: teacher label for {text[:40]!r}")
    return [Example(text=t, label=lab) for t, lab in zip(texts, labels)]


def source_from_spec(entry: dict, base_dir: Path = Path(".")) -> KnowledgeSource:
    """One spec entry (see the module docstring) -> a KnowledgeSource."""
    if not isinstance(entry, dict):
        raise SourceError(f"a source must be a JSON object, got {entry!r}")
    unknown = sorted(set(entry) - _SPEC_KEYS)
    task = entry.get("task")
    if unknown:
        raise SourceError(f"source {task!r}: unknown fields {unknown} (known: {sorted(_SPEC_KEYS)})")
    if "requirement" not in entry:
        raise SourceError(f"source {task!r}: 'requirement' (accuracy in [0, 1]) is missing")
    has_data, has_teacher = "dataset" in entry, "teacher" in entry
    if has_data == has_teacher:
        raise SourceError(f"source {task!r}: give exactly one of 'dataset' (labelled JSONL) or "
                          f"'teacher' ('module:function', with 'inputs')")
    if has_data:
        path = base_dir / entry["dataset"]
        labels = entry.get("labels")
        labels = labels if isinstance(labels, list) else None      # a malformed list is refused by make_source
        examples = read_folder(path, labels) if path.is_dir() else read_jsonl(path, labelled=True, labels=labels)
        origin = f"dataset {path}"
    else:
        if "inputs" not in entry:
            raise SourceError(f"source {task!r}: a teacher needs 'inputs' (a JSONL file of unlabelled texts)")
        path = base_dir / entry["inputs"]
        texts = [e.text for e in read_jsonl(path, labelled=False)]
        examples, origin = distil(entry["teacher"], texts, str(task)), f"teacher {entry['teacher']} over {path}"
    return make_source(task, entry["requirement"], examples, prompt=entry.get("prompt", TEXT_SLOT),
                       labels=entry.get("labels"), heldout_fraction=entry.get("heldout_fraction", 0.25),
                       seed=entry.get("seed", 0), origin=origin, head=entry.get("head", False))


def load_sources(spec_path: str | Path) -> list[KnowledgeSource]:
    """All sources of a JSON spec file; task names must be unique."""
    spec_path = Path(spec_path)
    try:
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{spec_path}: cannot be read as JSON ({e})") from None
    entries = spec.get("sources") if isinstance(spec, dict) else spec
    if not isinstance(entries, list) or not entries:
        raise SourceError(f"{spec_path}: expected {{\"sources\": [...]}} with at least one source")
    sources = [source_from_spec(e, spec_path.parent) for e in entries]
    check_unique(sources)
    return sources


def check_unique(sources: Sequence[KnowledgeSource]) -> None:
    seen: set[str] = set()
    for s in sources:
        if s.task in seen:
            raise SourceError(f"task {s.task!r} is given twice")
        seen.add(s.task)


def _check_label(label, where: str) -> None:
    if not isinstance(label, str) or not label.strip() or label != label.strip():
        raise SourceError(f"{where} must be a non-empty string without surrounding spaces, got {label!r}")

