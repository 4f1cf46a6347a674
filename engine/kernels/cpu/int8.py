"""Integer CPU matvec (llama.cpp-style): activations quantized to int8 once per input vector (quantize.py),
weights read in their GGUF blocks in place, integer dot products per block (legacy.py, kquant.py; the low-bit
types in kquant_low.py, iquant.py, ternary.py, lattice.py), f32 scale algebra per block. This module holds the
drivers over rows and matrices, the f32 dot products of float weights (F32/F16/BF16 take the f32 activations as
they are) and the Python API; ir.py holds the IR toolkit and the tiers.

Rows are spread over plain threads in ranges (plain_threads.py: a parallel region here fought the BLAS threads
of the prompt pass around it); each row is read from memory once per call and reused
from L1 for every one of the M activation vectors (compute grows with M; K-quant rows decode each super-block
once for four vectors at a time, kquant.py; legacy rows still decode a block per vector). Each row loop prefetches
PREFETCH_BYTES ahead.
On Zen 3 with AVX2 a token's matvecs read their weights at most of DRAM's read rate and run in less than half
the time of the exact f32 path (docs/benchmarks.md, "Measurements behind the code", int8 matvec).

Public API (Python; each is one compiled call after argument checks):
  prepare(ws) -> PreparedWeights           check matrices that share one input once (q|k|v, gate|up)
  quantize(x, types or PreparedWeights) -> QInput  activations for every block family the matrices need
  matvec(ws or PreparedWeights, qin, out=None) -> (M, sum rows)  x @ W_i.T for all of them, one parallel call
  integer_dots(w, qin) -> int32            the per-block integer dot products (tests)
  dequantized_input(qin, type) -> f32     the activations as the kernels see them (oracles)
  (and from ir.py: available_tiers(), TIER, tier_token(tier); from quantize.py: legacy_x_order(K))
njit-callable (for the compiled decode step, decode_step.py): rows_into (one matrix's row range, dispatched on
its type code; the tier token its last argument; not the low-bit types, which only the per-combination closures
below dispatch: rows_of_code, that dispatch inlined for a constant code, through which step_variants.rows_with
adds a model's low-bit types to rows_into for its step) and matvec_into (a tuple of weight arrays, one range of
rows);
with quantize.py's quantize_legacy_into and quantize_k_into.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numba
import numpy as np
from numba import njit

# (importing exact also sets numba's threading-layer preference: omp before tbb and workqueue)
from engine.kernels.cpu import kquant_low, plain_threads
from engine.kernels.cpu.dequant import half_bits_to_f32, u32_bits_to_f32
from engine.kernels.cpu.dequant_lattice import (IQ1_M_CODE, IQ1_S_CODE, IQ2_S_CODE, IQ2_XS_CODE, IQ2_XXS_CODE,
                                                IQ3_S_CODE, IQ3_XXS_CODE)
from engine.kernels.cpu import iquant, lattice, ternary
from engine.kernels.cpu.ir import (BF16_CODE, F16_CODE, IQ4_NL_CODE, IQ4_XS_CODE, MXFP4_CODE, Q2_K_CODE, Q3_K_CODE,
                                   Q4_0_CODE, Q4_1_CODE, Q4_K_CODE, Q5_0_CODE, Q5_1_CODE, Q5_K_CODE, Q6_K_CODE,
                                   Q8_0_CODE, TQ1_0_CODE, TQ2_0_CODE, tier_token)
from engine.kernels.cpu.kquant import idots_q4_k, idots_q5_k, idots_q6_k, rows_q4_k, rows_q5_k, rows_q6_k
from engine.kernels.cpu.kquant_low import rows_q2_k, rows_q3_k
from engine.kernels.cpu.legacy import (idots_mxfp4, idots_q4_0, idots_q4_1, idots_q5_0, idots_q5_1, idots_q8_0,
                                       rows_mxfp4, rows_q4_0, rows_q4_1, rows_q5_0, rows_q5_1, rows_q8_0)
from engine.kernels.cpu.quantize import KB_SUMS, QK, QK_K, legacy_x_order, quantize_k_into, quantize_legacy_into
from engine.kernels.quant_types import COMPUTE_TYPES, LATTICE_TYPES, GGMLType, QTensor, row_bytes, type_name

# The 32-weight block types, which read the legacy (Q8_0-style) activation blocks; MXFP4 has their shape.
LEGACY_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.MXFP4})
K_TYPES = frozenset({GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
# The low-bit types with kernels here (kquant_low.py, iquant.py, ternary.py), by the activations they read. Not in
# LEGACY_TYPES or K_TYPES: the decode step (step_matvec.needs, rows_into's run-time dispatch) and the packed layout
# read those.
LOWBIT_LEGACY = frozenset({GGMLType.IQ4_NL})
LOWBIT_K = frozenset({GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_XS, GGMLType.TQ1_0, GGMLType.TQ2_0}) | LATTICE_TYPES
_READS_LEGACY, _READS_K = LEGACY_TYPES | LOWBIT_LEGACY, K_TYPES | LOWBIT_K

# =========================================================================================================
# Row drivers: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================

# --- float weights: plain f32 dot products (fastmath so the reduction vectorizes) ---


@njit(cache=True, fastmath=True)
def _rows_f32(raw, base, rb, r0, r1, x, out, c0):
    K = x.shape[1]
    flat = raw.reshape(-1)
    for r in range(r0, r1):
        w = flat[base + r * rb : base + (r + 1) * rb].view(np.float32)
        for m in range(out.shape[0]):
            acc = np.float32(0.0)
            for c in range(K):
                acc += w[c] * x[m, c]
            out[m, c0 + r] = acc


@njit(cache=True, fastmath=True)
def _rows_f16(raw, base, rb, r0, r1, x, out, c0):
    K = x.shape[1]
    flat = raw.reshape(-1)
    for r in range(r0, r1):
        h = flat[base + r * rb : base + (r + 1) * rb].view(np.uint16)
        for m in range(out.shape[0]):
            acc = np.float32(0.0)
            for c in range(K):
                acc += half_bits_to_f32(h[c]) * x[m, c]
            out[m, c0 + r] = acc


@njit(cache=True, fastmath=True)
def _rows_bf16(raw, base, rb, r0, r1, x, out, c0):
    K = x.shape[1]
    flat = raw.reshape(-1)
    for r in range(r0, r1):
        h = flat[base + r * rb : base + (r + 1) * rb].view(np.uint16)
        for m in range(out.shape[0]):
            acc = np.float32(0.0)
            for c in range(K):  # bf16 = the high half of an f32
                acc += u32_bits_to_f32(np.uint32(h[c]) << np.uint32(16)) * x[m, c]
            out[m, c0 + r] = acc


@njit(cache=True)
def rows_into(code, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier):
    """Rows [r0, r1) of one matrix whose row r starts at byte base + r * rb of raw (a matrix, base 0, or a
    whole-file buffer), into out[:, c0 + r]; dispatched on its type code (once per chunk: negligible)."""
    if code == Q4_0_CODE:
        rows_q4_0(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == Q4_1_CODE:
        rows_q4_1(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == Q5_0_CODE:
        rows_q5_0(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == Q5_1_CODE:
        rows_q5_1(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == Q8_0_CODE:
        rows_q8_0(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == MXFP4_CODE:
        rows_mxfp4(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == Q4_K_CODE:
        rows_q4_k(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == Q5_K_CODE:
        rows_q5_k(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == Q6_K_CODE:
        rows_q6_k(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == F16_CODE:
        _rows_f16(raw, base, rb, r0, r1, x, out, c0)
    elif code == BF16_CODE:
        _rows_bf16(raw, base, rb, r0, r1, x, out, c0)
    else:  # F32_CODE; the Python wrappers reject every other code
        _rows_f32(raw, base, rb, r0, r1, x, out, c0)


@njit(nogil=True, cache=True)
def matvec_into(raws, codes, starts, xq8, xs8, xqk, xdk, xbk, x, out, tier, n_chunks, ch):
    """out[:, starts[i]:starts[i+1]] = x @ W_i.T for the matrices raws[i] (a tuple of (rows_i, row_bytes_i)
    uint8 arrays with type codes[i]), all sharing one input: its legacy (xq8, xs8) and K (xqk, xdk, xbk)
    quantizations and its f32 values x (M, K). Arrays a matrix's types do not need may be empty.
    The rows of all matrices are split into n_chunks equal ranges; this call runs range ch (matvec runs them at
    once on plain threads: plain_threads.py says why not a parallel region)."""
    total = starts[len(raws)]
    lo, hi = ch * total // n_chunks, (ch + 1) * total // n_chunks
    for i in range(len(raws)):
        a, z = max(lo, starts[i]), min(hi, starts[i + 1])
        if a < z:
            # Flat, as the decode step's file buffer, and offsets typed int64 (a literal 0 would be a type
            # of its own): both share one compiled specialization of every row kernel (each one more costs
            # seconds of the first run's compile: docs/benchmarks.md, "Measurements behind the code", int8 row
            # kernel specializations).
            rows_into(codes[i], raws[i].reshape(-1), np.int64(0), raws[i].shape[1], a - starts[i], z - starts[i],
                      xq8, xs8, xqk, xdk, xbk, x, out, np.int64(starts[i]), tier)


# The Python API's matvec over 1-3 matrices, compiled per combination of their types: rows_into's dispatch inlined
# with the codes as constants (closure cells: numba prunes the other branches before typing, and its cache keys a
# closure by the values it holds), so a first run compiles the row kernels of its model's types only, a fraction
# of the time every type at once takes (docs/benchmarks.md, "Measurements behind the code", int8 per-combination
# compile). The decode step keeps the dispatch at run time. The low-bit types (quant_types.LOWBIT_TYPES) are
# reached from here only, in _rows_any's branches before rows_into's (pruned too where the code is another).
_rows_base = njit(inline="always")(rows_into.py_func)


def _rows_any(code, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier):
    if code == Q2_K_CODE:
        rows_q2_k(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == Q3_K_CODE:
        rows_q3_k(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == IQ4_NL_CODE:
        iquant.rows_iq4_nl(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == IQ4_XS_CODE:
        iquant.rows_iq4_xs(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == TQ1_0_CODE:
        ternary.rows_tq1_0(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == TQ2_0_CODE:
        ternary.rows_tq2_0(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == IQ2_XXS_CODE:
        lattice.rows_iq2_xxs(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == IQ2_XS_CODE:
        lattice.rows_iq2_xs(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == IQ2_S_CODE:
        lattice.rows_iq2_s(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == IQ3_XXS_CODE:
        lattice.rows_iq3_xxs(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == IQ3_S_CODE:
        lattice.rows_iq3_s(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == IQ1_S_CODE:
        lattice.rows_iq1_s(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == IQ1_M_CODE:
        lattice.rows_iq1_m(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    else:
        _rows_base(code, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier)


rows_of_code = njit(inline="always")(_rows_any)
_NO_CODE = -1  # an unused slot


@functools.cache
def _matvec_of(codes: tuple[int, ...]):
    """The compiled matvec over matrices of these types (1-3): (w0, w1, w2, <QInput fields>, out, tier, n_chunks, ch)
    runs range ch of n_chunks of all their rows (unused slots: 0-row matrices)."""
    c0, c1, c2 = (tuple(codes) + (_NO_CODE, _NO_CODE))[:3]

    @njit(nogil=True, cache=True)
    def matvec_of(w0, w1, w2, xq8, xs8, xqk, xdk, xbk, x, out, tier, n_chunks, ch):
        s1 = w0.shape[0]
        s2 = s1 + w1.shape[0]
        lo, hi = ch * (s2 + w2.shape[0]) // n_chunks, (ch + 1) * (s2 + w2.shape[0]) // n_chunks
        a, z = max(lo, 0), min(hi, s1)
        if a < z:
            rows_of_code(c0, w0.reshape(-1), np.int64(0), w0.shape[1], a, z, xq8, xs8, xqk, xdk, xbk, x, out,
                         np.int64(0), tier)
        if c1 != _NO_CODE:
            a, z = max(lo, s1), min(hi, s2)
            if a < z:
                rows_of_code(c1, w1.reshape(-1), np.int64(0), w1.shape[1], a - s1, z - s1, xq8, xs8, xqk, xdk, xbk,
                             x, out, np.int64(s1), tier)
        if c2 != _NO_CODE:
            a, z = max(lo, s2), hi
            if a < z:
                rows_of_code(c2, w2.reshape(-1), np.int64(0), w2.shape[1], a - s2, z - s2, xq8, xs8, xqk, xdk, xbk,
                             x, out, np.int64(s2), tier)

    return matvec_of


@njit(cache=True)
def _integer_dots(code, raw, xq8, xqk, xbk, out, tier):
    # out (M, rows, n) int32: n = K/32 block dots (legacy) or 2 per super-block (K types)
    rb = raw.shape[1]
    for r in range(raw.shape[0]):
        for m in range(out.shape[0]):
            oo = (m * out.shape[1] + r) * out.shape[2]
            if code == Q4_0_CODE:
                idots_q4_0(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == Q4_1_CODE:
                idots_q4_1(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == Q5_0_CODE:
                idots_q5_0(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == Q5_1_CODE:
                idots_q5_1(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == Q8_0_CODE:
                idots_q8_0(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == MXFP4_CODE:
                idots_mxfp4(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            else:
                nsb = xqk.shape[1] // 256
                bo = m * nsb * 24
                if code == Q4_K_CODE:
                    idots_q4_k(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, bo, out, oo, tier)
                elif code == Q5_K_CODE:
                    idots_q5_k(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, bo, out, oo, tier)
                else:
                    idots_q6_k(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, bo, out, oo, tier)


# =========================================================================================================
# Public API
# =========================================================================================================

_LEGACY_CODES = frozenset(int(t) for t in _READS_LEGACY)
_K_CODES = frozenset(int(t) for t in _READS_K)
_CODES = frozenset(int(t) for t in COMPUTE_TYPES)
_LOWBIT_CODES = frozenset(int(t) for t in LOWBIT_LEGACY | LOWBIT_K)  # only _matvec_of's closures run these
_NONE_I8, _NONE_F32, _NONE_I16 = np.empty((0, 0), np.int8), np.empty((0, 0), np.float32), np.empty((0, 0, 0), np.int16)
_NO_WEIGHT = np.empty((0, 1), np.uint8)
_NO_WEIGHT.flags.writeable = False


def _readonly(raw: np.ndarray) -> np.ndarray:
    """Weights go to the kernels as read-only views (mmapped GGUF data is): one compiled specialization."""
    if raw.flags.writeable:
        raw = raw.view()
        raw.flags.writeable = False
    return raw


class QInput(NamedTuple):
    """One input (M, K) in every form the matrices reading it need; unused forms are empty arrays."""

    x: np.ndarray  # (M, K) f32
    xq8: np.ndarray  # (M, K) int8, pair-interleaved (legacy blocks)
    xs8: np.ndarray  # (M, 2 * K/32) f32 [dx, dx * sum(q)] per block
    xqk: np.ndarray  # (M, K) int8 (K super-blocks)
    xdk: np.ndarray  # (M, K/256) f32
    xbk: np.ndarray  # (M, K/256, 24) int16

    @property
    def shape(self) -> tuple[int, int]:
        return self.x.shape


class PreparedWeights(NamedTuple):
    """Matrices sharing one input, checked once (prepare()); reuse it on every call to skip the checks."""

    raws: tuple  # (rows_i, row_bytes_i) uint8 C arrays
    codes: tuple  # GGML type ids
    cols: int
    rows: int  # total
    legacy: bool  # some matrix needs the legacy activation blocks
    kquant: bool  # some matrix needs the K super-block activations


def prepare(ws: Sequence) -> PreparedWeights:
    """Check matrices (QTensors or (raw, type) pairs) that read the same input: same cols, supported types."""
    raws, codes, cols = [], [], None
    for w in ws:
        raw, code, name = (w.raw, int(w.ggml_type), w.name) if isinstance(w, QTensor) else (w[0], int(w[1]), "weight")
        if code not in _CODES:
            raise NotImplementedError(f"{name}: no CPU kernel for {type_name(code)}")
        t = GGMLType(code)
        block = QK_K if t in _READS_K else QK if t in _READS_LEGACY else 1
        n = raw.shape[1] * block // row_bytes(t, block) if raw.ndim == 2 else -1
        if cols is None:
            cols = n
        if (raw.dtype != np.uint8 or raw.ndim != 2 or n != cols or row_bytes(t, n) != raw.shape[1]
                or not raw.flags.c_contiguous):
            raise ValueError(f"{name}: raw {raw.dtype}{raw.shape} is not C-contiguous rows of {cols} {t.name} weights")
        raws.append(_readonly(raw))
        codes.append(code)
    if not raws:
        raise ValueError("no matrices given")
    return PreparedWeights(tuple(raws), tuple(codes), cols, sum(r.shape[0] for r in raws),
                    any(c in _LEGACY_CODES for c in codes), any(c in _K_CODES for c in codes))


def quantize(x: np.ndarray, ggml_types: Sequence[GGMLType | int] | PreparedWeights = tuple(LEGACY_TYPES)) -> QInput:
    """Quantize x (M, K) (or (K,)) once for matrices of the given types (or a PreparedWeights group); default: the
    legacy block types."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"x must be (M, K) float32, got shape {x.shape}")
    M, K = x.shape
    if isinstance(ggml_types, PreparedWeights):
        legacy, kquant = ggml_types.legacy, ggml_types.kquant
    else:
        codes = {int(t) for t in ggml_types}
        legacy, kquant = not codes.isdisjoint(_LEGACY_CODES), not codes.isdisjoint(_K_CODES)
    xq8, xs8, xqk, xdk, xbk = _NONE_I8, _NONE_F32, _NONE_I8, _NONE_F32, _NONE_I16
    if legacy:
        if K % QK:
            raise ValueError(f"K = {K} is not a multiple of {QK}")
        xq8, xs8 = np.empty((M, K), np.int8), np.empty((M, 2 * (K // QK)), np.float32)
        quantize_legacy_into(x, xq8, xs8, 0, K)
    if kquant:
        if K % QK_K:
            raise ValueError(f"K = {K} is not a multiple of {QK_K}")
        xqk, xdk = np.empty((M, K), np.int8), np.empty((M, K // QK_K), np.float32)
        xbk = np.empty((M, K // QK_K, KB_SUMS), np.int16)
        quantize_k_into(x, xqk, xdk, xbk, 0, K)
    return QInput(x, xq8, xs8, xqk, xdk, xbk)


def _check_input(p: PreparedWeights, qin: QInput) -> None:
    M, K = qin.x.shape
    if K != p.cols:
        raise ValueError(f"input has {K} columns, the weights {p.cols}")
    if (p.legacy and qin.xq8.shape != (M, K)) or (p.kquant and qin.xqk.shape != (M, K)):
        kinds = [GGMLType(c).name for c in p.codes]
        raise ValueError(f"the input was not quantized for {', '.join(kinds)} (quantize(x, types) must list them)")


def matvec(ws: Sequence | PreparedWeights, qin: QInput, out: np.ndarray | None = None, tier: str | None = None,
           n_chunks: int | None = None) -> np.ndarray:
    """x @ W_i.T for every matrix in ws (QTensors, (raw, type) pairs or a PreparedWeights group), concatenated:
    (M, sum of rows) f32. All matrices read the same quantized input and run in one parallel call."""
    p = ws if isinstance(ws, PreparedWeights) else prepare(ws)
    _check_input(p, qin)
    M = qin.x.shape[0]
    if out is None:
        out = np.empty((M, p.rows), np.float32)
    elif out.dtype != np.float32 or out.shape != (M, p.rows) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {(M, p.rows)}, got {out.dtype}{out.shape}")
    if p.rows == 0 or M == 0:
        return out
    if n_chunks is None:  # one range of rows per thread
        n_chunks = max(1, min(p.rows, numba.get_num_threads()))
    tok = tier_token(tier)
    if len(p.raws) <= 3:  # the matrices as plain array arguments: numba unboxes arrays on its fast C path, while
        # a tuple of arrays is typed in Python (several us per call)
        w = p.raws + (_NO_WEIGHT,) * (3 - len(p.raws))
        args = (w[0], w[1], w[2], qin.xq8, qin.xs8, qin.xqk, qin.xdk, qin.xbk, qin.x, out, tok, n_chunks)
        plain_threads.split(_matvec_of(p.codes), args, n_chunks)
    elif _LOWBIT_CODES.isdisjoint(p.codes):
        starts = np.cumsum((0,) + tuple(r.shape[0] for r in p.raws)).astype(np.int64)
        args = (p.raws, np.array(p.codes, np.int64), starts, qin.xq8, qin.xs8, qin.xqk, qin.xdk, qin.xbk, qin.x, out,
                tok, n_chunks)
        plain_threads.split(matvec_into, args, n_chunks)
    else:  # matvec_into's run-time dispatch has no low-bit kernels: groups of three matrices
        col = 0
        for i in range(0, len(p.raws), 3):
            group = prepare(list(zip(p.raws[i:i + 3], p.codes[i:i + 3])))
            out[:, col:col + group.rows] = matvec(group, qin, tier=tier, n_chunks=n_chunks)
            col += group.rows
    return out


def dequantized_input(qin: QInput, ggml_type: GGMLType | int) -> np.ndarray:
    """The activations the kernels compute with for weights of ggml_type, as f32 (M, K): the int8 values times
    their block scales (x itself for float weights). Oracles (tests, the self-test) multiply these in float64."""
    M, K = qin.shape
    t = GGMLType(int(ggml_type))
    if t in _READS_LEGACY:
        q = np.empty_like(qin.xq8)
        q[:, legacy_x_order(K)] = qin.xq8
        return (q.reshape(M, -1, QK) * qin.xs8.reshape(M, -1, 2)[..., :1]).reshape(M, K)
    if t in _READS_K:
        return (qin.xqk.reshape(M, -1, QK_K) * qin.xdk[..., None]).reshape(M, K)
    return qin.x


def integer_dots(w, qin: QInput, tier: str | None = None) -> np.ndarray:
    """The kernels' integer dot products of every row against every input vector (tests, debugging):
    legacy types (M, rows, K/32) = sum(u * x) per block, u the stored unsigned quant (signed q for Q8_0;
    for MXFP4 u = the E2M1 code's doubled value + 12, see legacy.py; IQ4_NL: the signed level);
    K types (M, rows, K/256, 2) = [sum_s scale_s * sum(u * x), sum_s min_s * bsum_s] (Q6_K: offset included,
    second entry 0; IQ4_XS: [sum_s ls_s sum(v x), 0]; TQ1_0, TQ2_0: [sum(u x), bsum], ternary.py; the lattice
    types: [sum_g ls_g sum(q x)_g, 0], lattice.py)."""
    p = prepare([w])
    _check_input(p, qin)
    raw, code = p.raws[0], p.codes[0]
    M, K = qin.shape
    t = GGMLType(code)
    if t in FLOAT_TYPES:
        raise ValueError(f"{t.name} weights have no integer dot product")
    n = K // QK if t in _READS_LEGACY else 2 * (K // QK_K)
    out = np.zeros((M, raw.shape[0], n), np.int32)
    if t in (GGMLType.Q2_K, GGMLType.Q3_K):  # each kept out of _integer_dots' run-time dispatch, as out of rows_into's
        kquant_low.integer_dots_into(code, raw, qin.xqk, qin.xbk, out, tier_token(tier))
    elif t in LATTICE_TYPES:
        lattice.integer_dots(code, raw, qin.xqk, qin.xbk, out, tier_token(tier))
    elif t in LOWBIT_LEGACY or t == GGMLType.IQ4_XS:
        iquant.integer_dots(code, raw, qin.xq8, qin.xqk, qin.xbk, out, tier_token(tier))
    elif t in LOWBIT_K:
        ternary.integer_dots(code, raw, qin.xqk, qin.xbk, out, tier_token(tier))
    else:
        _integer_dots(code, raw, qin.xq8, qin.xqk, qin.xbk, out, tier_token(tier))
    return out.reshape(M, raw.shape[0], K // QK) if t in _READS_LEGACY else out.reshape(M, raw.shape[0], -1, 2)
