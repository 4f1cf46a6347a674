"""The lattice types' side of the int8 prompt GEMM (gemm8.py): a row unpacked into the tile as unsigned levels
u = q + c with w = a_j (u - c) per sub-block j, a_j = d f ls_j (lattice.py's algebra: q the weight's small signed
integer, ls_j = 2 s_j + 1, f a power of two per type; c and the sub-block size per type in OFFSETS).

How: the exact path's compiled row decoder (dequant_lattice.py) gives the row's f32 weights, which are exactly
a_j q (every product fits f32's mantissa), so q = w / a_j exactly; the scales are read from the blocks here. A
row's grid gathers and signs then run once per prompt matmul and row, in scalar code, while the tile kernels
(gemm8._tile_kernel, symmetric) do the products for every token.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels.cpu.dequant import f16_at, half_bits_to_f32
from engine.kernels.cpu.dequant_lattice import (IQ1_M_CODE, IQ1_S_CODE, IQ2_S_CODE, IQ2_XS_CODE, IQ2_XXS_CODE,
                                                IQ3_S_CODE, IQ3_XXS_CODE)
from engine.kernels.cpu.dequant_lowbit import dequant_any_row

# code -> (c, columns of a sub-block): c the largest |q| (u = q + c >= 0), for gemm8_unpack.OFFSETS (unpack below
# spells them out per type: numba reads no dict in compiled code)
OFFSETS = {IQ2_XXS_CODE: (43, 32), IQ2_XS_CODE: (43, 16), IQ2_S_CODE: (43, 16), IQ3_XXS_CODE: (62, 32),
           IQ3_S_CODE: (15, 32), IQ1_S_CODE: (9, 32), IQ1_M_CODE: (9, 16)}

_any_row = njit(inline="always")(dequant_any_row)


def unpack(src, code, nsb, scratch, tile, ws, wi, wd, r):
    """Row r of the tile's rows (src: its blocks) -> its levels u into the tile (group-major: 4 columns of R rows,
    4 bytes each) and its scales into ws, wi, wd as gemm8_unpack.unpack's other types. scratch: (4 K,) bytes.
    Plain Python, inlined with a constant code (the other types' decoders pruned)."""
    w = scratch.view(np.float32)
    _any_row(src, code, w)
    if code == IQ2_XXS_CODE:
        _scales_iq2_xxs(src, nsb, ws, wi, wd, r)
        _levels(w, nsb * 256, 32, 43, ws, tile, r)
    elif code == IQ2_XS_CODE:
        _scales_nibbles(src, nsb, 74, 66, ws, wi, wd, r)
        _levels(w, nsb * 256, 16, 43, ws, tile, r)
    elif code == IQ2_S_CODE:
        _scales_nibbles(src, nsb, 82, 74, ws, wi, wd, r)
        _levels(w, nsb * 256, 16, 43, ws, tile, r)
    elif code == IQ3_XXS_CODE:
        _scales_iq3_xxs(src, nsb, ws, wi, wd, r)
        _levels(w, nsb * 256, 32, 62, ws, tile, r)
    elif code == IQ3_S_CODE:
        _scales_iq3_s(src, nsb, ws, wi, wd, r)
        _levels(w, nsb * 256, 32, 15, ws, tile, r)
    elif code == IQ1_S_CODE:
        _scales_iq1_s(src, nsb, ws, wi, wd, r)
        _levels(w, nsb * 256, 32, 9, ws, tile, r)
    else:
        _scales_iq1_m(src, nsb, ws, wi, wd, r)
        _levels(w, nsb * 256, 16, 9, ws, tile, r)


@njit(cache=True)
def _levels(w, K, sub, c, ws, tile, r):
    """u = w / a_j + c of every column into the tile (a zero scale: u = c, which it multiplies by nothing)."""
    R = ws.shape[2]
    for y in range(K):
        a = ws[y // sub, 0, r]
        u = c if a == 0 else np.int32(np.rint(w[y] / a)) + c
        tile[((y >> 2) * R + r) * 4 + (y & 3)] = u


@njit(cache=True, inline="always")
def _scale(ws, wi, j, r, a, ls, c):
    """Sub-block j of row r: w = a (u - c), a = d f ls (f32), ls twice as two i16 (the 256-bit form's vpmaddwd)."""
    ws[j, 0, r] = a
    ws[j, 1, r] = np.float32(c) * a
    wi[j, r] = np.int32(ls | (ls << 16))


@njit(cache=True, inline="always")
def _u16(src, o):
    return np.int32(src[o]) | (np.int32(src[o + 1]) << 8)


@njit(cache=True)
def _scales_iq2_xxs(src, nsb, ws, wi, wd, r):
    for sb in range(nsb):  # f16 d | per group: 4 index bytes, u32 sign indices + scale (its top 4 bits)
        o = sb * 66
        df = f16_at(src, o) * np.float32(0.125)
        wd[sb, r] = df
        for g in range(8):
            ls = 2 * (np.int32(src[o + 9 + 8 * g]) >> 4) + 1
            _scale(ws, wi, sb * 8 + g, r, df * np.float32(ls), ls, 43)


@njit(cache=True)
def _scales_nibbles(src, nsb, bb, at, ws, wi, wd, r):
    """IQ2_XS (74-byte blocks, scales at 66), IQ2_S (82, at 74): f16 d first, a byte of two 4-bit scales per 32."""
    for sb in range(nsb):
        o = sb * bb
        df = f16_at(src, o) * np.float32(0.125)
        wd[sb, r] = df
        for j in range(16):
            ls = 2 * ((np.int32(src[o + at + j // 2]) >> (4 * (j % 2))) & 15) + 1
            _scale(ws, wi, sb * 16 + j, r, df * np.float32(ls), ls, 43)


@njit(cache=True)
def _scales_iq3_xxs(src, nsb, ws, wi, wd, r):
    for sb in range(nsb):  # f16 d | qs[64] | u32 per group: sign indices + scale (its top 4 bits)
        o = sb * 98
        df = f16_at(src, o) * np.float32(0.25)
        wd[sb, r] = df
        for g in range(8):
            ls = 2 * (np.int32(src[o + 69 + 4 * g]) >> 4) + 1
            _scale(ws, wi, sb * 8 + g, r, df * np.float32(ls), ls, 62)


@njit(cache=True)
def _scales_iq3_s(src, nsb, ws, wi, wd, r):
    for sb in range(nsb):  # f16 d | qs[64] | qh[8] | signs[32] | scales[4] (a nibble per group)
        o = sb * 110
        df = f16_at(src, o)
        wd[sb, r] = df
        for g in range(8):
            ls = 2 * ((np.int32(src[o + 106 + g // 2]) >> (4 * (g % 2))) & 15) + 1
            _scale(ws, wi, sb * 8 + g, r, df * np.float32(ls), ls, 15)


@njit(cache=True)
def _scales_iq1_s(src, nsb, ws, wi, wd, r):
    for sb in range(nsb):  # f16 d | qs[32] | u16 qh[8] (bits 12-14: the group's scale)
        o = sb * 50
        df = f16_at(src, o) * np.float32(0.125)
        wd[sb, r] = df
        for g in range(8):
            ls = 2 * ((_u16(src, o + 34 + 2 * g) >> 12) & 7) + 1
            _scale(ws, wi, sb * 8 + g, r, df * np.float32(ls), ls, 9)


@njit(cache=True)
def _scales_iq1_m(src, nsb, ws, wi, wd, r):
    for sb in range(nsb):  # qs[32] | qh[16] | u16 scales[4]: 3 bits per 16 weights, d in the top nibbles
        o = sb * 56
        s = [_u16(src, o + 48 + 2 * i) for i in range(4)]
        df = half_bits_to_f32(np.uint32((s[0] >> 12) | ((s[1] >> 8) & 0x00F0) | ((s[2] >> 4) & 0x0F00)
                                        | (s[3] & 0xF000))) * np.float32(0.125)
        wd[sb, r] = df
        for h in range(16):
            ls = 2 * ((s[h // 4] >> (3 * (h % 4))) & 7) + 1
            _scale(ws, wi, sb * 16 + h, r, df * np.float32(ls), ls, 9)
