"""Demo adapters for the embedded default model: three built-in text tasks fused by ``vlora adapters demo``.

The embedded SmolLM2-135M-Instruct reads text only, so the demo tasks are text
tasks (image tasks need an LMM; see docs/adapters.md):

- ``sentiment``: "Classify: <a sentence about an event>" -> positive / negative
- ``topic``: the same prompt over the same kind of sentences -> sports / food / music / travel
- ``language``: "Which language is this? <phrase>" -> English / French / Spanish / German

``sentiment`` and ``topic`` ask the same question of the same sentences with
different answers, so no single adapter can serve both: the fusion has to roll
back and open a second adapter (V-LoRA Fig. 10 in miniature), while
``language`` fuses into one of them. The effect shows at once: asked
"Classify: The concert was wonderful.", one adapter answers "positive", the
other "music", and the base model chats. ``vlora serve`` / ``vlora generate``
(``make run``) register the demo adapters when they have been built.
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
TRAINED = "trained"          # subfolder of $VLORA_CACHE/demo-adapters/<model>/ holding the fused adapters


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
