"""Exact row decoders of the lattice types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): one row of
blocks to f32, bit for bit as reference_lattice.py decodes it (ggml's float operations in ggml's order: the group
scale first, then scale x grid point, then the sign; IQ1: scale x (point + delta)).

Plain compiled loops, for the exact path and the prompt GEMM's unpacking (gemm8_lattice.py); the default path's
integer kernels are lattice.py's. Like dequant_lowbit.py's decoders they sit outside dequant_row's runtime dispatch,
so only a model holding one compiles it (dequant_lowbit.dequant_any_row's branches, pruned per type for a constant
code). The grids are the reference's arrays, frozen into the compiled code as constants. Block layouts:
reference_lattice.py.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels.cpu.dequant import f16_at, half_bits_to_f32
from engine.kernels.quant_types import GGMLType
from engine.kernels.reference_lattice import IQ1_DELTA, grid, ksigns

IQ2_XXS_CODE, IQ2_XS_CODE, IQ2_S_CODE = int(GGMLType.IQ2_XXS), int(GGMLType.IQ2_XS), int(GGMLType.IQ2_S)
IQ3_XXS_CODE, IQ3_S_CODE = int(GGMLType.IQ3_XXS), int(GGMLType.IQ3_S)
IQ1_S_CODE, IQ1_M_CODE = int(GGMLType.IQ1_S), int(GGMLType.IQ1_M)
LATTICE_CODES = frozenset({IQ2_XXS_CODE, IQ2_XS_CODE, IQ2_S_CODE, IQ3_XXS_CODE, IQ3_S_CODE, IQ1_S_CODE, IQ1_M_CODE})

_KSIGNS = ksigns().copy()
_G2XXS, _G2XS, _G2S = grid("IQ2_XXS"), grid("IQ2_XS"), grid("IQ2_S")
_G3XXS, _G3S, _G1S, _G1M = grid("IQ3_XXS"), grid("IQ3_S"), grid("IQ1_S"), grid("IQ1_M")
_HALF, _QUARTER, _DELTA = np.float32(0.5), np.float32(0.25), IQ1_DELTA


@njit(inline="always")
def _u16(src, o):
    return np.uint32(src[o]) | (np.uint32(src[o + 1]) << np.uint32(8))


@njit(inline="always")
def _u32(src, o):
    return _u16(src, o) | (_u16(src, o + 2) << np.uint32(16))


@njit(inline="always")
def _point(dst, y, scale, points, index, signs, first, n):
    """dst[y:y+n] = scale * points[index, first:first+n], negated where bit first+j of signs is set."""
    for j in range(n):
        v = scale * points[index, first + j]
        dst[y + j] = -v if (signs >> (first + j)) & 1 else v


@njit(cache=True)
def _row_iq2_xxs(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 66, b * 256  # f16 d | per group: 4 grid-index bytes, a u32 of 4 sign indices + the scale
        d = f16_at(src, o)
        for g in range(8):
            q = o + 2 + 8 * g
            s = _u32(src, q + 4)
            db = d * (_HALF + np.float32(s >> np.uint32(28))) * _QUARTER
            for sub in range(4):
                signs = _KSIGNS[(s >> np.uint32(7 * sub)) & np.uint32(127)]
                _point(dst, y + 32 * g + 8 * sub, db, _G2XXS, src[q + sub], signs, 0, 8)


@njit(cache=True)
def _row_iq2_xs(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 74, b * 256  # f16 d | u16 qs[32] (9-bit index, 7-bit sign index) | u8 scales[8]
        d = f16_at(src, o)
        for g in range(8):
            sc = src[o + 66 + g]
            for sub in range(4):
                db = d * (_HALF + np.float32((sc >> (4 * (sub // 2))) & 15)) * _QUARTER
                q = _u16(src, o + 2 + 8 * g + 2 * sub)
                _point(dst, y + 32 * g + 8 * sub, db, _G2XS, q & np.uint32(511), _KSIGNS[q >> np.uint32(9)], 0, 8)


@njit(cache=True)
def _row_iq2_s(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 82, b * 256  # f16 d | u8 qs[32] | u8 signs[32] | u8 qh[8] | u8 scales[8]
        d = f16_at(src, o)
        for g in range(8):
            sc, qh = src[o + 74 + g], np.uint32(src[o + 66 + g])
            for sub in range(4):
                db = d * (_HALF + np.float32((sc >> (4 * (sub // 2))) & 15)) * _QUARTER
                index = np.uint32(src[o + 2 + 4 * g + sub]) | (((qh >> np.uint32(2 * sub)) & np.uint32(3)) << 8)
                _point(dst, y + 32 * g + 8 * sub, db, _G2S, index, src[o + 34 + 4 * g + sub], 0, 8)


@njit(cache=True)
def _row_iq3_xxs(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 98, b * 256  # f16 d | u8 qs[64] (4-weight points) | u32 scales_and_signs[8]
        d = f16_at(src, o)
        for g in range(8):
            s = _u32(src, o + 66 + 4 * g)
            db = d * (_HALF + np.float32(s >> np.uint32(28))) * _HALF
            for sub in range(4):
                signs = _KSIGNS[(s >> np.uint32(7 * sub)) & np.uint32(127)]
                q = o + 2 + 8 * g + 2 * sub
                _point(dst, y + 32 * g + 8 * sub, db, _G3XXS, src[q], signs, 0, 4)
                _point(dst, y + 32 * g + 8 * sub + 4, db, _G3XXS, src[q + 1], signs >> 4, 0, 4)


@njit(cache=True)
def _row_iq3_s(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 110, b * 256  # f16 d | u8 qs[64] | u8 qh[8] | u8 signs[32] | u8 scales[4]
        d = f16_at(src, o)
        for g in range(8):
            db = d * np.float32(1 + 2 * ((src[o + 106 + g // 2] >> (4 * (g % 2))) & 15))
            for sub in range(4):
                signs = src[o + 74 + 4 * g + sub]
                for half in range(2):
                    p = 8 * g + 2 * sub + half
                    index = np.uint32(src[o + 2 + p]) | (((np.uint32(src[o + 66 + p // 8]) >> (p % 8)) & 1) << 8)
                    for j in range(4):
                        v = db * _G3S[index, j]
                        dst[y + 32 * g + 8 * sub + 4 * half + j] = -v if (signs >> (4 * half + j)) & 1 else v


@njit(cache=True)
def _row_iq1_s(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 50, b * 256  # f16 d | u8 qs[32] | u16 qh[8]
        d = f16_at(src, o)
        for g in range(8):
            qh = _u16(src, o + 34 + 2 * g)
            dl = d * np.float32(2 * ((qh >> np.uint32(12)) & np.uint32(7)) + 1)
            delta = -_DELTA if qh & np.uint32(0x8000) else _DELTA
            for sub in range(4):
                index = np.uint32(src[o + 2 + 4 * g + sub]) | (((qh >> np.uint32(3 * sub)) & np.uint32(7)) << 8)
                for j in range(8):
                    dst[y + 32 * g + 8 * sub + j] = dl * (_G1S[index, j] + delta)


@njit(cache=True)
def _row_iq1_m(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 56, b * 256  # u8 qs[32] | u8 qh[16] | u16 scales[4] (their top nibbles: the f16 d)
        s0, s1, s2, s3 = _u16(src, o + 48), _u16(src, o + 50), _u16(src, o + 52), _u16(src, o + 54)
        d = half_bits_to_f32((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000))
        for g in range(8):
            sc = _u16(src, o + 48 + 2 * (g // 2))
            for half in range(2):
                dl = d * np.float32(2 * ((sc >> np.uint32(6 * (g % 2) + 3 * half)) & np.uint32(7)) + 1)
                for sub in range(2):
                    p = 4 * g + 2 * half + sub
                    nib = (np.uint32(src[o + 32 + p // 2]) >> np.uint32(4 * (p % 2))) & np.uint32(15)
                    index = np.uint32(src[o + p]) | ((nib & np.uint32(7)) << 8)
                    delta = -_DELTA if nib & np.uint32(8) else _DELTA
                    for j in range(8):
                        dst[y + 32 * g + 16 * half + 8 * sub + j] = dl * (_G1M[index, j] + delta)
