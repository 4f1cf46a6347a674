"""Matrix kernel sets of the CPU backend: matmul, embed, dequantize over QTensors kept as stored blocks.

Three sets, one interface (MatmulKernels), chosen by name (kernels_for):
- "reference" (ReferenceKernels): the numpy oracle (kernels/reference.py); the self-test's fallback tier.
- "cpu" (ExactKernels): the exact path's numba kernels (exact.py): small batches (decode) use the fused matvec
  that reads blocks in place, larger ones (prefill) dequantize the weight into a reused scratch buffer and call
  BLAS. No f32 copy of a whole model is ever kept.
- "cpu-q8" (Int8Kernels): the fast path's: llama.cpp-style int8 activations for small batches (decode,
  T <= Q8_MATVEC_MAX_T): the input quantized once to int8 blocks and the integer matvec of int8.py run over
  the GGUF blocks in place (or packed.py's copies); larger ones (prefill) take ExactKernels' path. Float
  weights (F32/F16/BF16) always take the exact path. matmul_many runs several matrices that share one input
  (q|k|v, gate|up) off one quantization in one parallel call. Against the exact f32 path the int8 activations
  add ~0.5 % relative error per matvec (llama.cpp does the same); the kernels themselves equal the numpy
  reference of that integer math (tests/test_q8_kernels.py).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from engine.kernels import reference
from engine.kernels.cpu import exact, gemm8, int8, ir, packed
from engine.kernels.quant_types import GGMLType, QTensor

MATVEC_MAX_T = 8  # up to this many input rows the fused matvec beats dequantize + sgemm
SCRATCH_MAX_FLOATS = 1 << 24  # 64 MB: bigger weights (vocab heads) are dequantized in row chunks


@runtime_checkable
class MatmulKernels(Protocol):
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


def as_input(x: np.ndarray, w: QTensor) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise ValueError(f"{w.name}: input {x.shape} does not match weight (rows, cols) = {w.shape}")
    return x


class ReferenceKernels:
    name = "reference"

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        return reference.matmul(as_input(x, w), w)

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        return [self.matmul(x, w) for w in ws]

    def embed(self, w: QTensor, ids) -> np.ndarray:
        return reference.embed_rows(w, ids)

    def dequantize(self, w: QTensor) -> np.ndarray:
        return reference.dequantize(w)


class ExactKernels:
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
        x = as_input(x, w)  # (T, cols)
        T = x.shape[0]
        if w.ggml_type == GGMLType.F32:
            return x @ _f32_view(w).T
        out = np.empty((T, w.rows), dtype=np.float32)
        if T <= MATVEC_MAX_T and w.packed is None:
            return exact.matvec(w.raw, w.ggml_type, x, out)
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
        x = as_input(x, ws[0])
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
        return exact.dequantize_rows_into(w.raw, w.ggml_type, ids, out)

    def dequantize(self, w: QTensor) -> np.ndarray:
        return _dequantize_rows(w, 0, w.rows, np.empty(w.shape, dtype=np.float32))


def _dequantize_rows(w: QTensor, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
    """Rows [r0, r1) of w into out, serially (see matmul), from its packed copy where it has one."""
    if w.packed is None:
        return exact.dequantize_into(w.raw[r0:r1], w.ggml_type, out, parallel=False)
    return packed.dequantize_rows(w, r0, r1, out)


# Up to this many input rows the integer matvec beats dequantize + sgemm: its cost grows with T (each row is
# decoded once per input vector, from L1) while the sgemm path pays a whole dequantization first. Measured on
# the Zen 3 dev box, 1 thread, 6 layers: SmolLM2 Q4_1 int8 13.8 vs 16.4 ms at T=16, 33.8 vs 24.7 at T=32;
# Gemma (Q5_0/Q4_K/Q6_K) 33.4 vs 29.8 ms at T=16, 45.6 vs 42.1 at T=24; at T=8 int8 is 1.9x faster.
Q8_MATVEC_MAX_T = 12
# Over K-quants with the int8 GEMM available (gemm8.py), the matvec (the same integer math) still beats the GEMM's
# fixed cost up to this many rows. Same box (AVX512-VNNI), 2 threads: a Qwen3-30B-A3B expert's gate+up (2 x 768 x
# 2048, Q4_K) 1.10 vs 1.38 ms at T=32, 1.55 vs 1.99 at T=48; a 4096 x 2048 Q4_K 2.81 vs 2.74 ms at T=32, 4.05 vs
# 3.29 at T=48. A MoE prompt routes a few tokens to each expert: most of its expert products fall under it.
GEMM8_MIN_T = 32


class Int8Kernels(ExactKernels):
    name = "cpu-q8"

    def __init__(self, tier: str | None = None) -> None:
        super().__init__()
        ir.tier_token(tier)  # refuses an unknown tier, or one this CPU cannot run (also from GOINFER_CPU_TIER)
        self.tier = tier or ir.TIER
        self._groups: dict[tuple[int, ...], tuple] = {}
        # Prompts over K-quant matrices: the int8 GEMM (gemm8.py) where the CPU has 512-bit VNNI, else sgemm;
        # a backend turns it off for a model where it would carry little of the work (use_prompt_gemm8).
        self._gemm8 = self.tier == "vnni" and gemm8.available()

    def _group(self, ws: Sequence[QTensor]) -> tuple[int8.PreparedWeights | None, list[slice]]:
        """Checked once per weight group: (Prepared, column slice of each matrix), or (None, ...) when a float
        weight sends the group to the exact path. The entry keeps the QTensors alive so their ids stay unique."""
        key = tuple(map(id, ws))
        hit = self._groups.get(key)
        if hit is None:
            quantized = all(w.ggml_type not in int8.FLOAT_TYPES for w in ws)
            ends = np.cumsum([w.rows for w in ws]).tolist()
            slices = [slice(a, b) for a, b in zip([0] + ends[:-1], ends)]
            hit = self._groups[key] = (int8.prepare(ws) if quantized else None, slices, list(ws))
        return hit[0], hit[1]

    def use_prompt_gemm8(self, on: bool) -> None:
        """Run prompts over K-quant matrices on the int8 GEMM (where the CPU can), or on dequantize + sgemm."""
        self._gemm8 = on and self.tier == "vnni" and gemm8.available()

    def _prompt_gemm8(self, x: np.ndarray, ws: Sequence[QTensor]) -> bool:
        return self._gemm8 and x.shape[0] > GEMM8_MIN_T and all(gemm8.usable(w) for w in ws)

    def _matvec_max_t(self, ws: Sequence[QTensor]) -> int:
        """The most input rows the integer matvec takes for these matrices (more: the GEMM or sgemm)."""
        return GEMM8_MIN_T if self._gemm8 and all(gemm8.usable(w) for w in ws) else Q8_MATVEC_MAX_T

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        x = as_input(x, w)  # (T, cols)
        if self._prompt_gemm8(x, (w,)):
            return gemm8.matmul(gemm8.QuantizedInput(x), w)
        if w.packed is not None and x.shape[0] <= Q8_MATVEC_MAX_T:
            return packed.matvec(w, x, self.tier)
        p = self._group((w,))[0] if x.shape[0] <= self._matvec_max_t((w,)) else None
        if p is None:
            return super().matmul(x, w)
        return int8.matvec(p, int8.quantize(x, p), tier=self.tier)

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        """[x @ W.T for W in ws] for matrices with the same cols, sharing one input (T, cols); each result
        (T, rows_i) f32. On the int8 path they are column slices of one (T, sum rows) buffer."""
        if not ws:
            return []
        x = as_input(x, ws[0])
        if self._prompt_gemm8(x, ws):
            qin = gemm8.QuantizedInput(x)  # quantized once for all of them
            return [gemm8.matmul(qin, w) for w in ws]
        if any(w.packed is not None for w in ws) and x.shape[0] <= Q8_MATVEC_MAX_T:
            return [self.matmul(x, w) for w in ws]
        p, slices = self._group(ws) if x.shape[0] <= self._matvec_max_t(ws) else (None, None)
        if p is None:
            if x.shape[0] > Q8_MATVEC_MAX_T:
                return super().matmul_many(x, ws)  # prompts: one wide sgemm
            return [self.matmul(x, w) for w in ws]
        out = int8.matvec(p, int8.quantize(x, p), tier=self.tier)
        return [out[:, s] for s in slices]


_KERNELS = {"cpu": ExactKernels, "numba": ExactKernels, "reference": ReferenceKernels, "cpu-q8": Int8Kernels}


def kernels_for(name: str = "cpu") -> MatmulKernels:
    """"cpu" (the exact path's numba kernels; alias "numba"), "cpu-q8" (the fast path's int8 kernels) or
    "reference" (numpy oracle). A new instance per call."""
    try:
        return _KERNELS[name]()
    except KeyError:
        raise ValueError(f"unknown backend kernels {name!r}; choose from {sorted(_KERNELS)}") from None
