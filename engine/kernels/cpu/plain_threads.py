"""Split a compiled kernel over plain threads instead of numba's parallel regions, for the kernels a prompt's pass
calls between BLAS calls.

Why: numba's OpenMP workers spin for a while after each parallel region, and OpenBLAS's threads spin after each
sgemm; on a machine with as many threads as cores, the two pools take turns starving each other. On the 2-core
dev VM a short prompt continuation (SmolLM2, int8 matvecs between the attention's small sgemms) ran an order of
magnitude slower with a parallel region in the matvec than with one BLAS thread or a passive OpenMP wait policy
(which costs decode a little), and a kernel that releases the GIL run on plain threads avoids the fight without
that cost (Gemma 3's prompts through the int8 GEMM were also slower with a parallel region). Figures:
docs/benchmarks.md, "Measurements behind the code", plain threads.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

_executor: ThreadPoolExecutor | None = None
_workers = 0


def _pool(n: int) -> ThreadPoolExecutor:
    """n - 1 helper threads (the caller runs a chunk itself), made once and grown when asked for more."""
    global _executor, _workers
    if _executor is None or _workers < n - 1:
        _workers = max(1, n - 1)
        _executor = ThreadPoolExecutor(max_workers=_workers, thread_name_prefix="goinfer-kernel")
    return _executor


def split(kernel: Callable, args: tuple, n: int) -> None:
    """kernel(*args, ch) for ch in 0..n-1 at once: chunk 0 on this thread, the others on helper threads. The
    kernel must release the GIL (numba nogil=True) and write disjoint parts of its output."""
    pending = [_pool(n).submit(kernel, *args, ch) for ch in range(1, n)] if n > 1 else []
    try:
        kernel(*args, 0)
    finally:
        for f in pending:
            f.result()
