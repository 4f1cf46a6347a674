"""The integer-kernel backend ("cpu-q8"): llama.cpp-style int8 activations for decode, BLAS for prompts.

Small batches (decode, T <= Q8_MATVEC_MAX_T) quantize the input once to int8 blocks and run the integer
matvec of cpu_q8.py over the GGUF blocks in place; larger ones (prefill) take NumbaBackend's exact path
(dequantize each weight into one reused f32 scratch buffer, then BLAS sgemm). Float weights (F32/F16/BF16)
always take the exact path. matmul_many runs several matrices that share one input (q|k|v, gate|up) off one
quantization in one parallel call.

Against the exact f32 path the int8 activations add ~0.5 % relative error per matvec (llama.cpp does the
same); the kernels themselves equal the numpy reference of that integer math (tests/test_q8_kernels.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.kernels import cpu_q8, packed
from engine.kernels.backend import NumbaBackend, _as_input
from engine.kernels.quant_types import QTensor

# Up to this many input rows the integer matvec beats dequantize + sgemm: its cost grows with T (each row is
# decoded once per input vector, from L1) while the sgemm path pays a whole dequantization first. Measured on
# the Zen 3 dev box, 1 thread, 6 layers: SmolLM2 Q4_1 int8 13.8 vs 16.4 ms at T=16, 33.8 vs 24.7 at T=32;
# Gemma (Q5_0/Q4_K/Q6_K) 33.4 vs 29.8 ms at T=16, 45.6 vs 42.1 at T=24; at T=8 int8 is 1.9x faster.
Q8_MATVEC_MAX_T = 12


class Q8Backend(NumbaBackend):
    name = "cpu-q8"

    def __init__(self, tier: str | None = None) -> None:
        super().__init__()
        cpu_q8.tier_token(tier)  # refuses an unknown tier, or one this CPU cannot run (also from GOINFER_CPU_TIER)
        self.tier = tier or cpu_q8.TIER
        self._groups: dict[tuple[int, ...], tuple] = {}

    def _group(self, ws: Sequence[QTensor]) -> tuple[cpu_q8.Prepared | None, list[slice]]:
        """Checked once per weight group: (Prepared, column slice of each matrix), or (None, ...) when a float
        weight sends the group to the exact path. The entry keeps the QTensors alive so their ids stay unique."""
        key = tuple(map(id, ws))
        hit = self._groups.get(key)
        if hit is None:
            quantized = all(w.ggml_type not in cpu_q8.FLOAT_TYPES for w in ws)
            ends = np.cumsum([w.rows for w in ws]).tolist()
            slices = [slice(a, b) for a, b in zip([0] + ends[:-1], ends)]
            hit = self._groups[key] = (cpu_q8.prepare(ws) if quantized else None, slices, list(ws))
        return hit[0], hit[1]

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        x = _as_input(x, w)  # (T, cols)
        if w.packed is not None and x.shape[0] <= Q8_MATVEC_MAX_T:
            return packed.matvec(w, x, self.tier)
        p = self._group((w,))[0] if x.shape[0] <= Q8_MATVEC_MAX_T else None
        if p is None:
            return super().matmul(x, w)
        return cpu_q8.matvec(p, cpu_q8.quantize(x, p), tier=self.tier)

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        """[x @ W.T for W in ws] for matrices with the same cols, sharing one input (T, cols); each result
        (T, rows_i) f32. On the int8 path they are column slices of one (T, sum rows) buffer."""
        if not ws:
            return []
        x = _as_input(x, ws[0])
        if any(w.packed is not None for w in ws) and x.shape[0] <= Q8_MATVEC_MAX_T:
            return [self.matmul(x, w) for w in ws]
        p, slices = self._group(ws) if x.shape[0] <= Q8_MATVEC_MAX_T else (None, None)
        if p is None:
            if x.shape[0] > Q8_MATVEC_MAX_T:
                return super().matmul_many(x, ws)  # prompts: one wide sgemm
            return [self.matmul(x, w) for w in ws]
        out = cpu_q8.matvec(p, cpu_q8.quantize(x, p), tier=self.tier)
        return [out[:, s] for s in slices]
