"""Row-interleaved ("R8") layout of the legacy blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) for decode.

GGUF stores each row's blocks one after another, so a matvec over them reads one row at a time and ends every
32-weight block with per-row work: gathering its f16 scales from 18-24 byte strides, shuffling them next to the
products, a horizontal sum per row. On AVX2 that bookkeeping cost more than the multiplies (one thread decoded
~24 G weights/s of Q4_1 and ~16 of Q5_0 when hot). Eight rows interleaved per block make the rows the vector
lanes instead: block b of rows 8g..8g+7 is stored as

    d[8] f16 | m[8] f16 (Q4_1, Q5_1) | fifth bits (Q5_*), 32 bytes | qs, 4 x 32 bytes (Q8_0: 8 x 32)

where qs group j (j = 0..3) holds, for row r at bytes 4r..4r+3, that row's quant bytes 4j..4j+3 (low nibbles:
weights 4j..4j+3, high nibbles: weights 16+4j..16+4j+3), and fifth-bit byte 4r+i holds in bit 2j the fifth bit
of weight 4j+i and in bit 2j+1 that of weight 16+4j+i (Q8_0: group j holds weights 4j..4j+3, signed). One
32-byte load then meets one broadcast 4-byte group
of activations in vpmaddubsw, lane r of vpmaddwd's result belongs to row r, the eight scales are one 16-byte
load, and a fifth bit costs a shift and a mask. Hot, one thread: Q4_1 57 G weights/s, Q5_0 39 (2.4x both),
Q8_0 35 (1.85x).

The packed copy has exactly the bytes of the original (8 rows x block bytes per group); rows past the last full
group of 8 stay in the original layout. It is made once at load into anonymous memory, and the model then
never reads those tensors' mapped pages again (prompts dequantize from it too), so resident memory stays
the file's size. Activations for it are quantized in natural order (quantize_natural_into). The LLVM-IR kernels
over it are in packed_kernels.py; the decode matvec unpacks each block once for a batch of sequences.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import njit

from engine.kernels.cpu import plain_threads
from engine.kernels.cpu.ir import Q4_0_CODE, Q4_1_CODE, Q5_0_CODE, Q8_0_CODE, tier_token
from engine.kernels.cpu.packed_kernels import (MB, ROWS, SRC, d_q4_0, d_q4_1, d_q5_0, d_q5_1, d_q8_0, g_q4_0, g_q4_1,
                                               g_q5_0, g_q5_1, g_q8_0)
from engine.kernels.cpu.quantize import quant32
from engine.kernels.quant_types import GGMLType

PACKABLE = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0})


# =========================================================================================================
# Repacking and dequantizing (numba; once per load, and per prompt chunk)
# =========================================================================================================


@njit(cache=True)
def _src_geometry(code):
    if code == Q8_0_CODE:
        return 34, -1, -1, 2
    if code == Q4_0_CODE:
        return 18, -1, -1, 2
    if code == Q4_1_CODE:
        return 20, 2, -1, 4
    if code == Q5_0_CODE:
        return 22, -1, 2, 6
    return 24, 2, 4, 8  # Q5_1


@njit(cache=True)
def repack_into(raw, code, dst):
    """raw (rows, row bytes) GGUF blocks -> dst (rows // 8 * row bytes,) uint8 in the packed layout.
    Indices are unsigned (numba then drops its negative-index checks) and quants move 4 bytes at a time."""
    bb, mo, qh, qs = _src_geometry(code)
    u = np.uint64
    gbb = u(8 * bb)
    po_m = u(16)
    po_h = u(32 if mo >= 0 else 16)
    po_q = u(16 + (16 if mo >= 0 else 0) + (32 if qh >= 0 else 0))
    nq = 8 if code == Q8_0_CODE else 4
    nb = raw.shape[1] // bb
    dst32 = dst.view(np.uint32)  # packed blocks are multiples of 16 bytes, quants at multiples of 4
    for grp in range(raw.shape[0] // 8):
        for b in range(nb):
            o = u(grp * nb + b) * gbb
            if qh >= 0:
                for k in range(32):
                    dst[o + po_h + u(k)] = 0
            for r in range(8):
                src = raw[grp * 8 + r]
                s = u(b * bb)
                ur = u(r)
                dst[o + u(2) * ur] = src[s]
                dst[o + u(2) * ur + u(1)] = src[s + u(1)]
                if mo >= 0:
                    dst[o + po_m + u(2) * ur] = src[s + u(mo)]
                    dst[o + po_m + u(2) * ur + u(1)] = src[s + u(mo) + u(1)]
                for j in range(nq):
                    a = s + u(qs + 4 * j)
                    v = (np.uint32(src[a]) | (np.uint32(src[a + u(1)]) << np.uint32(8))
                         | (np.uint32(src[a + u(2)]) << np.uint32(16)) | (np.uint32(src[a + u(3)]) << np.uint32(24)))
                    dst32[(o + po_q + u(32 * j) + u(4) * ur) >> u(2)] = v
                if qh >= 0:
                    a = s + u(qh)
                    bits = (np.uint32(src[a]) | (np.uint32(src[a + u(1)]) << np.uint32(8))
                            | (np.uint32(src[a + u(2)]) << np.uint32(16)) | (np.uint32(src[a + u(3)]) << np.uint32(24)))
                    for i in range(4):
                        h = np.uint32(0)
                        for j in range(4):
                            h |= ((bits >> np.uint32(4 * j + i)) & np.uint32(1)) << np.uint32(2 * j)
                            h |= ((bits >> np.uint32(16 + 4 * j + i)) & np.uint32(1)) << np.uint32(2 * j + 1)
                        dst[o + po_h + u(4) * ur + u(i)] = np.uint8(h)


@njit(cache=True)
def dequantize_into(src, code, g0, g1, cols, out):
    """Row groups [g0, g1) of a packed matrix src (flat uint8) -> out (8 (g1 - g0), cols) f32 (C-contiguous),
    equal to dequantizing the original blocks bit for bit."""
    flat = out.reshape(-1)
    if code == Q8_0_CODE:
        d_q8_0(src, g0, g1, cols, flat)
    elif code == Q4_0_CODE:
        d_q4_0(src, g0, g1, cols, flat)
    elif code == Q4_1_CODE:
        d_q4_1(src, g0, g1, cols, flat)
    elif code == Q5_0_CODE:
        d_q5_0(src, g0, g1, cols, flat)
    else:
        d_q5_1(src, g0, g1, cols, flat)


@njit(cache=True)
def quantize_natural_into(x, xq, xs, c0, c1):
    """Columns [c0, c1) (multiples of 32; 0 and K for all) of x (M, K) f32 -> xq (M, K) int8 in natural order,
    xs (M, 2 * K/32) [dx, dx * sum(q)] per block: the same values as quantize.quantize_legacy_into, without its
    pair interleaving (the packed kernels read groups of 4 consecutive activations)."""
    M, K = x.shape
    nb = K // 32
    for m in range(M):
        for blk in range(c0 // 32, c1 // 32):
            o = m * K + blk * 32
            quant32(x, o, xq, o, o + 16, xs, m * 2 * nb + 2 * blk)


# =========================================================================================================
# The matvec: row groups against a batch of activation vectors
# =========================================================================================================


@njit(cache=True)
def groups_into(code, w, base, nb, g0, g1, xq, xs, out, c0, tier):
    """Row groups [g0, g1) of the packed matrix at byte base of w (nb blocks per row) against all M activation
    vectors (natural order) into out[:, c0 + 8 g ...]. One vector: all the groups in one kernel call. More: two
    groups at a time (one 512-bit pass where packed_kernels.wide_groups) against up to MB vectors per call, each
    block unpacked once for them; the two groups stay in L1 across the calls."""
    M, R = out.shape
    K, ns = xq.shape[1], xs.shape[1]
    flat = out.reshape(-1)
    gb = nb * _src_geometry(code)[0] * 8  # bytes per group of 8 rows
    step = 2 if M > 1 else max(1, g1 - g0)
    for g in range(g0, g1, step):
        wo, ng = base + g * gb, min(step, g1 - g)
        for m in range(0, M, MB):
            mb = min(MB, M - m)
            xo, so, oo = m * K, m * ns, m * R + c0 + 8 * g
            if code == Q8_0_CODE:
                g_q8_0(w, wo, nb, ng, xq, xo, K, xs, so, ns, flat, oo, R, mb, tier)
            elif code == Q4_0_CODE:
                g_q4_0(w, wo, nb, ng, xq, xo, K, xs, so, ns, flat, oo, R, mb, tier)
            elif code == Q4_1_CODE:
                g_q4_1(w, wo, nb, ng, xq, xo, K, xs, so, ns, flat, oo, R, mb, tier)
            elif code == Q5_0_CODE:
                g_q5_0(w, wo, nb, ng, xq, xo, K, xs, so, ns, flat, oo, R, mb, tier)
            else:
                g_q5_1(w, wo, nb, ng, xq, xo, K, xs, so, ns, flat, oo, R, mb, tier)


# The Python side's kernels, compiled per type: closures holding the code, the dispatch inlined (int8.py's
# _matvec_of says why); the decode step dispatches at run time.
_groups_of = njit(inline="always")(groups_into.py_func)
_dequantize_of = njit(inline="always")(dequantize_into.py_func)


@functools.cache
def _groups_chunk(code: int):
    @njit(nogil=True, cache=True)
    def groups_chunk(w, nb, n_groups, xq, xs, out, tier, n_chunks, ch):
        """Chunk ch of n_chunks of the row groups (plain_threads.split runs the chunks at once)."""
        _groups_of(code, w, 0, nb, ch * n_groups // n_chunks, (ch + 1) * n_groups // n_chunks, xq, xs, out, 0, tier)

    return groups_chunk


@functools.cache
def _dequantize_groups(code: int):
    @njit(cache=True)
    def dequantize_groups(src, g0, g1, cols, out):
        _dequantize_of(src, code, g0, g1, cols, out)

    return dequantize_groups


@functools.cache
def _gather_rows(code: int):
    @njit(cache=True)
    def gather_rows(src, ids, cols, out):
        """out[k] = row ids[k] (each in a packed group) of a packed matrix: an embedding lookup from the packed
        copy (a whole group is decoded per row: 8x the arithmetic of one row, still microseconds)."""
        scratch = np.empty((8, cols), np.float32)
        for k in range(ids.shape[0]):
            g = ids[k] // 8
            _dequantize_of(src, code, g, g + 1, cols, scratch)
            for i in range(cols):  # a loop, not a slice assignment: that one costs ~4 s more of a first run's compile
                out[k, i] = scratch[ids[k] % 8, i]

    return gather_rows


# =========================================================================================================
# Python side
# =========================================================================================================


def matvec(w, x: np.ndarray, tier: str | None = None) -> np.ndarray:
    """x (M, cols) f32 @ W.T for a QTensor with a packed copy, int8 activations as int8.matvec: the packed
    groups by this module's kernel, the rows past them by int8's. (M, rows) f32."""
    from engine.kernels.cpu import int8

    M, K = x.shape
    n = packed_rows(w.rows)
    out = np.empty((M, w.rows), np.float32)
    xq, xs = np.empty((M, K), np.int8), np.empty((M, 2 * (K // 32)), np.float32)
    quantize_natural_into(x, xq, xs, 0, K)
    chunks = max(1, min(n // ROWS, numba.get_num_threads()))  # on plain threads: see plain_threads.py
    plain_threads.split(_groups_chunk(int(w.ggml_type)), (w.packed, K // 32, n // ROWS, xq, xs, out, tier_token(tier),
                                                           chunks), chunks)
    if n < w.rows:
        p = int8.prepare([(w.raw[n:], w.ggml_type)])
        out[:, n:] = int8.matvec(p, int8.quantize(x, p), tier=tier)
    return out



def packed_rows(rows: int) -> int:
    """How many leading rows of a matrix the packed layout holds (whole groups of 8)."""
    return rows // ROWS * ROWS


def dequantize_rows(w, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
    """Rows [r0, r1) of QTensor w (r0 a multiple of 8) -> out (r1 - r0, cols) f32: the packed groups from
    w.packed, the rows past them from w.raw."""
    from engine.kernels.cpu import exact

    n = packed_rows(w.rows) if w.packed is not None else 0
    split = min(max(r0, n), r1)
    if split > r0:
        if r0 % ROWS or split % ROWS:
            raise ValueError(f"packed rows are read in whole groups of {ROWS}, not [{r0}, {split})")
        _dequantize_groups(int(w.ggml_type))(w.packed, r0 // ROWS, -(-split // ROWS), w.cols, out[: split - r0])
    if r1 > split:
        exact.dequantize_into(w.raw[split:r1], w.ggml_type, out[split - r0 :], parallel=False)
    return out


def embed_rows(w, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Rows ids of QTensor w into out (len(ids), cols) f32: from the packed copy where it holds them (so a tied
    embedding/head table's mapped pages stay out of memory), else from raw."""
    from engine.kernels.cpu import exact

    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        raise IndexError(f"row ids must be in [0, {w.rows}), got {ids.min()}..{ids.max()}")
    n = packed_rows(w.rows) if w.packed is not None else 0
    inside = ids < n
    if inside.any():
        sel = np.flatnonzero(inside)
        part = np.empty((sel.size, w.cols), np.float32)
        _gather_rows(int(w.ggml_type))(w.packed, ids[sel], w.cols, part)
        out[sel] = part
    if not inside.all():
        sel = np.flatnonzero(~inside)
        out[sel] = exact.dequantize_rows_into(w.raw, w.ggml_type, ids[sel], np.empty((sel.size, w.cols), np.float32))
    return out


def slice_rows(w, r0: int, r1: int):
    """Rows [r0, r1) of QTensor w as a QTensor, keeping its packed copy for the whole groups it covers
    (r0 must then be a multiple of 8)."""
    from engine.kernels.quant_types import QTensor

    part = None
    if w.packed is not None and r0 < packed_rows(w.rows):
        if r0 % ROWS:
            raise ValueError(f"a packed matrix is sliced at multiples of {ROWS} rows, not {r0}")
        rb = w.raw.shape[1]
        part = w.packed[r0 * rb : (r0 + packed_rows(r1 - r0)) * rb]
    return QTensor(w.name, w.ggml_type, (r1 - r0, w.cols), w.raw[r0:r1], part)


def repack(raw: np.ndarray, ggml_type: GGMLType, dst: np.ndarray) -> None:
    """Pack the whole groups of raw (rows, row bytes) into dst (packed_rows(rows) * row bytes,) uint8."""
    code = int(ggml_type)
    if code not in SRC:
        raise ValueError(f"{GGMLType(code).name} has no packed layout")
    if dst.size != packed_rows(raw.shape[0]) * raw.shape[1]:
        raise ValueError(f"dst holds {dst.size} bytes, the packed rows need {packed_rows(raw.shape[0]) * raw.shape[1]}")
    repack_into(raw, code, dst)
