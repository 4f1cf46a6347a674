"""Named access to a model's weights: matrices as in-place QTensors, small vectors as f32 copies."""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np

from engine.errors import ModelLoadError
from engine.formats.gguf import GGUFFile
from engine.kernels import packed
from engine.kernels.quant_types import QTensor


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if hasattr(mmap, "MADV_HUGEPAGE") else None)  # Linux 5.14+


class Weights:
    """GGUF tensor names without the `.weight` suffix are our internal names (`blk.3.attn_q`)."""

    def __init__(self, gguf: GGUFFile):
        self._file = gguf
        self._tensors: dict[str, QTensor] = {}
        self._vectors: dict[str, np.ndarray] = {}
        self.packed_buffer: np.ndarray | None = None  # every packed copy (pack()), one anonymous buffer

    def has(self, name: str) -> bool:
        return self._file.has(name + ".weight")

    def tensor(self, name: str) -> QTensor:
        t = self._tensors.get(name)
        if t is None:
            t = self._tensors[name] = self._file.tensor(name + ".weight")
        return t

    def vector(self, name: str) -> np.ndarray:
        # Norm weights are tiny and read every layer: dequantize once, keep as f32.
        v = self._vectors.get(name)
        if v is None:
            v = self._vectors[name] = self._file.vector(name + ".weight")
        return v

    def buffer(self) -> np.ndarray | None:
        """The one uint8 buffer every tensor views (the mapped file), or None for a split model."""
        return self._file.data

    def pack(self, names: list[str]) -> int:
        """Give the named matrices of a packable type a packed copy (kernels/packed.py) in one anonymous buffer,
        then drop their mapped pages from this process (the kernels never read them again: resident memory stays
        the file's size). Returns the bytes packed. Once per model, before the decode step is built."""
        todo = [(n, t) for n in names if (t := self.tensor(n)).ggml_type in packed.PACKABLE
                and packed.packed_rows(t.rows) and t.packed is None]
        sizes = [packed.packed_rows(t.rows) * t.raw.shape[1] for _, t in todo]
        if not todo:
            return 0
        buf = self._anonymous(sum(sizes))
        off = 0
        for (name, t), size in zip(todo, sizes):
            dst = buf[off : off + size]
            self._advise(t.raw, _MADV_POPULATE_READ)  # one call maps the pages instead of a fault per 64 KiB
            packed.repack(t.raw, t.ggml_type, dst)
            view = dst.view()
            view.flags.writeable = False
            self._tensors[name] = dataclasses.replace(t, packed=view)
            off += size
        # Only after the last one: where the page cache holds the file in huge pages, populating one tensor maps
        # its neighbours' pages too.
        for _, t in todo:
            self._advise(t.raw[: packed.packed_rows(t.rows)], mmap.MADV_DONTNEED)
        self.packed_buffer = buf
        return off

    def _anonymous(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer in private anonymous memory, 2 MiB aligned and asking for transparent huge pages where
        the OS has them: filling 237 MB of 4 KiB pages took 0.7 s of page faults here, huge pages 0.2 s (and
        decode's streams then cross fewer TLB entries)."""
        huge = 2 << 20
        if not hasattr(mmap, "MAP_ANONYMOUS") or not hasattr(mmap, "MADV_HUGEPAGE"):
            return np.empty(nbytes, np.uint8)
        self._anon_map = m = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = (-np.frombuffer(m, np.uint8, 1).__array_interface__["data"][0]) % huge
        whole = (nbytes + huge - 1) // huge * huge
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, min(whole, len(m) - start))
        except OSError:  # huge pages switched off: 4 KiB pages work the same, only slower to fill
            pass
        return np.frombuffer(m, np.uint8, nbytes, start)

    def _advise(self, raw: np.ndarray, advice: int) -> None:
        """madvise the whole pages under raw (a view of the mapped file): MADV_DONTNEED unmaps them from this
        process (reading them again would fault them back in from the page cache). Best effort: a kernel
        without the advice, or a split model, is left as it is."""
        m = getattr(self._file, "_map", None)
        if m is None or advice is None:
            return
        start = raw.__array_interface__["data"][0] - self._file.data.__array_interface__["data"][0]
        lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + raw.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            try:
                m.madvise(advice, lo, hi - lo)
            except OSError:
                pass

    def optional_vector(self, name: str) -> np.ndarray | None:
        return self.vector(name) if self.has(name) else None

    def require(self, names: list[str]) -> None:
        missing = [n for n in names if not self.has(n)]
        if missing:
            raise ModelLoadError(f"{self._file.path.name}: missing tensors {', '.join(missing[:5])}"
                                 + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
