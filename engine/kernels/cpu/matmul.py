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
from engine.kernels.backend import PROMPT_TILE
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


def tiled_gemm(x: np.ndarray, wt: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (T, cols) @ wt (cols, rows) with each PROMPT_TILE rows of x computed as in a call of their own (see
    PROMPT_TILE); out (T, rows) may be a column slice of a wider array. The whole tiles go in one call where
    this BLAS was seen to give every row the numbers a one-tile call gives (_one_call_is_tiles); else a call
    each (OpenBLAS's SkylakeX sgemm passes, and SmolLM2's prompts ran faster than with a call per 128-row tile:
    docs/benchmarks.md, "Measurements behind the code", tiled_gemm; its Haswell kernel does not pass)."""
    T = x.shape[0]
    if out is None:
        out = np.empty((T, wt.shape[1]), np.float32)
    whole = T // PROMPT_TILE * PROMPT_TILE
    start = 0
    if whole > PROMPT_TILE and _one_call_is_tiles(wt, whole // PROMPT_TILE):
        np.matmul(x[:whole], wt, out=out[:whole])
        start = whole
    for t0 in range(start, T, PROMPT_TILE):
        np.matmul(x[t0 : t0 + PROMPT_TILE], wt, out=out[t0 : t0 + PROMPT_TILE])
    return out


_ONE_CALL_IS_TILES: dict[tuple, bool] = {}


def _one_call_is_tiles(wt: np.ndarray, tiles: int) -> bool:
    """Whether an sgemm call over `tiles` whole tiles gives each row exactly what a call over its tile alone gives,
    for this weight shape and layout: tried once per process on random data of that shape (a GEMM's rounding
    depends on the shapes and its kernel's blocking, never on the values)."""
    key = (wt.shape, wt.strides[0] < wt.strides[1], tiles)
    known = _ONE_CALL_IS_TILES.get(key)
    if known is None:
        rng = np.random.default_rng(tiles)
        probe = rng.standard_normal(wt.shape[::-1]).astype(np.float32)  # (rows, cols)
        probe = probe.T if key[1] else np.ascontiguousarray(probe.T)  # wt's own layout
        x = rng.standard_normal((tiles * PROMPT_TILE, wt.shape[0])).astype(np.float32)
        each = np.concatenate([x[t0 : t0 + PROMPT_TILE] @ probe for t0 in range(0, len(x), PROMPT_TILE)])
        known = _ONE_CALL_IS_TILES[key] = bool(np.array_equal(x @ probe, each))
    return known


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
        self._holds: tuple = ()  # which rows of which matrices the scratch holds dequantized now

    def release(self) -> None:
        """Free the dequantization scratch (up to the largest weight group, 10 MB for Gemma's gate|up) until the
        next prompt: a model that sits decoding or idle should not keep it resident."""
        self._scratch = np.empty(0, dtype=np.float32)
        self._holds = ()

    def _scratch_for(self, rows: int, cols: int) -> np.ndarray:
        if self._scratch.size < rows * cols:
            self._scratch = np.empty(rows * cols, dtype=np.float32)
            self._holds = ()
        return self._scratch[: rows * cols].reshape(rows, cols)

    def _dequantized(self, ws: Sequence[QTensor], r0: int = 0, r1: int | None = None) -> np.ndarray:
        """The matrices ws one under another (or rows [r0, r1) of a single one) dequantized in the scratch
        buffer; kept there for the next call on the same rows (a chunk's whole tiles and its last partial tile
        are two calls: CpuBackend.matmul). Keyed by the weights' addresses, which stay put while the model is
        loaded."""
        spans = [(r0, ws[0].rows if r1 is None else r1)] if len(ws) == 1 else [(0, w.rows) for w in ws]
        key = tuple((_address(w.raw), _address(w.packed), w.shape, span) for w, span in zip(ws, spans))
        wf = self._scratch_for(sum(b - a for a, b in spans), ws[0].cols)
        if key != self._holds:
            self._holds = ()
            at = 0
            for w, (a, b) in zip(ws, spans):
                # Serial dequantize: a parallel one leaves OpenMP workers spinning against the BLAS threads.
                _dequantize_rows(w, a, b, wf[at : at + b - a])
                at += b - a
            self._holds = key
        return wf

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        x = as_input(x, w)  # (T, cols)
        T = x.shape[0]
        if w.ggml_type == GGMLType.F32:
            return tiled_gemm(x, _f32_view(w).T)
        out = np.empty((T, w.rows), dtype=np.float32)
        if T <= MATVEC_MAX_T and w.packed is None:
            return exact.matvec(w.raw, w.ggml_type, x, out)
        step = max(packed.ROWS, SCRATCH_MAX_FLOATS // w.cols // packed.ROWS * packed.ROWS)
        for r0 in range(0, w.rows, step):
            r1 = min(w.rows, r0 + step)
            tiled_gemm(x, self._dequantized([w], r0, r1).T, out[:, r0:r1])
        return out

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        """Prompts: the matrices dequantized one under another into the scratch buffer and one sgemm for all
        (one wide GEMM runs closer to BLAS peak than two or three narrow ones); column slices of its result."""
        x = as_input(x, ws[0])
        rows = sum(w.rows for w in ws)
        if (len(ws) == 1 or x.shape[0] <= MATVEC_MAX_T or rows * x.shape[1] > SCRATCH_MAX_FLOATS
                or any(w.ggml_type == GGMLType.F32 or w.cols != x.shape[1] for w in ws)):
            return [self.matmul(x, w) for w in ws]
        ends = np.cumsum([w.rows for w in ws]).tolist()
        slices = [slice(a, b) for a, b in zip([0] + ends[:-1], ends)]
        out = tiled_gemm(x, self._dequantized(ws).T)  # (T, rows)
        return [out[:, s] for s in slices]

    def embed(self, w: QTensor, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.size, w.cols), dtype=np.float32)
        if w.packed is not None:
            return packed.embed_rows(w, ids, out)
        return exact.dequantize_rows_into(w.raw, w.ggml_type, ids, out)

    def dequantize(self, w: QTensor) -> np.ndarray:
        return _dequantize_rows(w, 0, w.rows, np.empty(w.shape, dtype=np.float32))


def _address(a: np.ndarray | None) -> int:
    return 0 if a is None else a.__array_interface__["data"][0]


def _dequantize_rows(w: QTensor, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
    """Rows [r0, r1) of w into out, serially (see matmul), from its packed copy where it has one."""
    if w.packed is None:
        return exact.dequantize_into(w.raw[r0:r1], w.ggml_type, out, parallel=False)
    return packed.dequantize_rows(w, r0, r1, out)


# Up to this many input rows (a prompt's partial tile: whole tiles take the GEMM or sgemm; over K-quants the GEMM
# takes over sooner where the CPU has it, GEMM8_MIN_T*) the integer matvec beats dequantize + sgemm: its cost grows with T (each row is decoded once per input vector, from L1) while the
# sgemm path pays a whole dequantization first, and its sgemm of a few rows runs far from BLAS peak. Whole models
# on the AVX2 VM (SmolLM2, Gemma 3 270M, a Qwen2.5-1.5B shape), a prompt's time to its first token: the matvec was
# faster up to a whole tile but for a tie on Gemma 3 at T=48. (It was 12, from single-threaded timings of 6 layers
# on another box, where sgemm won from T=32.) Figures: docs/benchmarks.md, "Measurements behind the code",
# Q8_MATVEC_MAX_T.
Q8_MATVEC_MAX_T = PROMPT_TILE - 1
# Over K-quants with the int8 GEMM available (gemm8.py), the matvec (the same integer math) still beats the GEMM's
# fixed cost up to this many rows. With AVX512-VNNI, 2 threads: on a Qwen3-30B-A3B expert's gate+up the matvec
# won at T=32 and T=48; on a larger 4096 x 2048 Q4_K it about tied at T=32 and lost at T=48 (docs/benchmarks.md,
# "Measurements behind the code", GEMM8_MIN_T). A MoE prompt routes a few tokens to each expert: most of its
# expert products fall under it.
GEMM8_MIN_T = 32
# The 256-bit (AVX2) form of the GEMM has a larger fixed cost (its unpack) for less speed: the matvec keeps up to
# this many rows. Whole models on the AVX2 VM (Zen 3, no VNNI; noisy), a Qwen2.5-1.5B shape, a prompt's time to
# its first token: the matvec won at T=16 and the GEMM from about T=24 on, far ahead of dequantize + sgemm, the way
# before; one matrix alone, the GEMM beat the matvec at every size and sgemm (looked ahead under a whole tile) was
# ahead of both at T=48-64 and behind the GEMM at T=128 and 512. It was 23 until the K-quant rows met the
# vectors four at a time (kquant.py, a faster matvec); then, on a slower sitting, the matvec won to T=40 and the
# GEMM from T=48 (a second run: the matvec still ahead at T=48). Figures: docs/benchmarks.md, "Measurements behind
# the code", GEMM8_MIN_T_256.
GEMM8_MIN_T_256 = 40


class Int8Kernels(ExactKernels):
    name = "cpu-q8"

    def __init__(self, tier: str | None = None) -> None:
        super().__init__()
        ir.tier_token(tier)  # refuses an unknown tier, or one this CPU cannot run (also from GOINFER_CPU_TIER)
        self.tier = tier or ir.TIER
        self._groups: dict[tuple[int, ...], tuple] = {}
        # Prompts over K-quant matrices: the int8 GEMM (gemm8.py) where the tier has one (AVX2 and up), else
        # sgemm; a backend turns it off for a model where it would carry little of the work (use_prompt_gemm8).
        self._gemm8 = gemm8.available(self.tier)
        self._gemm8_types: frozenset = frozenset()  # the types it runs for the model (use_prompt_gemm8)
        self._gemm8_form = gemm8.variant(self.tier)  # "512", "256" or None
        self.gemm8_min_t = GEMM8_MIN_T if self._gemm8_form == "512" else GEMM8_MIN_T_256  # more rows: the GEMM

    def _group(self, ws: Sequence[QTensor]) -> tuple[int8.PreparedWeights | None, list[slice]]:
        """Checked once per weight group: (Prepared, column slice of each matrix), or (None, ...) when a float
        weight sends the group to the exact path. Keyed by where the weights' bytes are (which stays put while
        the model is loaded), not by the QTensor objects: a head's row slices are made anew on some calls, and an
        id() key grew the memo by one entry per such call."""
        key = tuple((_address(w.raw), _address(w.packed), w.shape, int(w.ggml_type)) for w in ws)
        hit = self._groups.get(key)
        if hit is None:
            quantized = all(w.ggml_type not in int8.FLOAT_TYPES for w in ws)
            ends = np.cumsum([w.rows for w in ws]).tolist()
            slices = [slice(a, b) for a, b in zip([0] + ends[:-1], ends)]
            hit = self._groups[key] = (int8.prepare(ws) if quantized else None, slices)
        return hit

    def use_prompt_gemm8(self, matrices: Sequence[QTensor]) -> None:
        """Run prompts on the int8 GEMM (where the CPU can) for a model whose layers' `matrices` it carries most
        of (gemm8.carries_most), else on dequantize + sgemm."""
        self._gemm8 = gemm8.available(self.tier) and gemm8.carries_most(list(matrices), self.tier)
        self._gemm8_types = frozenset(w.ggml_type for w in matrices if gemm8.usable(w, self.tier))

    def warm_prompt_gemm(self) -> None:
        """Compile the int8 GEMM of this model's types now where its prompts will take it
        (engine/loading/precompile.py)."""
        if self._gemm8:
            gemm8.warm(sorted(self._gemm8_types), self.tier)

    def _prompt_gemm8(self, x: np.ndarray, ws: Sequence[QTensor]) -> bool:
        return self._gemm8 and x.shape[0] > self.gemm8_min_t and all(gemm8.usable(w, self.tier) for w in ws)

    def _matvec_max_t(self, ws: Sequence[QTensor]) -> int:
        """The most input rows the integer matvec takes for these matrices (more: the GEMM or sgemm)."""
        if self._gemm8 and self._gemm8_form == "512" and all(gemm8.usable(w, self.tier) for w in ws):
            return GEMM8_MIN_T  # the 512-bit form's fixed cost: the matvec up to it
        return Q8_MATVEC_MAX_T

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        x = as_input(x, w)  # (T, cols)
        if self._prompt_gemm8(x, (w,)):
            return gemm8.matmul(gemm8.QuantizedInput(x), w, self.tier)
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
            return [gemm8.matmul(qin, w, self.tier) for w in ws]
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
