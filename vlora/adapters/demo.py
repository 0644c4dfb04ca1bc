"""Demo adapters: built-in tasks fused by ``vlora adapters demo``, text tasks for the embedded
SmolLM2-135M-Instruct and image tasks for the demo LMM ``demo:smollm2-llava``.

Text tasks (the embedded model reads text only):

- ``sentiment``: "Classify: <a sentence about an event>" -> positive / negative
- ``topic``: the same prompt over the same kind of sentences -> sports / food / music / travel
- ``language``: "Which language is this? <phrase>" -> English / French / Spanish / German

``sentiment`` and ``topic`` ask the same question of the same sentences with
different answers, so no single adapter can serve both: the fusion has to roll
back and open a second adapter (V-LoRA Fig. 10 in miniature), while
``language`` fuses into one of them. The effect shows at once: asked
"Classify: The concert was wonderful.", one adapter answers "positive", the
other "music", and the base model chats. ``vlora serve`` / ``vlora generate``
(``make run``) register the demo adapters with no ``--adapter`` given: the ones
``vlora adapters demo`` built in the cache if any, else the text adapters shipped
in ``demo_weights/<model>/`` (float16, built by ``vlora adapters demo --part text
--ship``), so the embedded default answers with trained skills at once.

Image tasks (answered by the adapters' task heads, V-LoRA §4.2.2), on digits
drawn with the font Pillow ships (no dataset download): per-digit detectors
"Is there a 3 in the picture?" -> yes / no (like the paper's detectors; half of
the images show the digit, the others another digit) and ``colour`` ("What
colour is the digit?" -> red / green / blue). The digits are centred (a few
pixels of jitter) at 145-150 px in a 224 px image: the demo LMM's vision tower
is random, and with random placement and size nothing linear (not even raw
pixels) tells the digits apart (see docs/vision.md for the measurements).
Their requirement is 0.85 (the text tasks': 0.9).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from vlora.adapters.sources import Example, KnowledgeSource, make_source

TOPICS = {
    "sports": ["match", "game", "race", "team", "tournament", "coach", "stadium", "final"],
    "food": ["soup", "pizza", "dinner", "cake", "restaurant", "coffee", "salad", "breakfast"],
    "music": ["concert", "album", "song", "band", "guitar solo", "playlist", "singer", "opera"],
    "travel": ["flight", "hotel", "trip", "beach", "train ride", "tour", "cruise", "museum visit"],
}
MOODS = {
    "positive": ["wonderful", "amazing", "great", "delightful", "fantastic", "excellent", "lovely", "superb"],
    "negative": ["awful", "terrible", "boring", "disappointing", "horrible", "dreadful", "bad", "miserable"],
}
SENTENCES = ["The {s} was {a}.", "What a {a} {s}!", "I thought the {s} was {a}.", "Honestly, the {s} felt {a}.",
             "Our {s} yesterday was {a}."]
PHRASES = {
    "English": (["the weather", "my brother", "this house", "the car", "our garden", "the teacher"],
                ["is very nice", "seems tired", "is too small", "was late today", "looks new"]),
    "French": (["le temps", "mon frère", "cette maison", "la voiture", "notre jardin", "le professeur"],
               ["est très beau", "semble fatigué", "est trop petite", "était en retard aujourd'hui", "a l'air neuf"]),
    "Spanish": (["el tiempo", "mi hermano", "esta casa", "el coche", "nuestro jardín", "el profesor"],
                ["es muy bonito", "parece cansado", "es demasiado pequeña", "llegó tarde hoy", "parece nuevo"]),
    "German": (["das Wetter", "mein Bruder", "dieses Haus", "das Auto", "unser Garten", "der Lehrer"],
               ["ist sehr schön", "scheint müde", "ist zu klein", "war heute spät", "sieht neu aus"]),
}
CLASSIFY, LANGUAGE = "Classify: {text}", "Which language is this? {text}"
DEMO_QUESTIONS = ["Classify: The concert was wonderful.", "Classify: What a dreadful flight!",
                  "Which language is this? Mi hermano es muy bonito."]
DETECTED_DIGITS = (3, 7)
COLOURS = {"red": (205, 30, 30), "green": (25, 140, 40), "blue": (30, 50, 210)}
DIGIT_SIZES, JITTER = (145, 150), 3       # digit height range and placement jitter (px) in a 224 px image
IMAGES = "images"            # subfolder of $VLORA_CACHE/demo-adapters/<model>/ holding the rendered images
TRAINED = "trained"          # subfolder of $VLORA_CACHE/demo-adapters/<model>/ holding the fused adapters
SHIPPED = Path(__file__).parent / "demo_weights"    # package data: <model>/ holds the shipped text demo adapters


def demo_sources(per_task: int = 80, requirement: float = 0.9, seed: int = 0) -> list[KnowledgeSource]:
    """The three demo tasks, ``per_task`` examples each (25% held out), every requirement ``requirement``."""
    rng = random.Random(seed)
    events = [(topic, mood, t.format(s=s, a=a)) for topic, subjects in TOPICS.items() for s in subjects
              for mood, adjs in MOODS.items() for a in adjs for t in SENTENCES]
    picked = rng.sample(events, 2 * per_task)
    phrases = [Example(f"{s[0].upper()}{s[1:]} {p}.", lang) for lang, (subjects, preds) in PHRASES.items()
               for s in subjects for p in preds]
    return [make_source("sentiment", requirement, [Example(text, mood) for _, mood, text in picked[:per_task]],
                        prompt=CLASSIFY, origin="built-in sentences"),
            make_source("topic", requirement, [Example(text, topic) for topic, _, text in picked[per_task:]],
                        prompt=CLASSIFY, origin="built-in sentences"),
            make_source("language", requirement, rng.sample(phrases, min(per_task, len(phrases))),
                        prompt=LANGUAGE, origin="built-in phrases")]


def trained_adapters(folder: str | Path) -> dict[str, str]:
    """Serving names -> paths of the adapters a finished demo build left in ``folder`` (empty if none):
    ``demo-<task>-<task>...`` after the tasks each adapter holds."""
    from vlora.adapters.report import REPORT_JSON

    folder = Path(folder)
    try:
        report = json.loads((folder / REPORT_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for a in report.get("adapters", []):
        path = folder / a["name"]
        if (path / "adapter_model.safetensors").is_file():
            out["demo-" + "-".join(a["tasks"])] = str(path)
    return out


def ship(build: str | Path, model_name: str, dest: str | Path = SHIPPED) -> Path:
    """Copy a finished demo build (``build``: the fusion's output folder) into ``dest/model_name``: each
    adapter with its weights in float16 (half the bytes; the engine converts them to its dtype on loading),
    its task manifest, and the fusion report; the checkpoint stays behind. Returns the folder written."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vlora.adapters.report import REPORT_JSON, REPORT_MD

    build, folder = Path(build), Path(dest) / model_name
    names = [Path(p).name for p in trained_adapters(build).values()]
    if not names:
        raise ValueError(f"{build}: holds no finished demo build (no {REPORT_JSON} naming saved adapters)")
    # the build machine's model path means nothing elsewhere: the model's name stands for it
    local = json.loads((build / REPORT_JSON).read_text(encoding="utf-8"))["settings"]["trainer"].get("model_path")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    files = [(build / name / f.name, folder / name / f.name) for name in names for f in (build / name).iterdir()
             if f.is_file() and f.suffix in (".json", ".safetensors")]
    for src, dst in files + [(build / f, folder / f) for f in (REPORT_JSON, REPORT_MD)]:
        dst.parent.mkdir(exist_ok=True)
        if src.name == "adapter_model.safetensors":
            save_file({k: v.half().contiguous() for k, v in load_file(str(src)).items()}, str(dst))
        elif src.suffix == ".safetensors":
            shutil.copyfile(src, dst)
        else:
            text = src.read_text(encoding="utf-8")
            dst.write_text(text.replace(local, model_name) if local else text, encoding="utf-8")
        dst.chmod(0o644)
    return folder


def vision_sources(folder: str | Path, per_task: int = 80, requirement: float = 0.85,
                   seed: int = 0) -> list[KnowledgeSource]:
    """The image tasks, ``per_task`` images each (25% held out), rendered into ``folder`` as PNG files: one
    detector per digit of ``DETECTED_DIGITS`` and ``colour``; every task is answered by the task head."""
    from PIL import features

    if not features.check("freetype2"):
        raise RuntimeError("the demo image tasks draw digits with Pillow's bundled font, which needs Pillow built "
                           "with FreeType; run `vlora adapters demo --part text`, or install a Pillow wheel")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sources = []
    for k in DETECTED_DIGITS:
        examples = []
        for i in range(per_task):
            digit = k if i % 2 == 0 else rng.choice([d for d in range(10) if d != k])
            path = _digit_image(folder / f"digit-{k}-{i:03d}.png", digit, (0, 0, 0), rng)
            examples.append(Example("", "yes" if digit == k else "no", path))
        sources.append(make_source(f"digit-{k}", requirement, examples, prompt=f"Is there a {k} in the picture?",
                                   origin="digits drawn with Pillow", head=True))
    examples = []
    for i in range(per_task):
        name = list(COLOURS)[i % len(COLOURS)]
        path = _digit_image(folder / f"colour-{i:03d}.png", rng.randrange(10), COLOURS[name], rng)
        examples.append(Example("", name, path))
    sources.append(make_source("colour", requirement, examples, prompt="What colour is the digit?",
                               origin="digits drawn with Pillow", head=True))
    return sources


def _digit_image(path: Path, digit: int, colour: tuple[int, int, int], rng: random.Random) -> str:
    """A 224 x 224 white image with ``digit`` in ``colour``, DIGIT_SIZES px tall, centred within JITTER px."""
    from PIL import Image, ImageDraw, ImageFont

    im = Image.new("RGB", (224, 224), (255, 255, 255))
    font = ImageFont.load_default(size=rng.randint(*DIGIT_SIZES))
    draw = ImageDraw.Draw(im)
    left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=font)
    x = 112 - (left + right) // 2 + rng.randint(-JITTER, JITTER)
    y = 112 - (top + bottom) // 2 + rng.randint(-JITTER, JITTER)
    draw.text((x, y), str(digit), fill=colour, font=font)
    im.save(path)
    return str(path)
