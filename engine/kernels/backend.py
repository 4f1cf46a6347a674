"""The backend interface the model code calls: matmul, embed, dequantize over QTensors kept as stored blocks.

ReferenceBackend is the numpy oracle (reference.py); NumbaBackend runs the numba kernels (cpu.py):
small batches (decode) use the fused matvec that reads blocks in place, larger ones (prefill) dequantize the
weight into a reused scratch buffer and call BLAS. No f32 copy of a whole model is ever kept.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from engine.kernels import cpu, packed, reference
from engine.kernels.quant_types import GGMLType, QTensor

MATVEC_MAX_T = 8  # up to this many input rows the fused matvec beats dequantize + sgemm
SCRATCH_MAX_FLOATS = 1 << 24  # 64 MB: bigger weights (vocab heads) are dequantized in row chunks


@runtime_checkable
class Backend(Protocol):
    name: str

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        """x (T, cols) f32 -> x @ W.T, (T, rows) f32."""

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        """[x @ W.T for W in ws]: matrices with the same cols that read one input (q|k|v, gate|up)."""

    def embed(self, w: QTensor, ids) -> np.ndarray:
        """Rows ids of w as f32 (len(ids), cols): an embedding lookup."""

    def dequantize(self, w: QTensor) -> np.ndarray:
        """The whole of w as a new f32 (rows, cols) array."""


def _f32_view(w: QTensor) -> np.ndarray:
    return w.raw.view(np.float32).reshape(w.rows, w.cols)  # (rows, cols), no copy


def _as_input(x: np.ndarray, w: QTensor) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise ValueError(f"{w.name}: input {x.shape} does not match weight (rows, cols) = {w.shape}")
    return x


class ReferenceBackend:
    name = "reference"

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        return reference.matmul(_as_input(x, w), w)

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        return [self.matmul(x, w) for w in ws]

    def embed(self, w: QTensor, ids) -> np.ndarray:
        return reference.embed_rows(w, ids)

    def dequantize(self, w: QTensor) -> np.ndarray:
        return reference.dequantize(w)


class NumbaBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._scratch = np.empty(0, dtype=np.float32)  # grows to the largest (chunk of a) weight used

    def release(self) -> None:
        """Free the dequantization scratch (up to the largest weight group, 10 MB for Gemma's gate|up) until the
        next prompt: a model that sits decoding or idle should not keep it resident."""
        self._scratch = np.empty(0, dtype=np.float32)

    def _scratch_for(self, rows: int, cols: int) -> np.ndarray:
        if self._scratch.size < rows * cols:
            self._scratch = np.empty(rows * cols, dtype=np.float32)
        return self._scratch[: rows * cols].reshape(rows, cols)

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        x = _as_input(x, w)  # (T, cols)
        T = x.shape[0]
        if w.ggml_type == GGMLType.F32:
            return x @ _f32_view(w).T
        out = np.empty((T, w.rows), dtype=np.float32)
        if T <= MATVEC_MAX_T and w.packed is None:
            return cpu.matvec(w.raw, w.ggml_type, x, out)
        step = max(packed.ROWS, SCRATCH_MAX_FLOATS // w.cols // packed.ROWS * packed.ROWS)
        for r0 in range(0, w.rows, step):
            r1 = min(w.rows, r0 + step)
            # Serial dequantize: a parallel one leaves OpenMP workers spinning against the BLAS threads.
            wf = _dequantize_rows(w, r0, r1, self._scratch_for(r1 - r0, w.cols))
            if r0 == 0 and r1 == w.rows:
                np.matmul(x, wf.T, out=out)
            else:
                out[:, r0:r1] = x @ wf.T
        return out

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        """Prompts: the matrices dequantized one under another into the scratch buffer and one sgemm for all
        (one wide GEMM runs closer to BLAS peak than two or three narrow ones); column slices of its result."""
        x = _as_input(x, ws[0])
        rows = sum(w.rows for w in ws)
        if (len(ws) == 1 or x.shape[0] <= MATVEC_MAX_T or rows * x.shape[1] > SCRATCH_MAX_FLOATS
                or any(w.ggml_type == GGMLType.F32 or w.cols != x.shape[1] for w in ws)):
            return [self.matmul(x, w) for w in ws]
        wf = self._scratch_for(rows, x.shape[1])
        r0, slices = 0, []
        for w in ws:
            _dequantize_rows(w, 0, w.rows, wf[r0 : r0 + w.rows])
            slices.append(slice(r0, r0 + w.rows))
            r0 += w.rows
        out = x @ wf.T  # (T, rows)
        return [out[:, s] for s in slices]

    def embed(self, w: QTensor, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.size, w.cols), dtype=np.float32)
        if w.packed is not None:
            return packed.embed_rows(w, ids, out)
        return cpu.dequantize_rows_into(w.raw, w.ggml_type, ids, out)

    def dequantize(self, w: QTensor) -> np.ndarray:
        return _dequantize_rows(w, 0, w.rows, np.empty(w.shape, dtype=np.float32))


def _dequantize_rows(w: QTensor, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
    """Rows [r0, r1) of w into out, serially (see matmul), from its packed copy where it has one."""
    if w.packed is None:
        return cpu.dequantize_into(w.raw[r0:r1], w.ggml_type, out, parallel=False)
    return packed.dequantize_rows(w, r0, r1, out)


def _q8_backend() -> Backend:
    from engine.kernels.backend_q8 import Q8Backend  # late import: backend_q8 builds on this module

    return Q8Backend()


_BACKENDS = {"cpu": NumbaBackend, "numba": NumbaBackend, "reference": ReferenceBackend, "cpu-q8": _q8_backend}


def get_backend(name: str = "cpu") -> Backend:
    """"cpu" (numba kernels; alias "numba"), "cpu-q8" (int8 decode kernels) or "reference" (numpy oracle).
    A new instance per call."""
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(_BACKENDS)}") from None
