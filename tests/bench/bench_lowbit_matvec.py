"""The int8 matvec of the low-bit types against Q4_K's (not a test): whether Q2_K, Q3_K and the lattice types (--types
IQ2_XS,IQ3_XXS,...) read their smaller rows at least at Q4_K's rate, so a decode over them runs at memory speed.

    PYTHONPATH=. .venv/bin/python tests/bench/bench_lowbit_matvec.py [--rows 8960] [--cols 1536] [--m 1] \\
        [--reps 200] [--stream-mb 512] [--threads N] [--tier vnni] [--types Q4_K,Q3_K,Q2_K]

Weights are random blocks with finite f16 scales (speed does not depend on the values), in Qwen2.5-1.5B's FFN
shape by default (gate/up: 8960 rows of 1536; --rows 1536 --cols 8960 for down). Two regimes, best of the reps:
  hot     the same matrix every call (it stays in L2/L3: the kernels' compute rate)
  stream  each call reads the next of enough copies to fill --stream-mb (what a decode sees: DRAM)
Prints per type: weight bytes, then us per call, GB/s of weight bytes read and ns per row, for each regime.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from engine.kernels.cpu import int8, ir
from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType
from testdata import make_fixtures

G = GGMLType
F16_FIELDS = {G.Q2_K: (80, 82), G.Q3_K: (108,), G.Q4_K: (0, 2)}  # byte offsets of each block's f16 d (and dmin)


def random_blocks(t: GGMLType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    if t not in F16_FIELDS:  # (the lattice types: the fixtures' random blocks, with sane scales)
        return make_fixtures.random_weight(rng, rows, cols, t)
    block, size = BLOCK_GEOMETRY[t]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        d = rng.uniform(-0.01, 0.01, raw.shape[:2]).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return raw.reshape(rows, -1)


def best_of(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8960)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--m", type=int, default=1, help="activation vectors per call")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--stream-mb", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tier", default=None)
    ap.add_argument("--types", default="Q4_K,Q3_K,Q2_K")
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.m, args.cols)).astype(np.float32)
    print(f"W ({args.rows}, {args.cols}), M = {args.m}, {numba.get_num_threads()} threads, "
          f"tier {args.tier or ir.TIER}")
    for t in (G[name] for name in args.types.split(",")):
        w = random_blocks(t, args.rows, args.cols, rng)
        copies = [int8.prepare([(w, t)])] + [int8.prepare([(w.copy(), t)])
                                             for _ in range(max(1, args.stream_mb * 2**20 // w.nbytes) - 1)]
        qin = int8.quantize(x, copies[0])
        out = np.empty((args.m, args.rows), np.float32)
        int8.matvec(copies[0], qin, out, tier=args.tier)  # compile
        hot = best_of(lambda: int8.matvec(copies[0], qin, out, tier=args.tier), args.reps)
        it = iter(range(10**9))
        stream = best_of(lambda: int8.matvec(copies[next(it) % len(copies)], qin, out, tier=args.tier),
                         max(args.reps, 2 * len(copies)))
        cells = [f"{name} {s * 1e6:8.1f} us {w.nbytes / s / 1e9:6.1f} GB/s {s * 1e9 / args.rows:6.1f} ns/row"
                 for name, s in (("hot", hot), ("stream", stream))]
        print(f"{t.name:5s} {w.nbytes / 2**20:6.2f} MiB | " + " | ".join(cells))


if __name__ == "__main__":
    main()
