"""Write Kunlun's shipped multiple-choice evaluation set, ``general-mc.jsonl``.

Every item is written here, from small tables of common facts (capitals, opposites, animals,
plurals, days and months, counts, colours, simple sums), four choices each, the distractors
drawn from the same table and the answer's place shuffled, all with a fixed seed: the file is
the same on every run. One JSON object per line: ``question``, ``choices``, ``answer`` (the
index of the right choice), ``topic``. Chance is 25 %.

Usage: ``python scripts/make-eval-set.py [OUT]`` (default: the copy the package ships,
``src/kunlun/validate/data/general-mc.jsonl``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src/kunlun/validate/data/general-mc.jsonl"
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow",
    "the United Kingdom": "London", "Egypt": "Cairo", "Greece": "Athens",
    "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Poland": "Warsaw", "Ireland": "Dublin", "Hungary": "Budapest",
    "the Czech Republic": "Prague", "Belgium": "Brussels", "the Netherlands": "Amsterdam",
    "Thailand": "Bangkok", "South Korea": "Seoul", "Kenya": "Nairobi", "Argentina": "Buenos Aires",
    "Peru": "Lima", "Chile": "Santiago", "Mexico": "Mexico City", "Cuba": "Havana",
    "Canada": "Ottawa", "Australia": "Canberra", "India": "New Delhi", "Iran": "Tehran",
    "Iraq": "Baghdad", "Turkey": "Ankara", "Ukraine": "Kyiv", "Romania": "Bucharest",
    "Vietnam": "Hanoi", "the Philippines": "Manila", "Indonesia": "Jakarta",
    "Colombia": "Bogota", "Venezuela": "Caracas", "Morocco": "Rabat", "Nigeria": "Abuja",
    "Ethiopia": "Addis Ababa", "Saudi Arabia": "Riyadh", "Switzerland": "Bern",
    "New Zealand": "Wellington", "Brazil": "Brasilia",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "day": "night",
    "open": "closed", "light": "dark", "happy": "sad", "young": "old", "full": "empty",
    "early": "late", "wet": "dry", "hard": "soft", "high": "low", "strong": "weak",
    "rich": "poor", "long": "short", "loud": "quiet", "thick": "thin", "win": "lose",
    "buy": "sell", "push": "pull", "inside": "outside", "before": "after", "first": "last",
    "true": "false", "left": "right", "north": "south", "east": "west",
}  # fmt: skip
KINDS = {
    "bird": ["eagle", "sparrow", "owl", "parrot", "penguin", "pigeon", "robin", "swan"],
    "fish": ["salmon", "trout", "tuna", "cod", "shark", "carp", "herring", "goldfish"],
    "mammal": ["dog", "horse", "whale", "cat", "cow", "elephant", "lion", "rabbit"],
    "insect": ["ant", "bee", "butterfly", "beetle", "mosquito", "fly", "wasp", "grasshopper"],
    "fruit": ["apple", "banana", "orange", "pear", "grape", "cherry", "mango", "lemon"],
    "vegetable": ["carrot", "potato", "onion", "cabbage", "spinach", "broccoli", "lettuce",
                  "pea"],
}  # fmt: skip
PLURALS = {
    "mouse": "mice", "child": "children", "foot": "feet", "tooth": "teeth", "man": "men",
    "woman": "women", "goose": "geese", "person": "people", "box": "boxes", "city": "cities",
    "knife": "knives", "leaf": "leaves", "wolf": "wolves", "baby": "babies", "bus": "buses",
    "church": "churches", "glass": "glasses", "potato": "potatoes", "ox": "oxen",
    "cactus": "cacti",
}  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]  # fmt: skip
COUNTS = {
    "legs does a spider have": 8, "legs does an insect have": 6, "legs does a dog have": 4,
    "days are in a week": 7, "months are in a year": 12, "hours are in a day": 24,
    "minutes are in an hour": 60, "seconds are in a minute": 60, "sides does a triangle have": 3,
    "sides does a square have": 4, "sides does a hexagon have": 6, "wheels does a bicycle have": 2,
    "days are in a leap year": 366, "days are in a normal year": 365, "cents are in a dollar": 100,
    "centimetres are in a metre": 100, "grams are in a kilogram": 1000, "players are on a "
    "soccer team on the field": 11, "strings does a standard guitar have": 6,
    "continents are there on Earth": 7,
}  # fmt: skip
COLOURS = {
    "the sky on a clear day": "blue", "fresh grass": "green", "snow": "white", "coal": "black",
    "a ripe banana": "yellow", "a ripe tomato": "red", "an orange": "orange",
    "milk": "white", "a lemon": "yellow", "blood": "red", "a crow": "black",
    "the leaves of most trees in summer": "green", "chocolate": "brown",
    "a fire engine in most countries": "red", "the sea on a sunny day": "blue",
}  # fmt: skip
ALL_COLOURS = ["blue", "green", "white", "black", "yellow", "red", "orange", "brown", "purple",
               "pink", "grey"]  # fmt: skip


def item(rng: random.Random, topic: str, question: str, answer: str, pool: list[str]) -> dict:
    distractors = rng.sample(sorted({p for p in pool if p != answer}), 3)
    choices = [answer, *distractors]
    rng.shuffle(choices)
    return {"question": question, "choices": choices, "answer": choices.index(answer),
            "topic": topic}  # fmt: skip


def items() -> list[dict]:
    rng = random.Random(20261206)
    out = []
    capitals = list(CAPITALS.values())
    for country, capital in CAPITALS.items():
        out.append(item(rng, "capitals", f"What is the capital of {country}?", capital, capitals))
    words = [*OPPOSITES, *OPPOSITES.values()]
    for word, opposite in OPPOSITES.items():
        pool = [w for w in words if w not in (word, opposite) and OPPOSITES.get(w) != word]
        out.append(item(rng, "opposites", f"What is the opposite of '{word}'?", opposite,
                        pool + [opposite]))  # fmt: skip
    for kind, members in KINDS.items():
        others = [m for k, ms in KINDS.items() if k != kind for m in ms]
        for member in members[:6]:
            article = "an" if kind[0] in "aeiou" else "a"
            out.append(item(rng, "kinds", f"Which of these is {article} {kind}?", member,
                            others + [member]))  # fmt: skip
    plurals = list(PLURALS.values()) + list(PLURALS)
    for word, plural in PLURALS.items():
        pool = [p for p in plurals if p not in (word, plural)] + [plural]
        out.append(item(rng, "plurals", f"What is the plural of '{word}'?", plural, pool))
    for i, day in enumerate(DAYS):
        out.append(item(rng, "calendar", f"Which day comes after {day}?", DAYS[(i + 1) % 7],
                        DAYS))  # fmt: skip
    for i, month in enumerate(MONTHS):
        out.append(item(rng, "calendar", f"Which month comes after {month}?",
                        MONTHS[(i + 1) % 12], MONTHS))  # fmt: skip
    for what, count in COUNTS.items():
        pool = sorted({str(max(1, count + d)) for d in (-3, -2, -1, 1, 2, 3, count)})
        out.append(item(rng, "counts", f"How many {what}?", str(count), pool + [str(count)]))
    for thing, colour in COLOURS.items():
        out.append(item(rng, "colours", f"What colour is {thing}?", colour, ALL_COLOURS))
    for _ in range(40):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        total = a + b
        pool = [str(total + d) for d in (-3, -2, -1, 1, 2, 3)] + [str(total)]
        out.append(item(rng, "sums", f"What is {a} plus {b}?", str(total), pool))
    return out


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(i, ensure_ascii=False) for i in items()]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{out}: {len(lines)} items")


if __name__ == "__main__":
    main()
