"""The exact path's matrix kernels on GGUF blocks read in place: f32 math throughout.

The matvec decodes one weight row at a time (dequant.py; the low-bit types dequant_lowbit.py) into an L1-resident
f32 buffer and dots it with every input row, so each block is decoded once per call whatever T is; activations stay
f32 and sums accumulate in f32. The fast path's int8 kernels (int8.py) are tested against this path's results.

Public entry points (Python functions: argument checks, then one compiled call):
  dequantize_into(raw, ggml_type, out)           raw (rows, row_bytes) uint8 -> out (rows, cols) f32
  dequantize_rows_into(raw, ggml_type, ids, out) only rows ids -> out (len(ids), cols) f32 (embeddings)
  matvec(raw, ggml_type, x, out)                 x (T, cols) f32 -> out (T, rows) f32 = x @ W.T, small T

The decoded weights equal the reference's bit for bit (dequant.py); only the dot product uses fastmath (an f32
reduction vectorizes only with it), so matvec results differ from the reference by summation order alone.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import njit, prange

from engine.kernels.cpu.dequant_lowbit import dequant_any_row
from engine.kernels.quant_types import COMPUTE_TYPES, LATTICE_TYPES, GGMLType, row_bytes, type_name

# =========================================================================================================
# Drivers (parallel over rows)
# =========================================================================================================


# Each driver is compiled per weight type (a closure holding its code, dequant_any_row's dispatch inlined, and in it
# dequant_row's: numba prunes the other types' branches before typing and caches each variant apart), so a model's
# load compiles the decoders of its own types only (int8.py's _matvec_of says more).
_row_of = njit(inline="always")(dequant_any_row)


@functools.cache
def _dequantize_rows(code: int):
    @njit(parallel=True, cache=True)
    def dequantize_rows(raw, out):
        for r in prange(raw.shape[0]):
            _row_of(raw[r], code, out[r])

    return dequantize_rows


@functools.cache
def _dequantize_rows_serial(code: int):
    @njit(cache=True)
    def dequantize_rows_serial(raw, out):
        for r in range(raw.shape[0]):
            _row_of(raw[r], code, out[r])

    return dequantize_rows_serial


@functools.cache
def _gather_rows(code: int):
    @njit(cache=True)
    def gather_rows(raw, ids, out):
        # Serial: a handful of rows per call, not worth a parallel launch.
        for i in range(ids.shape[0]):
            _row_of(raw[ids[i]], code, out[i])

    return gather_rows


@functools.cache
def _matvec(code: int):
    @njit(parallel=True, fastmath=True, cache=True)
    def matvec(raw, x, out, n_chunks):
        # raw (rows, row_bytes) u8, x (T, cols) f32, out (T, rows) f32.
        # Rows are split into n_chunks contiguous chunks (static schedule); each chunk owns an L1-sized f32
        # buffer that holds one dequantized row at a time, reused for all T inputs.
        rows, T, cols = raw.shape[0], x.shape[0], x.shape[1]
        bufs = np.empty((n_chunks, cols), dtype=np.float32)
        for ch in prange(n_chunks):
            buf = bufs[ch]
            for r in range(ch * rows // n_chunks, (ch + 1) * rows // n_chunks):
                _row_of(raw[r], code, buf)
                for t in range(T):
                    xt = x[t]
                    acc = np.float32(0.0)
                    for c in range(cols):
                        acc += buf[c] * xt[c]
                    out[t, r] = acc

    return matvec


# =========================================================================================================
# Public API
# =========================================================================================================


# The low-bit types too: their decoders compile only in their own closures (dequant_lowbit.py); and the lattice
# types, which only this path decodes so far (the loader refuses them until their integer kernels exist).
_CODES = frozenset(int(t) for t in COMPUTE_TYPES | LATTICE_TYPES)


def _check(raw: np.ndarray, ggml_type, n_cols: int) -> int:
    code = int(ggml_type)
    if code not in _CODES:
        raise NotImplementedError(f"no CPU kernel for {type_name(code)}")
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != row_bytes(GGMLType(code), n_cols):
        raise ValueError(f"raw {raw.dtype}{raw.shape} does not hold rows of {n_cols} {type_name(code)} weights")
    if not raw.flags.c_contiguous:
        raise ValueError("raw must be C-contiguous (a view of the stored tensor)")
    return code


def _check_out(out: np.ndarray, shape: tuple[int, int]) -> None:
    if out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {shape}, got {out.dtype}{out.shape}")


def dequantize_into(raw: np.ndarray, ggml_type: GGMLType | int, out: np.ndarray, parallel: bool = True) -> np.ndarray:
    """Decode all rows of raw (rows, row_bytes) uint8 into out (rows, cols) f32; returns out.

    parallel=False runs on the calling thread: use it right before a BLAS call, because OpenMP workers keep
    spinning for a while after a parallel region and starve OpenBLAS's threads (sgemm then ran several times
    slower: docs/benchmarks.md, "Measurements behind the code", serial dequantize).
    """
    code = _check(raw, ggml_type, out.shape[-1])
    _check_out(out, (raw.shape[0], out.shape[-1]))
    (_dequantize_rows if parallel else _dequantize_rows_serial)(code)(raw, out)
    return out


def dequantize_rows_into(raw: np.ndarray, ggml_type: GGMLType | int, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Decode rows ids (e.g. token ids of an embedding lookup) into out (len(ids), cols) f32; returns out."""
    code = _check(raw, ggml_type, out.shape[-1])
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    _check_out(out, (ids.shape[0], out.shape[-1]))
    if ids.size and (ids.min() < 0 or ids.max() >= raw.shape[0]):
        raise IndexError(f"row ids must be in [0, {raw.shape[0]}), got {ids.min()}..{ids.max()}")
    _gather_rows(code)(raw, ids, out)
    return out


def matvec(raw: np.ndarray, ggml_type: GGMLType | int, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out (T, rows) = x (T, cols) @ W.T, reading W's blocks in place; for small T (decode). Returns out."""
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError(f"x must be C-contiguous float32 (T, cols), got {x.dtype}{x.shape}")
    code = _check(raw, ggml_type, x.shape[1])
    _check_out(out, (x.shape[0], raw.shape[0]))
    # A few chunks per thread; numba.get_num_threads() is read here because inside njit it blocks caching.
    _matvec(code)(raw, x, out, max(1, min(raw.shape[0], 4 * numba.get_num_threads())))
    return out
