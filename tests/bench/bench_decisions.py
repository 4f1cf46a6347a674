"""Decisions: what a request's questions cost beside one question, over a long shared state (issue 25's figure:
a 5-question request over a 1,000-token state <= 1.5x one question, because the state is prefilled once).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python tests/bench/bench_decisions.py \\
        [--model smollm2-135m] [--reps 5] [--state-tokens 1000]

In process (engine.decisions.scoring.score_request, as the server's route runs it), taking turns rep by rep:
one question, five questions with the shared state, and the same five with each prompt prefilled whole (what a
server without the sharing would pay). Prints one JSON line of medians; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SENTENCE = ("The customer wrote again about the delayed refund for order 4471, which was placed in March, paid by "
            "card, shipped late, and returned unopened after the courier left it at the wrong address. ")
QUESTIONS = {
    "department": {"type": "choice", "instructions": "Which team should handle this?",
                   "criteria": {"billing": "Payments, refunds", "shipping": "Deliveries, couriers",
                                "technical": "Bugs, outages", "sales": None}},
    "is_urgent": {"type": "noul", "instructions": "Is this urgent?"},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["Can wait", "This week", "Today"]},
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--state-tokens", type=int, default=1000)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from engine import load_model
    from engine.api.decisions import parse_decision_request
    from engine.decisions.scoring import score_request

    model = load_model(args.model)
    state, n = "", 0
    while n < args.state_tokens:
        state += SENTENCE
        n = len(model.tokenizer.encode(state, add_bos=False))
    one = parse_decision_request({"state": state, "questions": {"department": QUESTIONS["department"]}})
    five = parse_decision_request({"state": state, "questions": QUESTIONS})
    score_request(model, one, "chat-v1")  # warm: compiled kernels loaded, scratch grown
    runs: dict[str, list[float]] = {"one question": [], "five, shared state": [], "five, each whole": []}
    tokens = {}
    for rep in range(args.reps):
        for name, req, share in (("one question", one, True), ("five, shared state", five, True),
                                 ("five, each whole", five, False)):
            t = time.perf_counter()
            scored = score_request(model, req, "chat-v1", share_state=share)
            runs[name].append(time.perf_counter() - t)
            tokens[name] = scored.input_tokens
            print(f"rep {rep + 1}: {name} {runs[name][-1]:.3f} s ({scored.input_tokens} tokens)", file=sys.stderr)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({"model": args.model, "state_tokens": n, "seconds": runs,
                      "median_s": medians, "tokens_prefilled": tokens,
                      "five_over_one": medians["five, shared state"] / medians["one question"],
                      "whole_over_one": medians["five, each whole"] / medians["one question"]}))


if __name__ == "__main__":
    main()
