"""The numpy oracle: dequantize GGUF blocks to f32 with plain vectorized numpy.

Slow and simple on purpose: every fast kernel (engine/kernels/cpu/) is tested against this file, and this file
is tested against gguf.quants. It is written from the block layouts in llama.cpp's ggml-common.h /
ggml-quants.c (documented next to each decoder below). The float arithmetic follows ggml's order
(e.g. Q4_K computes (d*sc)*q - (dmin*m)), so results match gguf.quants bit for bit.

All multi-byte fields are little-endian. "f16" is IEEE half precision, converted exactly to f32.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType, QTensor, row_bytes, type_name
from engine.kernels import reference_lattice

QK_K = 256  # weights per K-quant super-block


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (..., 1) f32: a little-endian half-precision field, converted exactly."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., n) uint8 -> (..., 2n) uint8: all low nibbles first, then all high nibbles.

    This is the order Q4_0/Q4_1/Q5_0/Q5_1 (per block of 32) and Q4_K/Q5_K (per 64-weight chunk) use.
    """
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# ---------------------------------------------------------------------------------------------------------
# Float types
# ---------------------------------------------------------------------------------------------------------


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float32).copy()


def _f16_rows(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32: shift the 16 bits up and reinterpret.
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------------------
# Legacy 32-weight blocks. Each decoder gets blocks (n, block_bytes) and returns (n, 32) f32.
# ---------------------------------------------------------------------------------------------------------


def _q4_0(b: np.ndarray) -> np.ndarray:
    # block_q4_0 (18 B): f16 d | u8 qs[16]
    #   weight j (0..15) = low nibble of qs[j], weight j+16 = high nibble; w = d * (q - 8)
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    # block_q4_1 (20 B): f16 d | f16 m | u8 qs[16]; nibble order as Q4_0; w = d * q + m
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20]).astype(np.float32)
    return d * q + m


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) uint8 holding a little-endian u32 -> (n, 32) uint8: bit j of it, moved to bit 4 (value 16)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # bit j of the u32 at index j
    return bits << 4


def _q5_0(b: np.ndarray) -> np.ndarray:
    # block_q5_0 (22 B): f16 d | u8 qh[4] (u32, bit j = 5th bit of weight j) | u8 qs[16] (nibbles as Q4_0)
    #   w = d * (q - 16), q = nibble | (bit << 4)
    d = _f16(b[:, 0:2])
    q = (_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    # block_q5_1 (24 B): f16 d | f16 m | u8 qh[4] | u8 qs[16]; w = d * q + m
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = (_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8])).astype(np.float32)
    return d * q + m


def _q8_0(b: np.ndarray) -> np.ndarray:
    # block_q8_0 (34 B): f16 d | i8 qs[32]; w = d * q
    d = _f16(b[:, 0:2])
    return d * b[:, 2:34].view(np.int8).astype(np.float32)


# E2M1 codes as llama.cpp's kvalues_mxfp4: the FP4 values doubled (so they are integers, -12..12); the block
# scale is then halved to compensate (e8m0_half below).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """u8 E8M0 exponents -> f32 2^(e - 128) (half of 2^(e - 127)), exact for every byte as ggml's
    GGML_E8M0_TO_FP32_HALF: e = 0, 1 give the subnormals 2^-128, 2^-127; 255 is 2^127, not NaN."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << (e & np.uint32(1)), (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _mxfp4(b: np.ndarray) -> np.ndarray:
    # block_mxfp4 (17 B): u8 e (E8M0) | u8 qs[16] (4-bit E2M1 codes, nibble order as Q4_0)
    #   w = e8m0_half(e) * MXFP4_VALUES[code]: exact, or +-inf where 12 * 2^(e-128) overflows (e >= 253)
    d = e8m0_half(b[:, 0:1])
    return d * MXFP4_VALUES[_nibbles(b[:, 1:17])].astype(np.float32)


