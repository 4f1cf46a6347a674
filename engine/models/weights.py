"""Named access to a model's weights: matrices as in-place QTensors, small vectors as f32 copies."""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np

from engine.errors import ModelLoadError
from engine.formats.gguf import GGUFFile
from engine.kernels import packed
from engine.kernels.quant_types import QTensor


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
        buf = np.empty(sum(sizes), np.uint8)
        off = 0
        for (name, t), size in zip(todo, sizes):
            dst = buf[off : off + size]
            packed.repack(t.raw, t.ggml_type, dst)
            view = dst.view()
            view.flags.writeable = False
            self._tensors[name] = dataclasses.replace(t, packed=view)
            self._forget_pages(t.raw[: packed.packed_rows(t.rows)])
            off += size
        self.packed_buffer = buf
        return off

    def _forget_pages(self, raw: np.ndarray) -> None:
        """Unmap the whole pages of raw (a view of the mapped file) from this process; reading them again
        would just fault them back in from the page cache."""
        m = getattr(self._file, "_map", None)
        base = self._file.data.__array_interface__["data"][0] if m is not None else None
        if base is None:
            return
        start = raw.__array_interface__["data"][0] - base
        lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + raw.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def optional_vector(self, name: str) -> np.ndarray | None:
        return self.vector(name) if self.has(name) else None

    def require(self, names: list[str]) -> None:
        missing = [n for n in names if not self.has(n)]
        if missing:
            raise ModelLoadError(f"{self._file.path.name}: missing tensors {', '.join(missing[:5])}"
                                 + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
