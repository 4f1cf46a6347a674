"""The C heap under a prompt's forward pass: keep freed activations for the next layer, hand them back after.

A prompt allocates and frees the same big temporaries layer after layer (a 512-token Gemma-3-270M chunk: the
(T, 2F) gate|up result 8 MB, its activation 4 MB, norms, attention scores, ~20 arrays of 1-8 MB per layer).
With glibc's defaults each came back as fresh pages the kernel had to fault in and zero: blocks above the mmap
threshold are mmapped and unmapped on free, and the heap's top is trimmed on free. That cost about a fifth of a
Gemma prompt's time in page faults and zeroing (docs/benchmarks.md, "Measurements behind the code", C heap).
So: blocks up to 256 MB come from the heap, the heap is never trimmed on free and grows in 64 MB steps (address
space: pages only count once touched), and `release_free_memory` returns the free pages to the OS once the prompt
is done (Model.eval calls it), so a model that sits decoding or idle holds what it held before. Same prompt
afterwards: a small fraction of the faults.

glibc only (Linux): elsewhere these are no-ops. A MALLOC_*_ variable the user set wins over our setting.
"""

from __future__ import annotations

import ctypes
import gc
import os

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
_SETTINGS = ((_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 256 << 20),
             (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 1 << 30),
             (_M_TOP_PAD, "MALLOC_TOP_PAD_", 64 << 20))


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc has both; musl has neither)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def tune_allocator() -> None:
    """Apply the settings above (idempotent)."""
    if _LIBC is None:
        return
    for param, env, value in _SETTINGS:
        if env not in os.environ:
            _LIBC.mallopt(param, value)


def trim() -> None:
    """Return the heap's free pages to the OS (glibc keeps them otherwise): a few ms."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def release_free_memory() -> None:
    """Collect unreachable Python objects, then trim (after loading: building a 262k-token vocabulary leaves
    ~80 MB of freed heap behind)."""
    gc.collect()
    trim()
