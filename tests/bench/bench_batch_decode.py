#!/usr/bin/env python3
"""Batched decode benchmark (not a test): the time of one `Model.decode` step for M = 1, 2, 4, 8 sequences.

Each sequence holds --context tokens first; the step is timed over 32 calls (best of --reps), then each cache is cut
back. Prints the step time and the tokens per second it gives all the sequences together: what a scheduler that
decodes them side by side can reach at most (docs/benchmarks.md, "Serving").

Usage:
  python tests/bench/bench_batch_decode.py MODEL.gguf [--context 128] [--reps 3] [--batch 1 2 4 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402

STEPS = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    a = ap.parse_args()
    model = engine.load_model(a.model)
    ids = model.tokenizer.encode("The history of mechanical clocks begins in medieval Europe. " * 200)[: a.context]
    for M in a.batch:
        caches = [model.new_cache(a.context + STEPS + 8) for _ in range(M)]
        for c in caches:
            model.prefill(ids, c)
        snaps = [c.snapshot() for c in caches]
        model.decode([5] * M, caches)
        best = float("inf")
        for _ in range(a.reps):
            for c, s in zip(caches, snaps):
                c.restore(s)
            t = time.perf_counter()
            for _ in range(STEPS):
                model.decode([5] * M, caches)
            best = min(best, (time.perf_counter() - t) / STEPS)
        print(f"M={M}: step {best * 1e3:.2f} ms, {M / best:.0f} tok/s over the {M} sequences", flush=True)


if __name__ == "__main__":
    main()
