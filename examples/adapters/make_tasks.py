"""Nine template-generated text tasks for `vlora adapters fuse`, written as a user's own datasets would be:
a spec file, JSONL datasets and one folder dataset (<label>/<example>.txt).

    python examples/adapters/make_tasks.py /tmp/nine        # writes /tmp/nine/spec.json and the datasets
    vlora adapters fuse /tmp/nine/spec.json --out /tmp/nine/out

The tasks differ in kind: word knowledge (animal class, continent), surface form (question or statement,
tense), arithmetic (parity, which number is larger), intent and tone (ticket urgency, emotion, spam), with
2-4 labels and their own prompts; 80 examples each (a quarter held out), requirement 0.85.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REQUIREMENT = 0.85
PER_TASK = 80


def animals(rng):
    kinds = {"mammal": ["dog", "cat", "horse", "whale", "bat", "lion", "cow", "rabbit", "tiger", "bear", "goat",
                        "mouse", "elephant", "dolphin", "fox", "wolf", "sheep", "deer", "monkey", "camel"],
             "bird": ["eagle", "sparrow", "penguin", "owl", "parrot", "duck", "robin", "swan", "crow", "pigeon",
                      "ostrich", "hawk", "goose", "flamingo", "heron", "falcon", "peacock", "seagull", "turkey", "hen"],
             "fish": ["salmon", "tuna", "trout", "cod", "shark", "carp", "herring", "sardine", "mackerel", "eel",
                      "goldfish", "catfish", "perch", "pike", "haddock", "halibut", "anchovy", "swordfish", "bass",
                      "tilapia"]}
    forms = ["{x}", "a {x}", "the {x}", "one {x}"]
    rows = [(f.format(x=x), k) for k, xs in kinds.items() for x in xs for f in forms]
    return rng.sample(rows, PER_TASK)


def continents(rng):
    cities = {"Europe": ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Oslo", "Warsaw", "Prague", "Dublin"],
              "Asia": ["Tokyo", "Beijing", "Delhi", "Bangkok", "Seoul", "Jakarta", "Manila", "Hanoi", "Karachi", "Dhaka"],
              "Africa": ["Nairobi", "Cairo", "Lagos", "Accra", "Dakar", "Addis Ababa", "Kampala", "Tunis", "Luanda",
                         "Harare"],
              "America": ["Chicago", "Toronto", "Lima", "Bogota", "Santiago", "Havana", "Quito", "Denver", "Caracas",
                          "Montevideo"]}
    forms = ["{x}", "the city of {x}", "{x}, a big city", "downtown {x}"]
    rows = [(f.format(x=x), k) for k, xs in cities.items() for x in xs for f in forms]
    return rng.sample(rows, PER_TASK)


def questions(rng):
    subjects = ["you", "they", "we", "your sister", "the team", "our neighbours", "the teacher", "he", "she", "Tom"]
    verbs = ["park the car", "finish the report", "see the film", "call the bank", "book the hotel", "cook dinner",
             "fix the bike", "pay the bill"]
    rows = []
    for _ in range(PER_TASK):
        s, v = rng.choice(subjects), rng.choice(verbs)
        if rng.random() < 0.5:
            q = rng.choice(["Did {s} {v}", "Where did {s} {v}", "When will {s} {v}", "Why did {s} {v}",
                            "Can {s} {v}"]).format(s=s, v=v)
            rows.append((q + rng.choice(["?", ""]), "question"))
        else:
            st = rng.choice(["{s} did {v}", "{s} will {v} soon", "{s} could not {v}", "{s} wants to {v}",
                             "{s} forgot to {v}"]).format(s=s, v=v)
            rows.append((st[0].upper() + st[1:] + rng.choice([".", ""]), "statement"))
    return rows


def tense(rng):
    subjects = ["She", "My father", "The children", "We", "Our boss", "The dog", "I", "They"]
    verbs = [("walked", "walks", "will walk"), ("cooked", "cooks", "will cook"), ("played", "plays", "will play"),
             ("painted", "paints", "will paint"), ("cleaned", "cleans", "will clean"), ("visited", "visits", "will visit")]
    places = ["in the park", "at home", "every morning", "with friends", "after lunch", "near the river"]
    rows = []
    for _ in range(PER_TASK):
        k = rng.randrange(3)
        rows.append((f"{rng.choice(subjects)} {rng.choice(verbs)[k]} {rng.choice(places)}.",
                     ("past", "present", "future")[k]))
    return rows


def parity(rng):
    return [(str(n), "even" if n % 2 == 0 else "odd") for n in rng.sample(range(10, 1000), PER_TASK)]


def larger(rng):
    rows = []
    for _ in range(PER_TASK):
        a, b = rng.sample(range(1, 100), 2)
        rows.append((f"{a} or {b}", "first" if a > b else "second"))
    return rows


def urgency(rng):
    high = ["The server is down for all customers", "Payments are failing for everyone", "We cannot log in at all",
            "The website shows an error on every page", "Data is being deleted", "The checkout is broken",
            "All orders are stuck", "Our whole office lost access"]
    low = ["Could you change the font colour", "A typo on the about page", "Please add a dark mode someday",
           "The logo looks a bit blurry", "Can I rename my profile", "A suggestion for the newsletter",
           "The footer link is slightly off", "Question about next month's invoice format"]
    tails = ["", " since this morning", ", please help", ".", " (ticket from a customer)", " - thanks"]
    return _distinct(rng, {"high": high, "low": low}, tails)


def emotion(rng):
    words = {"joy": ["I can't stop smiling", "This is the best day ever", "I'm so happy for you", "What a delight",
                     "I laughed all evening"],
             "anger": ["I am furious about this", "This makes my blood boil", "How dare they do that",
                       "I'm so mad right now", "Stop wasting my time"],
             "fear": ["I'm scared to go out", "That noise terrifies me", "I'm afraid something is wrong",
                      "My hands are shaking with fear", "I dread tomorrow"],
             "sadness": ["I miss her so much", "I feel empty today", "Nothing matters anymore",
                         "I cried all night", "It's so lonely here"]}
    return _distinct(rng, words, ["", ".", "!", " today.", " again.", "..."])


def spam(rng):
    spam_ = ["WIN a FREE cruise now, click here", "You have been selected for a cash prize",
             "Cheap meds, no prescription needed", "Claim your reward before midnight", "Earn $5000 a week from home",
             "Your account will be closed, verify now at this link"]
    ham = ["Are we still meeting for lunch tomorrow", "Here are the notes from today's class",
           "Can you pick up milk on the way home", "The report is attached, see page 3",
           "Happy birthday, hope you have a great day", "The train is late, I'll be there at 6"]
    return _distinct(rng, {"spam": spam_, "ham": ham}, ["", "!", ".", "!!", " :)", " - sent from my phone", "?",
                                                       " (forwarded)"])


def _distinct(rng, by_label: dict[str, list[str]], ends: list[str]) -> list[tuple[str, str]]:
    """PER_TASK examples split evenly over the labels, each a distinct sentence + ending."""
    n = PER_TASK // len(by_label)
    return [(text, label) for label, xs in by_label.items()
            for text in rng.sample([x + e for x in xs for e in ends], n)]


TASKS = {   # task -> (make, prompt, dataset format)
    "animal": (animals, "Mammal, bird or fish? {text}", "jsonl"),
    "continent": (continents, "Which continent is this city in? {text}", "jsonl"),
    "question": (questions, "Is this a question or a statement? {text}", "jsonl"),
    "tense": (tense, "Past, present or future? {text}", "jsonl"),
    "parity": (parity, "Is this number even or odd? {text}", "jsonl"),
    "larger": (larger, "Which number is larger, the first or the second? {text}", "jsonl"),
    "urgency": (urgency, "Support ticket: {text}\nUrgency (high or low)?", "folder"),
    "emotion": (emotion, "How does the writer feel? {text}", "jsonl"),
    "spam": (spam, "Spam or ham? {text}", "jsonl"),
}


def write(out: Path, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for task, (make, prompt, fmt) in TASKS.items():
        rows = make(random.Random(f"{seed}:{task}"))
        if fmt == "folder":           # <label>/<n>.txt, as a user might keep texts sorted into folders
            for i, (text, label) in enumerate(rows):
                (out / task / label).mkdir(parents=True, exist_ok=True)
                (out / task / label / f"{i:03d}.txt").write_text(text + "\n", encoding="utf-8")
            dataset = f"{task}/"
        else:
            dataset = f"{task}.jsonl"
            (out / dataset).write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows),
                                       encoding="utf-8")
        entries.append({"task": task, "requirement": REQUIREMENT, "dataset": dataset, "prompt": prompt})
    spec = out / "spec.json"
    spec.write_text(json.dumps({"sources": entries}, indent=1) + "\n", encoding="utf-8")
    return spec


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_tasks.py OUT_DIR")
    print(write(Path(sys.argv[1])))
