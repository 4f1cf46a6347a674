"""The CPU backend's weight layout: the 4/5-bit legacy matrices' row-interleaved copies (packed.py) in one
anonymous buffer, made once at load; the mapped pages of the originals are then let go."""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np

from engine.kernels.backend import Weights
from engine.kernels.cpu import packed


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if hasattr(mmap, "MADV_HUGEPAGE") else None)  # Linux 5.14+


def pack(weights: Weights, names: list[str]) -> np.ndarray | None:
    """Give the named matrices of a packable type a packed copy in one anonymous buffer (returned; None where
    none is packable), then drop their mapped pages from this process (the kernels never read them again:
    resident memory stays the file's size)."""
    todo = [(n, t) for n in names if (t := weights.tensor(n)).ggml_type in packed.PACKABLE
            and packed.packed_rows(t.rows) and t.packed is None]
    sizes = [packed.packed_rows(t.rows) * t.raw.shape[1] for _, t in todo]
    if not todo:
        return None
    buf = anonymous(sum(sizes))
    off = 0
    for (name, t), size in zip(todo, sizes):
        dst = buf[off : off + size]
        weights.advise(t.raw, _MADV_POPULATE_READ)  # one call maps the pages instead of a fault per 64 KiB
        packed.repack(t.raw, t.ggml_type, dst)
        view = dst.view()
        view.flags.writeable = False
        weights.replace(name, dataclasses.replace(t, packed=view))
        off += size
    # Only after the last one: where the page cache holds the file in huge pages, populating one tensor maps
    # its neighbours' pages too.
    for _, t in todo:
        weights.advise(t.raw[: packed.packed_rows(t.rows)], mmap.MADV_DONTNEED)
    return buf


def anonymous(nbytes: int) -> np.ndarray:
    """A uint8 buffer in private anonymous memory, 2 MiB aligned and asking for transparent huge pages where
    the OS has them: filling 237 MB of 4 KiB pages took 0.7 s of page faults here, huge pages 0.2 s (and
    decode's streams then cross fewer TLB entries). The array keeps its mapping alive."""
    huge = 2 << 20
    if not hasattr(mmap, "MAP_ANONYMOUS") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, np.uint8)
    m = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (-np.frombuffer(m, np.uint8, 1).__array_interface__["data"][0]) % huge
    whole = (nbytes + huge - 1) // huge * huge
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, min(whole, len(m) - start))
    except OSError:  # huge pages switched off: 4 KiB pages work the same, only slower to fill
        pass
    return np.frombuffer(m, np.uint8, nbytes, start)
