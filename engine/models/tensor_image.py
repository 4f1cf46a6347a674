"""Tensors laid out in one page-aligned anonymous buffer, as a GGUF's lie in its file mapping: what a model built in
memory at load hands the loader (a converted checkpoint, models/hf_checkpoint.py; a model with adapters merged,
models/lora.py). One buffer is what the compiled decode step addresses weights in."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from engine.errors import ModelLoadError
from engine.kernels.quant_types import QTensor

_ALIGN = 64


def aligned_buffer(sizes: list[int]) -> tuple[np.ndarray, list[int]]:
    """A zeroed anonymous uint8 buffer holding len(sizes) regions of those byte sizes, each starting on a 64-byte
    boundary, and the regions' offsets."""
    ends = np.cumsum([-(-s // _ALIGN) * _ALIGN for s in sizes]).tolist()
    offsets = [0] + ends[:-1]
    return np.frombuffer(mmap.mmap(-1, max(int(ends[-1]) if ends else 0, 1)), np.uint8), offsets


class TensorImage:
    """The tensor-source side (models/weights.TensorSource) of tensors in one buffer: `has`, `tensor`, `vector`,
    `names`, `data`. Subclasses set path, _buffer and _tensors, then call `_freeze`."""

    path: Path
    _buffer: np.ndarray
    _tensors: dict[str, QTensor]

    def _freeze(self) -> None:
        # Read-only from here on, as a mapped GGUF file is: the kernels and the compiled step are compiled per
        # argument type, and a writable buffer is another type (another minute or two of the step's compile).
        for a in [self._buffer] + [t.raw for t in self._tensors.values()]:
            a.flags.writeable = False
        self.file_size = sum(t.raw.nbytes for t in self._tensors.values())

    @property
    def data(self) -> np.ndarray:
        """The one buffer every tensor views (the compiled decode step addresses weights inside it)."""
        return self._buffer

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> QTensor:
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path.name}: missing tensor {name!r}")
        return t

    def vector(self, name: str) -> np.ndarray:
        from engine.kernels.reference import dequantize

        return dequantize(self.tensor(name)).reshape(-1).astype(np.float32, copy=False)
