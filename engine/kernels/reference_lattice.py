"""Exact numpy decoders of llama.cpp's lattice (grid) types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

Each 256-weight super-block is read as eight groups of 32; a group's weights come eight (or four) at a time from a
fixed codebook of points, the "grid" (llama.cpp's iq2xxs_grid, iq3s_grid, ...), picked by an index of 8-11 bits,
with a sign per weight (IQ2/IQ3: packed 8 to a byte, or 7 bits + parity through the ksigns table) and a scale per
group. IQ1_S/IQ1_M grids are ternary points shifted by +-1/8. The float operations are ggml's, in ggml's order
(ggml-quants.c dequantize_row_iq*), so every bit agrees with gguf.quants (tests/test_quant_kernels.py).

The grids and the ksigns table are the gguf package's own copies of llama.cpp's (gguf.quants, decoded once here);
the block layouts (field by field below) are llama.cpp's block_iq* structs.
"""

from __future__ import annotations

from functools import cache

import gguf.quants as gq
import numpy as np

QK_K = 256
_BIT = np.arange(8, dtype=np.uint8)
IQ1_DELTA = np.float32(0.125)  # IQ1S_DELTA: the shift of the IQ1 grids' ternary points


@cache
def grid(kind: str) -> np.ndarray:
    """llama.cpp's grid of a lattice type: (points, 8 or 4) float32 (the values, signs apart; IQ1: -1, 0, 1)."""
    cls = getattr(gq, kind)
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


@cache
def ksigns() -> np.ndarray:
    """ksigns_iq2xs: 7 sign bits -> 8 (the eighth makes the count of minus signs even)."""
    return np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _sign_bits(bytes_: np.ndarray) -> np.ndarray:
    """(..., m) uint8 -> (..., m, 8) float32 +-1: bit j of each byte set means weight j is negative."""
    return np.where((bytes_[..., None] >> _BIT) & 1, np.float32(-1), np.float32(1))


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4")


