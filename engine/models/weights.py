"""Named access to a model's weights: matrices as in-place QTensors, small vectors as f32 copies."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Protocol

import numpy as np

from engine.errors import ModelLoadError
from engine.kernels.quant_types import QTensor


class TensorSource(Protocol):
    """Where a model's tensors come from, by GGUF name: a GGUF file, a split GGUF, a converted Hugging Face
    checkpoint (models/hf_checkpoint.py)."""

    path: Path
    data: np.ndarray | None  # the one buffer every tensor views, None where there is none (split GGUF)

    def has(self, name: str) -> bool: ...
    def tensor(self, name: str) -> QTensor: ...
    def vector(self, name: str) -> np.ndarray: ...


class Weights:
    """GGUF tensor names without the `.weight` suffix are our internal names (`blk.3.attn_q`)."""

    def __init__(self, gguf: TensorSource):
        self._file = gguf
        self._tensors: dict[str, QTensor] = {}
        self._vectors: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return self.has_weight(name) or self._file.has(name)  # a parameter (`ssm_a`) or bias named in full

    def has_weight(self, name: str) -> bool:
        """Whether `name.weight` exists (what tensor(name) reads)."""
        return self._file.has(name + ".weight")

    def tensor(self, name: str) -> QTensor:
        t = self._tensors.get(name)
        if t is None:
            t = self._tensors[name] = self._file.tensor(name + ".weight")
        return t

    def parameter_count(self) -> int | None:
        """Every tensor's elements, where the source lists its tensors (GGUF); None where it does not."""
        entries = getattr(self._file, "entries", None)
        return sum(int(np.prod(e.shape)) for e in entries.values()) if entries else None

    def expert(self, name: str, e: int, n_expert: int) -> QTensor:
        """Expert e's matrix of a stacked expert tensor (`blk.0.ffn_up_exps`: n_expert matrices one under
        another), a view of its rows; the same object each time, so kernels may key their caches on it."""
        key = f"{name}.{e}"
        t = self._tensors.get(key)
        if t is None:
            stack = self.tensor(name)
            rows = stack.rows // n_expert
            t = self._tensors[key] = QTensor(key, stack.ggml_type, (rows, stack.cols),
                                             stack.raw[e * rows : (e + 1) * rows])
        return t

    def vector(self, name: str) -> np.ndarray:
        """A norm's weights (`blk.0.attn_norm`), f32."""
        return self._small(name + ".weight")

    def parameter(self, name: str) -> np.ndarray:
        """A small tensor GGUF names without a suffix (`blk.0.ssm_a`), f32, flat."""
        return self._small(name)

    def bias(self, name: str) -> np.ndarray:
        """The bias vector of a matrix (`blk.0.attn_q` -> `blk.0.attn_q.bias`), f32."""
        return self._small(name + ".bias")

    def _small(self, full_name: str) -> np.ndarray:
        # Norm weights and biases are tiny and read every layer: dequantize once, keep as f32.
        v = self._vectors.get(full_name)
        if v is None:
            v = self._vectors[full_name] = self._file.vector(full_name)
        return v

    def buffer(self) -> np.ndarray | None:
        """The one uint8 buffer every tensor views (the mapped file), or None for a split model."""
        return self._file.data

    def replace(self, name: str, tensor: QTensor) -> None:
        """Hand out tensor for name from now on (a backend's own layout of the same weights)."""
        self._tensors[name] = tensor

    def advise(self, raw: np.ndarray, advice: int | None) -> None:
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