# ---------------------------------------------------------------------------------------------------------
# K-quants: 256-weight super-blocks. Each decoder gets blocks (n, block_bytes) and returns (n, 256) f32.
# ---------------------------------------------------------------------------------------------------------


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K packed 6-bit scales: (n, 12) uint8 -> sc, m each (n, 8) uint8 (one per 32-weight sub-block).

    Bytes 0-3 hold sc[0..3] in bits 0-5, bytes 4-7 hold m[0..3] in bits 0-5; bytes 8-11 hold the low 4 bits
    of sc[4..7] (low nibble) and m[4..7] (high nibble), whose top 2 bits are bits 6-7 of bytes 0-3 / 4-7.
    """
    lo, hi, tail = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (tail & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 0x3F, (tail >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, m


def _q4_k(b: np.ndarray) -> np.ndarray:
    # block_q4_K (144 B): f16 d | f16 dmin | u8 scales[12] (k_scale_min) | u8 qs[128]
    #   four 64-weight chunks c, each from qs[32c:32c+32]: low nibbles = sub-block 2c, high = 2c+1.
    #   w = (d * sc[s]) * q - (dmin * m[s])
    n = len(b)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * m.astype(np.float32))[:, :, None]
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(b: np.ndarray) -> np.ndarray:
    # block_q5_K (176 B): f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
    #   low 4 bits as Q4_K; the 5th bit of weight l of sub-block s is bit s of qh[l]. w as Q4_K.
    n = len(b)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]  # (n, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8 sub-blocks, 32)
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = (low | (high << 4)).astype(np.float32)
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * m.astype(np.float32))[:, :, None]
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(b: np.ndarray) -> np.ndarray:
    # block_q6_K (210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
    #   two 128-weight halves h; ql_h = ql[64h:64h+64], qh_h = qh[32h:32h+32]. For l in 0..31:
    #     weight  l     : ql_h[l]    low nibble  | bits 0-1 of qh_h[l] << 4
    #     weight  l+32  : ql_h[l+32] low nibble  | bits 2-3
    #     weight  l+64  : ql_h[l]    high nibble | bits 4-5
    #     weight  l+96  : ql_h[l+32] high nibble | bits 6-7
    #   q is 6-bit minus 32; each 16 weights have their own scale: w = (d * scales[i // 16]) * q
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    d = _f16(b[:, 208:210])
    low = _nibbles(ql).reshape(n, 2, 4, 32)  # quarters: ql[0:32] lo, ql[32:64] lo, ql[0:32] hi, ql[32:64] hi
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 16, 16)
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------------------
# Low-bit types: 2- and 3-bit K-quants, the 4-bit non-linear codebook (IQ4_NL, IQ4_XS), ternary (TQ1_0, TQ2_0).
# Each decoder gets blocks (n, block_bytes) and returns (n, block weights) f32.
# ---------------------------------------------------------------------------------------------------------


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(n, 64) uint8 -> (n, 256) uint8 2-bit fields, in the order Q2_K, Q3_K and TQ2_0 share: two halves of
    32 bytes; in each, field j (bits 2j, 2j+1) of byte l is weight 32j + l of that half."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    return ((qs.reshape(len(qs), 2, 1, 32) >> shifts) & 3).reshape(len(qs), QK_K)


def _q2_k(b: np.ndarray) -> np.ndarray:
    # block_q2_K (84 B): u8 scales[16] | u8 qs[64] (_crumbs) | f16 d | f16 dmin
    #   sixteen 16-weight groups g in _crumbs' order; scales[g]: low nibble scale, high nibble min.
    #   w = (d * sc) * q - (dmin * m)
    n = len(b)
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = _crumbs(b[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    scale = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    offset = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (scale * q - offset).reshape(n, QK_K)


def _q3_k(b: np.ndarray) -> np.ndarray:
    # block_q3_K (110 B): u8 hmask[32] | u8 qs[64] (_crumbs: low 2 bits) | u8 scales[12] | f16 d
    #   the third bit of weight 32k + l (k = 0..7 over both halves) is bit k of hmask[l]; ggml subtracts 4 when it
    #   is clear: q = low - 4 * (1 - bit), -4..3.
    #   16 6-bit scales for 16-weight groups, stored + 32: low 4 bits in the low nibbles of scales[0:8] (groups
    #   0-7) then their high nibbles (8-15); top 2 bits of group g at bits 2 * (g // 4) of scales[8 + g % 4].
    #   w = (d * (sc - 32)) * q
    n = len(b)
    bit = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32)
    q = _crumbs(b[:, 32:96]).astype(np.int8) - ((bit ^ 1) << 2).reshape(n, QK_K).astype(np.int8)
    packed = b[:, 96:108]
    top = (packed[:, None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3  # (n, g // 4, g % 4)
    sc = ((_nibbles(packed[:, 0:8]) | (top.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    d = _f16(b[:, 108:110])
    return ((d * sc)[:, :, None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


# llama.cpp's kvalues_iq4nl: the 16 levels of IQ4_NL and IQ4_XS, a non-uniform grid denser near zero.
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    # block_iq4_nl (18 B): f16 d | u8 qs[16] (nibble order as Q4_0); w = d * IQ4_NL_VALUES[nibble]
    d = _f16(b[:, 0:2])
    return d * IQ4_NL_VALUES[_nibbles(b[:, 2:18])].astype(np.float32)


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    # block_iq4_xs (136 B): f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]
    #   eight 32-weight sub-blocks s from qs[16s:16s+16] (nibble order as Q4_0); 6-bit scale, stored + 32:
    #   low 4 bits = nibble s % 2 of scales_l[s // 2] (low nibble first), top 2 bits = bits 2s, 2s+1 of scales_h.
    #   w = (d * (ls - 32)) * IQ4_NL_VALUES[nibble]
    n = len(b)
    d = _f16(b[:, 0:2])
    high = (np.ascontiguousarray(b[:, 2:4]).view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3  # (n, 8)
    low = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=-1).reshape(n, 8)
    ls = ((low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    q = IQ4_NL_VALUES[_nibbles(b[:, 8:136].reshape(n, 8, 16))].astype(np.float32)  # (n, 8, 32)
    return ((d * ls)[:, :, None] * q).reshape(n, QK_K)


def _trits(qs: np.ndarray, k: int) -> np.ndarray:
    """(n, m) uint8 -> (n, k * m) uint8: base-3 digit t (outer) of every byte l (inner), as ggml reads them.

    TQ1_0 stores 5 (or 4) ternary digits per byte as a fixed-point fraction x = ceil(v * 256 / 243): multiplying
    by 3^t (mod 256, u8 arithmetic) shifts digit t to the top, and (x * 3) >> 8 reads it."""
    pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)[None, :k, None]
    digits = (((qs[:, None, :] * pow3).astype(np.uint16) * 3) >> 8).astype(np.uint8)
    return digits.reshape(len(qs), k * qs.shape[1])


def _tq1_0(b: np.ndarray) -> np.ndarray:
    # block_tq1_0 (54 B): u8 qs[48] | u8 qh[4] | f16 d; 256 ternary weights, q - 1 in {-1, 0, 1}:
    #   weights 0-159 are _trits(qs[0:32], 5), 160-239 _trits(qs[32:48], 5), 240-255 _trits(qh, 4).
    #   w = d * (q - 1)
    q = np.concatenate([_trits(b[:, 0:32], 5), _trits(b[:, 32:48], 5), _trits(b[:, 48:52], 4)], axis=-1)
    return _f16(b[:, 52:54]) * (q.astype(np.int8) - np.int8(1)).astype(np.float32)


def _tq2_0(b: np.ndarray) -> np.ndarray:
    # block_tq2_0 (66 B): u8 qs[64] (_crumbs) | f16 d; w = d * (q - 1) (the quantizer writes q = 0..2; a 3 reads
    #   as 2, as in ggml)
    q = _crumbs(b[:, 0:64]).astype(np.int8) - np.int8(1)
    return _f16(b[:, 64:66]) * q.astype(np.float32)


_BLOCK_DECODERS = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
    GGMLType.MXFP4: _mxfp4,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.IQ4_NL: _iq4_nl,
    GGMLType.IQ4_XS: _iq4_xs,
    GGMLType.TQ1_0: _tq1_0,
    GGMLType.TQ2_0: _tq2_0,
    **{GGMLType[name]: decode for name, decode in reference_lattice.DECODERS.items()},
}
_FLOAT_DECODERS = {GGMLType.F32: _f32, GGMLType.F16: _f16_rows, GGMLType.BF16: _bf16}


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


def dequantize_raw(raw: np.ndarray, ggml_type: GGMLType | int, n_cols: int) -> np.ndarray:
    """raw: uint8 (rows, row_bytes) stored blocks -> f32 (rows, n_cols)."""
    try:
        ggml_type = GGMLType(int(ggml_type))
    except ValueError:
        raise NotImplementedError(f"no reference dequantizer for {type_name(int(ggml_type))}") from None
    rows = raw.shape[0]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != row_bytes(ggml_type, n_cols):
        raise ValueError(f"raw {raw.dtype}{raw.shape} does not hold {rows} rows of {n_cols} {ggml_type.name}")
    raw = np.ascontiguousarray(raw)
    if ggml_type in _FLOAT_DECODERS:
        return _FLOAT_DECODERS[ggml_type](raw).reshape(rows, n_cols)
    _, block_bytes = BLOCK_GEOMETRY[ggml_type]
    blocks = raw.reshape(-1, block_bytes)  # (rows * blocks_per_row, block_bytes)
    return _BLOCK_DECODERS[ggml_type](blocks).reshape(rows, n_cols)


def dequantize(t: QTensor) -> np.ndarray:
    """The whole weight as f32 (rows, cols)."""
    return dequantize_raw(t.raw, t.ggml_type, t.cols)


def matmul(x: np.ndarray, t: QTensor) -> np.ndarray:
    """x (T, cols) f32 -> x @ W.T, (T, rows) f32."""
    return np.asarray(x, dtype=np.float32) @ dequantize(t).T


def embed_rows(t: QTensor, ids) -> np.ndarray:
    """Rows ids of the weight as f32 (len(ids), cols), dequantizing only those rows."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    return dequantize_raw(t.raw[ids], t.ggml_type, t.cols)
