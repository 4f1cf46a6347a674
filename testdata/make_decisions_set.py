"""Write testdata/decisions/reviews.jsonl: a labelled set for `goinfer decisions-calibrate` (docs/decisions.md).

240 short product reviews, seeded, each built from a product of one of four topics and one or two sentiment
phrases, so every answer is known by construction:
    positive   noul    "Is this review positive?"          true when every phrase is positive
    topic      choice  food / electronics / travel / clothing
    rating     score   0 negative, 1 mixed (one phrase of each), 2 positive

    python -m testdata.make_decisions_set            (rewrites the file; the seed makes it the same file)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "decisions" / "reviews.jsonl"
ITEMS = 240

TOPICS = {
    "food": ["pasta sauce", "coffee beans", "chocolate bar", "frozen pizza", "green tea", "olive oil", "granola"],
    "electronics": ["phone charger", "laptop", "pair of headphones", "smartwatch", "keyboard", "camera", "router"],
    "travel": ["hotel stay", "flight", "train journey", "guided tour", "beach resort", "city break", "ferry trip"],
    "clothing": ["winter jacket", "pair of jeans", "running shoes", "wool sweater", "rain coat", "t-shirt", "scarf"],
}
POSITIVE = ["I loved it", "it exceeded my expectations", "great value for the money", "I would buy it again",
            "absolutely wonderful", "it works perfectly", "the quality is excellent", "highly recommended"]
NEGATIVE = ["I hated it", "it was a complete waste of money", "it broke after two days", "never again",
            "terrible quality", "it was a huge disappointment", "I want a refund", "it did not work at all"]
QUESTIONS = {
    "positive": {"type": "noul", "instructions": "Is this review positive?"},
    "topic": {"type": "choice", "instructions": "What is the review about?",
              "criteria": {"food": "Food and drink", "electronics": "Gadgets and devices",
                           "travel": "Trips, flights and hotels", "clothing": "Clothes and shoes"}},
    "rating": {"type": "score", "instructions": "How does the reviewer rate it?",
               "criteria": ["Negative", "Mixed", "Positive"]},
}


def items(seed: int = 25) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n in range(ITEMS):
        topic = list(TOPICS)[n % 4]
        product = rng.choice(TOPICS[topic])
        rating = rng.choice([0, 0, 1, 2, 2])
        phrases = {0: [rng.choice(NEGATIVE)], 2: [rng.choice(POSITIVE)],
                   1: [rng.choice(POSITIVE), rng.choice(NEGATIVE)]}[rating]
        rng.shuffle(phrases)
        state = f"Review of a {product}: " + ", but ".join(phrases) + "."
        out.append({"state": state, "questions": QUESTIONS,
                    "answers": {"positive": rating == 2, "topic": topic, "rating": rating}})
    return out


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(item) + "\n" for item in items()), encoding="utf-8")
    print(f"wrote {OUT} ({ITEMS} items)")


if __name__ == "__main__":
    main()
