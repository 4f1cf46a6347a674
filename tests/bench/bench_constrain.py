#!/usr/bin/env python3
"""Grammar-mask overhead (not a test): what a constrained token costs on top of the model step.

Greedy-decodes --tokens tokens of a JSON-schema answer and of an `auto` tool-call answer, timing the
grammar processor (matcher advance + mask + apply) and the model step separately, per token.

Usage:
  python tests/bench/bench_constrain.py [MODEL] [--tokens 40]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import engine
from engine.constrain import grammar_processor, json_schema_grammar
from engine.constrain.tools import tool_call_grammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()
    m = engine.load_model(args.model)
    tok = m.tokenizer
    t0 = time.perf_counter()
    grammar_processor(tok, json_schema_grammar({"type": "object"}))
    print(f"llguidance tokenizer + first matcher: {time.perf_counter() - t0:.2f} s (once per model)")
    cases = [("json_schema", json_schema_grammar(SCHEMA)),
             ("tools auto", tool_call_grammar([{"name": "f", "parameters": {"type": "object"}}], forced=False))]
    for label, g in cases:
        proc = grammar_processor(tok, g)
        ids = tok.encode(m.render_chat([{"role": "user", "content": "A person as JSON"}]))
        cache = m.new_cache(len(ids) + args.tokens + 1)
        logits, hist = m.prefill(ids, cache)[0], list(ids)
        t_mask = t_eval = 0.0
        n = 0
        for _ in range(args.tokens):
            t0 = time.perf_counter()
            t = int(np.argmax(proc(logits.copy(), hist)))
            hist.append(t)
            proc.accept(t)
            t1 = time.perf_counter()
            t_mask += t1 - t0
            n += 1
            if t in tok.eog_ids:
                break
            logits = m.decode([t], [cache])[0]
            t_eval += time.perf_counter() - t1
        print(f"{label:12s} grammar {1000 * t_mask / n:.2f} ms/token, model step {1000 * t_eval / max(1, n - 1):.1f} "
              f"ms/token ({n} tokens)")


if __name__ == "__main__":
    main()