def _iq2_xxs(b: np.ndarray) -> np.ndarray:
    # block_iq2_xxs (66 B): f16 d | u16 qs[32]. Group g (32 weights) is two u32: a = 4 grid indices (bytes),
    #   s = four 7-bit sign indices (bits 0-27) and the scale (bits 28-31).
    #   w = (d * (0.5 + scale) * 0.25) * grid[index] * sign
    n = len(b)
    q = _u32(b[:, 2:66]).reshape(n, 8, 2)
    db = _f16(b[:, 0:2]) * (np.float32(0.5) + (q[..., 1] >> 28).astype(np.float32)) * np.float32(0.25)
    idx = np.ascontiguousarray(q[..., 0]).view(np.uint8).reshape(n, 8, 4)
    sign_idx = (q[..., 1][..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 0x7F
    signs = _sign_bits(ksigns()[sign_idx])  # (n, 8, 4, 8)
    return (db[:, :, None, None] * grid("IQ2_XXS")[idx] * signs).reshape(n, QK_K)


def _iq2_xs(b: np.ndarray) -> np.ndarray:
    # block_iq2_xs (74 B): f16 d | u16 qs[32] | u8 scales[8]. Each u16: 9-bit grid index, 7-bit sign index;
    #   group g's scales are the two nibbles of scales[g] (low: its first 16 weights).
    n = len(b)
    qs = np.ascontiguousarray(b[:, 2:66]).view("<u2").reshape(n, 8, 4)
    sc = np.stack([b[:, 66:74] & 0x0F, b[:, 66:74] >> 4], axis=-1)  # (n, 8, 2)
    db = _f16(b[:, 0:2])[:, :, None] * (np.float32(0.5) + sc) * np.float32(0.25)
    signs = _sign_bits(ksigns()[qs >> 9])  # (n, 8, 4, 8)
    w = grid("IQ2_XS")[qs & 511]
    return (np.repeat(db, 2, axis=-1)[..., None] * w * signs).reshape(n, QK_K)


def _iq2_s(b: np.ndarray) -> np.ndarray:
    # block_iq2_s (82 B): f16 d | u8 qs[32] (grid index low bits) | u8 signs[32] | u8 qh[8] | u8 scales[8].
    #   Index of point l of group g: qs[4g + l] | ((qh[g] >> 2l) & 3) << 8; sign bits one byte per point.
    n = len(b)
    qh = (b[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3  # (n, 8, 4)
    idx = b[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | (qh.astype(np.uint16) << 8)
    sc = np.stack([b[:, 74:82] & 0x0F, b[:, 74:82] >> 4], axis=-1)
    db = _f16(b[:, 0:2])[:, :, None] * (np.float32(0.5) + sc) * np.float32(0.25)
    signs = _sign_bits(b[:, 34:66].reshape(n, 8, 4))
    return (np.repeat(db, 2, axis=-1)[..., None] * grid("IQ2_S")[idx] * signs).reshape(n, QK_K)


def _iq3_xxs(b: np.ndarray) -> np.ndarray:
    # block_iq3_xxs (98 B): f16 d | u8 qs[64] (grid indices of 4-weight points) | u32 scales_and_signs[8]:
    #   per group, four 7-bit sign indices and the scale (bits 28-31). w = (d * (0.5 + scale) * 0.5) * grid * sign
    n = len(b)
    ss = _u32(b[:, 66:98])  # (n, 8)
    db = _f16(b[:, 0:2]) * (np.float32(0.5) + (ss >> 28).astype(np.float32)) * np.float32(0.5)
    signs = _sign_bits(ksigns()[(ss[..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 0x7F])
    w = grid("IQ3_XXS")[b[:, 2:66].reshape(n, 8, 8)].reshape(n, 8, 4, 8)  # two points per 8 weights
    return (db[:, :, None, None] * w * signs).reshape(n, QK_K)


def _iq3_s(b: np.ndarray) -> np.ndarray:
    # block_iq3_s (110 B): f16 d | u8 qs[64] | u8 qh[8] | u8 signs[32] | u8 scales[4]. Point p (of 64) has index
    #   qs[p] | bit p of qh (as bit 8); group g's scale is nibble g % 2 of scales[g // 2]: d * (1 + 2 * scale).
    n = len(b)
    high = ((b[:, 66:74, None] >> _BIT) & 1).reshape(n, 64).astype(np.uint16)
    idx = b[:, 2:66].astype(np.uint16) | (high << 8)
    sc = np.stack([b[:, 106:110] & 0x0F, b[:, 106:110] >> 4], axis=-1).reshape(n, 8)
    db = _f16(b[:, 0:2]) * (1 + 2 * sc)
    signs = _sign_bits(b[:, 74:106].reshape(n, 8, 4))
    w = grid("IQ3_S")[idx].reshape(n, 8, 4, 8)
    return (db[:, :, None, None] * w * signs).reshape(n, QK_K)


def _iq1_s(b: np.ndarray) -> np.ndarray:
    # block_iq1_s (50 B): f16 d | u8 qs[32] | u16 qh[8]. Group g: qh[g] bits 3l..3l+2 extend point l's index
    #   (qs[4g + l]) to 11 bits, bits 12-14 the scale, bit 15 the delta's sign. w = (d * (2 * scale + 1)) *
    #   (grid + delta), delta = +-1/8
    n = len(b)
    qh = np.ascontiguousarray(b[:, 34:50]).view("<u2")  # (n, 8)
    dl = _f16(b[:, 0:2]) * (2 * ((qh >> 12) & 7) + 1)
    delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA)
    idx = b[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | (((qh[..., None] >> np.array([0, 3, 6, 9],
                                                                                      dtype=np.uint16)) & 7) << 8)
    return (dl[:, :, None, None] * (grid("IQ1_S")[idx] + delta[:, :, None, None])).reshape(n, QK_K)


def _iq1_m(b: np.ndarray) -> np.ndarray:
    # block_iq1_m (56 B): u8 qs[32] | u8 qh[16] | u16 scales[4]; no d field: d (f16) is the top nibbles of the
    #   four scale words. Point p: index qs[p] | (nibble p of qh & 7) << 8, delta sign bit 3 of that nibble;
    #   each half group (16 weights) has a 3-bit scale: w = (d * (2 * scale + 1)) * (grid + delta)
    n = len(b)
    sc = np.ascontiguousarray(b[:, 48:56]).view("<u2")  # (n, 4)
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = d_bits.astype(np.uint16).view(np.float16).astype(np.float32)
    scale = ((sc[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7).reshape(n, 16)
    dl = d[:, None] * (2 * scale + 1)  # (n, 16): half groups
    nib = np.stack([b[:, 32:48] & 0x0F, b[:, 32:48] >> 4], axis=-1).reshape(n, 32)  # one per point
    idx = b[:, 0:32].astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
    delta = np.where(nib & 8, -IQ1_DELTA, IQ1_DELTA)
    w = grid("IQ1_M")[idx] + delta[..., None]  # (n, 32, 8)
    return (dl.reshape(n, 16, 1, 1) * w.reshape(n, 16, 2, 8)).reshape(n, QK_K)


DECODERS = {"IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s,
            "IQ1_S": _iq1_s, "IQ1_M": _iq1_m}
