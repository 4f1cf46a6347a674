"""How many threads the CPU kernels use: numba's parallel loops and the BLAS behind numpy.

One setting for both, so `--threads N` means N everywhere. (Numba's threading layer is chosen in this
package's __init__.py.)
"""

from __future__ import annotations

import os
import threading

import numba
from threadpoolctl import threadpool_limits

_limits = None  # keeps the BLAS limit in force for the life of the process
_local = threading.local()  # the count set_threads gave this thread (numba's own count is per thread too)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(n: int | None) -> int:
    """Use n threads (None: every core this process may run on); returns the number in force."""
    global _limits
    n = available_cores() if n is None else int(n)
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    n = min(n, numba.config.NUMBA_NUM_THREADS)  # numba cannot go above the count it started with
    numba.set_num_threads(n)
    _local.n = n
    _limits = threadpool_limits(limits=n, user_api="blas")
    return n


def get_threads() -> int:
    """The calling thread's count: as set_threads left it, else numba's. Read by the decode step every token,
    where numba.get_num_threads() costs more than a thread-local read (the interpreter's objects are cold after a
    step; docs/benchmarks.md, "Measurements behind the code", get_threads); a count that numba.set_num_threads
    changed behind our back only changes how many workers split the step, not a result."""
    n = getattr(_local, "n", None)
    return n if n is not None else numba.get_num_threads()
