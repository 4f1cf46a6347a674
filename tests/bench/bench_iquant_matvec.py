#!/usr/bin/env python3
"""The int8 matvec (engine/kernels/cpu/int8.py) over the low-bit types IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 against Q4_K
and Q4_0 (IQ4_NL's layout), one decode vector (M = 1), on random blocks with finite scales (speed does not depend
on the values). Not a test.

Two shapes, 1536 x 8960 and 8960 x 1536 (rows x columns: a 1.5B model's ffn_down and ffn_up). Two ways:
  hot     the same matrix every call (it fits in L3: cache-resident speed, the kernels' compute rate)
  stream  each call takes the next of copies totalling >= 256 MB (what decode sees: weights come from DRAM)
Each figure is the best of several passes over the set, a pass timed whole (a single call's minimum is biased,
docs/benchmarks.md); GB/s counts the weight bytes as stored, ns/row is per output row. --cpu-time (one thread
only: the caller's thread runs the one chunk) times the thread's CPU time instead of the wall clock, so a busy
shared box's descheduling does not count (its cache and memory contention still does).

Usage: python tests/bench/bench_iquant_matvec.py [--threads 1 [--cpu-time]] [--tier vnni] [--passes 5] [--hot-only]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from engine.kernels.cpu import int8, ir
from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType, row_bytes

G = GGMLType
TYPES = [G.Q4_K, G.Q4_0, G.IQ4_NL, G.IQ4_XS, G.TQ2_0, G.TQ1_0]
D_OFFSET = {G.Q4_0: 0, G.Q4_1: 0, G.Q8_0: 0, G.Q4_K: 0, G.IQ4_NL: 0, G.IQ4_XS: 0, G.TQ1_0: 52, G.TQ2_0: 64}  # each block's f16 d
SHAPES = [(1536, 8960), (8960, 1536)]
STREAM_BYTES = 256 << 20


def random_weight(rng, t: GGMLType, rows: int, cols: int) -> np.ndarray:
    """Random bytes with each block's d (and Q4_K's dmin) set to a small finite f16."""
    raw = rng.integers(0, 256, (rows, row_bytes(t, cols)), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, BLOCK_GEOMETRY[t][1])
    o = D_OFFSET[t]
    n = 2 if t == G.Q4_K else 1
    d = (rng.random(blocks.shape[:2] + (n,)) * 0.01).astype(np.float16)
    blocks[..., o:o + 2 * n] = d.view(np.uint8).reshape(*blocks.shape[:2], 2 * n)
    return raw


def bench(ws, qin, tier, n_chunks, passes, clock=time.perf_counter) -> float:
    """Seconds per call: best of `passes` passes over the matrices ws (prepared), each pass timed whole."""
    out = np.empty((1, ws[0].rows), np.float32)
    for w in ws[:2]:
        int8.matvec(w, qin, out, tier=tier, n_chunks=n_chunks)  # compile, warm
    best = float("inf")
    reps = max(1, 64 // len(ws))
    for _ in range(passes):
        t0 = clock()
        for _ in range(reps):
            for w in ws:
                int8.matvec(w, qin, out, tier=tier, n_chunks=n_chunks)
        best = min(best, (clock() - t0) / (reps * len(ws)))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--tier", default=ir.TIER, choices=ir.available_tiers())
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--types", default=",".join(t.name for t in TYPES), help="comma-separated")
    ap.add_argument("--hot-only", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="the thread's CPU time (with --threads 1)")
    a = ap.parse_args()
    if a.cpu_time and a.threads != 1:
        ap.error("--cpu-time needs --threads 1")
    clock = time.thread_time if a.cpu_time else time.perf_counter
    rng = np.random.default_rng(0)
    print(f"tier {a.tier}, {a.threads} thread(s), M = 1; {'CPU' if a.cpu_time else 'wall'} us per matvec")
    print(f"{'shape':>11} {'type':>7} {'MB':>6} | {'hot us':>8} {'GB/s':>6} {'ns/row':>7} | {'stream us':>9} "
          f"{'GB/s':>6} {'ns/row':>7}")
    for rows, cols in SHAPES:
        x = rng.standard_normal((1, cols)).astype(np.float32)
        for name in a.types.split(","):
            t = G[name]
            w = random_weight(rng, t, rows, cols)
            qin = int8.quantize(x, [t])
            hot = bench([int8.prepare([(w, t)])], qin, a.tier, a.threads, a.passes, clock)
            cold = float("nan")
            if not a.hot_only:
                stream = [int8.prepare([(w.copy(), t)]) for _ in range(max(2, -(-STREAM_BYTES // w.nbytes)))]
                cold = bench(stream, qin, a.tier, a.threads, a.passes, clock)
                del stream
            mb = w.nbytes / 1e6
            print(f"{rows:>5}x{cols:<5} {t.name:>7} {mb:6.2f} | {hot * 1e6:8.1f} {w.nbytes / hot / 1e9:6.1f} "
                  f"{hot * 1e9 / rows:7.1f} | {cold * 1e6:9.1f} {w.nbytes / cold / 1e9:6.1f} {cold * 1e9 / rows:7.1f}")


if __name__ == "__main__":
    main()
