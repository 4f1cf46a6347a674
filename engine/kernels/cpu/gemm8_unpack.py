"""The weight side of the int8 prompt GEMM (gemm8.py): a group of R rows unpacked into the layout its tile kernel
reads. Per weight type, each row's quants as unsigned bytes u in column order and, per sub-block j, w = a_j u - b_j:
a_j and b_j as f32 (ws), a_j's integer part for the 256-bit form's int16 products (wi, twice as two i16) and the
super-block's d (wd). The block layouts are reference.py's; the types and their (a, b) are in each unpacker's line.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels.cpu.dequant import f16_at, k_scale_min
from engine.kernels.cpu.ir import (IQ4_XS_CODE, Q2_K_CODE, Q3_K_CODE, Q5_K_CODE, Q6_K_CODE, TQ1_0_CODE,
                                   TQ2_0_CODE)
from engine.kernels.cpu.quantize import QK_K
from engine.kernels.reference import IQ4_NL_VALUES


def unpack(raw, code, r0, rows, nsb, u, tile, ws, wi, wd):
    """Rows [r0, r0 + R) of raw (zeros past `rows`; R = ws.shape[2], the tile's rows) -> tile (their quants u,
    layout above), ws (sub-blocks, 2, R) f32 (each sub-block's scale and min term), wi (sub-blocks, R) i32 (its
    integer scale as two i16) and wd (nsb, R) f32 (each super-block's d); u: scratch (K,) uint8.
    Plain Python: inlined into each type's GEMM (gemm8._gemm_of) with its code a constant, the other types pruned."""
    t32 = tile.view(np.uint32)
    u32 = u.view(np.uint32)
    R = ws.shape[2]
    for r in range(R):
        if r0 + r >= rows:
            u[:] = 0
            ws[:, :, r] = 0.0
            wi[:, r] = 0
            wd[:, r] = 0.0
        elif code == Q6_K_CODE:
            _unpack_q6_k(raw[r0 + r], nsb, u, ws, wi, wd, r)
        elif code == Q2_K_CODE:
            _unpack_q2_k(raw[r0 + r], nsb, u, ws, wi, wd, r)
        elif code == Q3_K_CODE:
            _unpack_q3_k(raw[r0 + r], nsb, u, ws, wi, wd, r)
        elif code == IQ4_XS_CODE:
            _unpack_iq4_xs(raw[r0 + r], nsb, u, ws, wi, wd, r)
        elif code == TQ1_0_CODE:
            _unpack_tq1_0(raw[r0 + r], nsb, u, ws, wi, wd, r)
        elif code == TQ2_0_CODE:
            _unpack_tq2_0(raw[r0 + r], nsb, u, ws, wi, wd, r)
        else:
            _unpack_q45_k(raw[r0 + r], code, nsb, u, ws, wi, wd, r)
        for i in range(nsb * QK_K // 4):  # 4 columns at a time into their group
            t32[i * R + r] = u32[i]


@njit(cache=True)
def _unpack_q45_k(src, code, nsb, u, ws, wi, wd, r):
    """Q4_K/Q5_K: w = d sc_j u - dmin m_j per sub-block j of 32 (u: 4 bits, Q5_K's fifth from qh)."""
    bb = 176 if code == Q5_K_CODE else 144  # bytes per super-block
    qs = 48 if code == Q5_K_CODE else 16  # where the 4-bit quants start
    for sb in range(nsb):
        o = sb * bb
        d, dmin = f16_at(src, o), f16_at(src, o + 2)
        wd[sb, r] = d
        for j in range(8):  # sub-block j: nibble j % 2 of the 32 bytes at qs + 32 (j // 2)
            sc, m = k_scale_min(src, o + 4, j)
            wi[sb * 8 + j, r] = sc | (sc << 16)
            ws[sb * 8 + j, 0, r] = d * np.float32(sc)
            ws[sb * 8 + j, 1, r] = dmin * np.float32(m)
            q0, sh, y = o + qs + 32 * (j // 2), 4 * (j % 2), sb * QK_K + 32 * j
            for c in range(32):
                v = (src[q0 + c] >> sh) & 15
                if code == Q5_K_CODE:  # the fifth bit of weight c is bit j of qh[c]
                    v |= ((src[o + 16 + c] >> j) & 1) << 4
                u[y + c] = v


@njit(cache=True)
def _unpack_q6_k(src, nsb, u, ws, wi, wd, r):
    """Q6_K: w = d sc_g (u - 32) per sub-block g of 16 (u: 6 bits; reference.py gives the weight order), so the
    scale is d sc_g and the min term 32 d sc_g."""
    for sb in range(nsb):
        o = sb * 210  # ql[128] | qh[64] | i8 scales[16] | f16 d
        d = f16_at(src, o + 208)
        wd[sb, r] = d
        for g in range(16):
            isc = (np.int32(src[o + 192 + g]) ^ 128) - 128
            wi[sb * 16 + g, r] = np.int32((isc & 0xFFFF) | (isc << 16))  # the i8 scale in both i16 halves
            sc = d * np.float32(isc)
            ws[sb * 16 + g, 0, r] = sc
            ws[sb * 16 + g, 1, r] = np.float32(32.0) * sc
        for h in range(2):  # weight 128 h + 32 qt + c; the runs of 32 in loops of their own, which vectorize
            for qt in range(4):
                lo, lo_shift, hi, hi_shift = o + 64 * h + 32 * (qt % 2), 4 * (qt // 2), o + 128 + 32 * h, 2 * qt
                y = sb * QK_K + 128 * h + 32 * qt
                for c in range(32):
                    u[y + c] = ((src[lo + c] >> lo_shift) & 15) | (((src[hi + c] >> hi_shift) & 3) << 4)


@njit(cache=True, inline="always")
def _scales(ws, wi, j, r, a, b, isc):
    """Sub-block j of row r: w = a u - b (f32), a's integer part isc (twice, as two i16) for the 256-bit form."""
    ws[j, 0, r] = a
    ws[j, 1, r] = b
    wi[j, r] = np.int32((isc & 0xFFFF) | (isc << 16))


@njit(cache=True, inline="always")
def _crumbs_into(src, q0, u, y):
    """A half super-block's 2-bit fields (Q2_K, Q3_K, TQ2_0: reference._crumbs' order): field j of byte l of the
    32 at q0 is weight 32 j + l."""
    for j in range(4):
        for c in range(32):
            u[y + 32 * j + c] = (src[q0 + c] >> np.uint8(2 * j)) & np.uint8(3)  # (u8 math: vectorizes)


@njit(cache=True)
def _unpack_q2_k(src, nsb, u, ws, wi, wd, r):
    """Q2_K: w = d sc_g u - dmin m_g per sub-block g of 16 (u: 2 bits)."""
    for sb in range(nsb):
        o = sb * 84  # scales[16] | qs[64] | f16 d | f16 dmin
        d, dmin = f16_at(src, o + 80), f16_at(src, o + 82)
        wd[sb, r] = d
        for g in range(16):
            sc, m = np.int32(src[o + g] & 15), np.int32(src[o + g] >> 4)
            _scales(ws, wi, sb * 16 + g, r, d * np.float32(sc), dmin * np.float32(m), sc)
        for h in range(2):
            _crumbs_into(src, o + 16 + 32 * h, u, sb * QK_K + 128 * h)


@njit(cache=True)
def _unpack_q3_k(src, nsb, u, ws, wi, wd, r):
    """Q3_K: w = d s_g (u - 4) per sub-block g of 16, u = low 2 bits | hmask bit << 2 (0..7), s_g signed."""
    for sb in range(nsb):
        o = sb * 110  # hmask[32] | qs[64] | scales[12] | f16 d
        d = f16_at(src, o + 108)
        wd[sb, r] = d
        for g in range(16):
            lo = (np.int32(src[o + 96 + g]) & 15) if g < 8 else (np.int32(src[o + 88 + g]) >> 4)
            hi = (np.int32(src[o + 104 + g % 4]) >> (2 * (g // 4))) & 3
            sc = (lo | (hi << 4)) - 32
            a = d * np.float32(sc)
            _scales(ws, wi, sb * 16 + g, r, a, np.float32(4.0) * a, sc)
        for k in range(8):  # weight 32 k + c: field k % 4 of qs[32 (k // 4) + c], third bit: bit k of hmask[c]
            q0, y = o + 32 + 32 * (k // 4), sb * QK_K + 32 * k
            for c in range(32):
                u[y + c] = ((src[q0 + c] >> np.uint8(2 * (k % 4))) & np.uint8(3)) | \
                    (((src[o + c] >> np.uint8(k)) & np.uint8(1)) << np.uint8(2))


_IQ4_U = (IQ4_NL_VALUES.astype(np.int16) + 128).astype(np.uint8)  # the codebook's levels as unsigned quants


@njit(cache=True, inline="always")
def _nibble_levels(src, q0, u, y):
    """16 bytes of IQ4 nibbles (Q4_0's order: byte c's low nibble is weight c, its high one c + 16) -> 32 u."""
    for c in range(16):
        u[y + c] = _IQ4_U[src[q0 + c] & np.uint8(15)]
        u[y + 16 + c] = _IQ4_U[src[q0 + c] >> np.uint8(4)]


@njit(cache=True)
def _unpack_iq4_xs(src, nsb, u, ws, wi, wd, r):
    """IQ4_XS: w = d ls_s (u - 128) per sub-block s of 32, u = a codebook level + 128 (512-bit form only)."""
    for sb in range(nsb):
        o = sb * 136  # f16 d | u16 scales_h | scales_l[4] | qs[128]
        d = f16_at(src, o)
        wd[sb, r] = d
        high = np.int32(src[o + 2]) | (np.int32(src[o + 3]) << 8)
        for s in range(8):
            ls = (((np.int32(src[o + 4 + s // 2]) >> (4 * (s % 2))) & 15) | (((high >> (2 * s)) & 3) << 4)) - 32
            a = d * np.float32(ls)
            _scales(ws, wi, sb * 8 + s, r, a, np.float32(128.0) * a, ls)
            _nibble_levels(src, o + 8 + 16 * s, u, sb * QK_K + 32 * s)


@njit(cache=True)
def _unpack_tq2_0(src, nsb, u, ws, wi, wd, r):
    """TQ2_0: w = d (u - 1), u: 2 bits; sub-blocks of 32 share d."""
    for sb in range(nsb):
        o = sb * 66  # qs[64] | f16 d
        d = f16_at(src, o + 64)
        _ternary_scales(ws, wi, wd, sb, r, d)
        for h in range(2):
            _crumbs_into(src, o + 32 * h, u, sb * QK_K + 128 * h)


@njit(cache=True)
def _unpack_tq1_0(src, nsb, u, ws, wi, wd, r):
    """TQ1_0: w = d (u - 1), u a base-3 digit (reference._trits: digit t of byte l is weight n t + l for the n
    bytes of a run)."""
    for sb in range(nsb):
        o = sb * 54  # qs[48] | qh[4] | f16 d
        _ternary_scales(ws, wi, wd, sb, r, f16_at(src, o + 52))
        y = sb * QK_K
        for q0, n, k, y0 in ((0, 32, 5, 0), (32, 16, 5, 160), (48, 4, 4, 240)):
            p = 1
            for t in range(k):
                for c in range(n):
                    u[y + y0 + n * t + c] = (((np.int32(src[o + q0 + c]) * p) & 255) * 3) >> 8
                p *= 3


@njit(cache=True, inline="always")
def _ternary_scales(ws, wi, wd, sb, r, d):
    wd[sb, r] = d
    for j in range(8):
        _scales(ws, wi, sb * 8 + j, r, d, d, 1)
