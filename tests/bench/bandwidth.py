#!/usr/bin/env python3
"""The machine's memory read bandwidth (not a test): a compiled, threaded sum over a buffer far larger than the caches,
the best of several reads. Decode reads every weight once a token, so decode tokens/s x the bytes a token reads over
this figure is the share of the machine's bandwidth a decode uses (bench_speed.py reports it in the same sitting).

    PYTHONPATH=. .venv/bin/python tests/bench/bandwidth.py [--gib 1.0] [--reps 7] [--threads N]

Prints one JSON line: {"read_gb_s": best, "reads_gb_s": [...], "gib": ..., "threads": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def read_bandwidth(gib: float = 1.0, reps: int = 7) -> tuple[float, list[float]]:
    """(best, every) GB/s of summing a gib-GiB buffer with numba's threads (NUMBA_NUM_THREADS, set before import)."""
    import engine.kernels.cpu  # noqa: F401  (its threading-layer preference, before numba's first parallel launch)
    from numba import njit, prange

    @njit(parallel=True, cache=False)
    def _sum(a):
        total = 0
        for i in prange(a.shape[0]):
            total += a[i]
        return total

    buf = np.ones(int(gib * 2**30) // 8, np.uint64)  # (written once: every page is real memory, not the zero page)
    _sum(buf[:1024])  # compiles
    reads = []
    for _ in range(reps):
        t = time.perf_counter()
        _sum(buf)
        reads.append(buf.nbytes / (time.perf_counter() - t) / 1e9)
    return max(reads), [round(r, 1) for r in reads]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    os.environ["NUMBA_NUM_THREADS"] = str(a.threads)
    best, reads = read_bandwidth(a.gib, a.reps)
    print(json.dumps({"read_gb_s": round(best, 1), "reads_gb_s": reads, "gib": a.gib, "threads": a.threads}))


if __name__ == "__main__":
    main()
