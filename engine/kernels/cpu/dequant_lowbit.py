"""Exact block decoders of the low-bit types (Q2_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0): one row of blocks to f32,
bit for bit as reference.py decodes it (its float order is ggml's).

Kept out of dequant.dequant_row: the compiled decode step compiles every branch of that runtime dispatch, and a
model without these types must not pay for their compile (quant_types.LOWBIT_TYPES). `dequant_any_row` is the
composite dispatch exact.py inlines into its per-type closures: for a constant code numba prunes every other
branch, the base types' included, so each closure compiles its own type's decoder only.
Same codegen as dequant.py (LLVM vector IR, no fast-math flags; its Block helpers); block layouts: reference.py.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from engine.kernels.cpu import dequant_lattice as lattice
# (the codes by name: numba prunes a branch on a global constant, not on a module attribute, lattice.X)
from engine.kernels.cpu.dequant_lattice import (IQ1_M_CODE, IQ1_S_CODE, IQ2_S_CODE, IQ2_XS_CODE, IQ2_XXS_CODE,
                                                IQ3_S_CODE, IQ3_XXS_CODE)
from engine.kernels.cpu.dequant import Block, decoder_codegen, decoder_sig, dequant_row, f16_at
from engine.kernels.cpu.ir import IQ4_NL_CODE, IQ4_XS_CODE, Q2_K_CODE, Q3_K_CODE, TQ1_0_CODE, TQ2_0_CODE
from engine.kernels.reference import IQ4_NL_VALUES

_I8, _I32 = ir.IntType(8), ir.IntType(32)

# =========================================================================================================
# Block pieces in LLVM vector IR: numba code walks a block and passes offsets (relative to the block start so),
# shifts and f32 scales, as dequant.py's K-quant pieces do.
# =========================================================================================================


@intrinsic
def _dq_crumb16(typingctx, src, so, dst, do, qs, shift, scale, offset):
    """16 Q2_K weights: q = (src[so+qs+l] >> shift) & 3 for l < 16; w = scale * q - offset."""
    def body(k, qs, shift, scale, offset):
        w = k.scale(k.field(k.bytes(qs, 16), shift, 3), scale)
        k.store(k.b.fsub(w, k.splat(offset, 16)))
    return decoder_sig(src, dst, types.intp, types.intp, types.float32, types.float32), decoder_codegen(body)


@intrinsic
def _dq_q3k16(typingctx, src, so, dst, do, qs, shift, hm, hm_bit, scale):
    """16 Q3_K weights: q = ((src[so+qs+l] >> shift) & 3 | bit hm_bit of src[so+hm+l] << 2) - 4 for l < 16 (ggml's
    low - 4 where the high bit is clear); w = scale * q."""
    def body(k, qs, shift, hm, hm_bit, scale):
        high = k.b.shl(k.field(k.bytes(hm, 16), hm_bit, 1), k.vec(_I32, [2] * 16))
        q = k.b.sub(k.b.or_(k.field(k.bytes(qs, 16), shift, 3), high), k.vec(_I32, [4] * 16))
        k.store(k.scale(q, scale))
    return decoder_sig(src, dst, types.intp, types.intp, types.intp, types.intp, types.float32), decoder_codegen(body)


@intrinsic
def _dq_tq2_32(typingctx, src, so, dst, do, qs, shift, d):
    """32 TQ2_0 weights: q = (src[so+qs+l] >> shift) & 3 for l < 32; w = d * (q - 1)."""
    def body(k, qs, shift, d):
        q = k.b.sub(k.field(k.bytes(qs, 32), shift, 3), k.vec(_I32, [1] * 32))
        k.store(k.scale(q, d))
    return decoder_sig(src, dst, types.intp, types.intp, types.float32), decoder_codegen(body)


def _iq4_lookup(k: Block, v: ir.Value) -> ir.Value:
    """<16 x i8> packed nibbles -> <32 x i32> IQ4_NL_VALUES of all low nibbles, then all high nibbles.

    LLVM IR has no variable-index vector shuffle, so the 16-entry table is a binary tree of 15 selects on the
    nibble's bits, in i8 lanes (one vector register), widened once at the end."""
    b = k.b
    c = b.shuffle_vector(b.and_(v, k.vec(_I8, [15] * 16)), b.lshr(v, k.vec(_I8, [4] * 16)), k.vec(_I32, range(32)))
    level = [k.vec(_I8, [int(x) & 0xFF] * 32) for x in IQ4_NL_VALUES]
    bit = 1
    while len(level) > 1:
        on = b.icmp_unsigned("!=", b.and_(c, k.vec(_I8, [bit] * 32)), k.vec(_I8, [0] * 32))
        level = [b.select(on, level[i + 1], level[i]) for i in range(0, len(level), 2)]
        bit <<= 1
    return b.sext(level[0], ir.VectorType(_I32, 32))


@intrinsic
def _dq_iq4_32(typingctx, src, so, dst, do, qs, scale):
    """32 IQ4_NL/IQ4_XS weights from the 16 bytes at so+qs (nibble order as Q4_0); w = scale * IQ4_NL_VALUES[q]."""
    def body(k, qs, scale):
        k.store(k.scale(_iq4_lookup(k, k.bytes(qs, 16)), scale))
    return decoder_sig(src, dst, types.intp, types.float32), decoder_codegen(body)


def _trits_of(n: int):
    """The intrinsic decoding one base-3 digit of each of n TQ1_0 bytes: byte l at so+qs times mul (a power of 3,
    mod 256 as ggml's u8 product) moves the digit to the top; q = (x * 3) >> 8; w = d * (q - 1), to dst[do + l]."""
    @intrinsic
    def dq_trits(typingctx, src, so, dst, do, qs, mul, d):
        def body(k, qs, mul, d):
            x = k.i32(k.b.mul(k.bytes(qs, n), k.splat(k.b.trunc(mul, _I8), n)))
            q = k.b.lshr(k.b.mul(x, k.vec(_I32, [3] * n)), k.vec(_I32, [8] * n))
            k.store(k.scale(k.b.sub(q, k.vec(_I32, [1] * n)), d))
        return decoder_sig(src, dst, types.intp, types.intp, types.float32), decoder_codegen(body)

    return dq_trits


_dq_trits32, _dq_trits16, _dq_trits4 = _trits_of(32), _trits_of(16), _trits_of(4)

# =========================================================================================================
# Row decoders: src = one row of stored blocks (row_bytes,) uint8 -> dst (cols,) f32
# =========================================================================================================


@njit(cache=True)
def _row_q2_k(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 84, b * 256  # scales[16] | qs[64] | f16 d | f16 dmin
        d, dmin = f16_at(src, o + 80), f16_at(src, o + 82)
        for g in range(16):  # 16-weight group g: half g // 8, 2-bit field (g % 8) // 2 of 16 bytes, part g % 2
            sc = np.int32(src[o + g])  # low nibble scale, high nibble min
            _dq_crumb16(src, o, dst, y + 16 * g, 16 + 32 * (g // 8) + 16 * (g % 2), 2 * ((g % 8) // 2),
                        d * np.float32(sc & 15), dmin * np.float32(sc >> 4))


@njit(cache=True)
def _row_q3_k(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 110, b * 256  # hmask[32] | qs[64] | scales[12] | f16 d
        d = f16_at(src, o + 108)
        for g in range(16):  # groups as Q2_K; the high bit of chunk g // 2 is bit g // 2 of hmask[16 * (g % 2) + l]
            low = (np.int32(src[o + 96 + g % 8]) >> (4 * (g // 8))) & 15
            top = (np.int32(src[o + 104 + g % 4]) >> (2 * (g // 4))) & 3
            _dq_q3k16(src, o, dst, y + 16 * g, 32 + 32 * (g // 8) + 16 * (g % 2), 2 * ((g % 8) // 2),
                      16 * (g % 2), g // 2, d * np.float32((low | (top << 4)) - 32))


@njit(cache=True)
def _row_iq4_nl(src, dst):
    for b in range(dst.shape[0] // 32):
        _dq_iq4_32(src, b * 18, dst, b * 32, 2, f16_at(src, b * 18))  # f16 d | qs[16]


@njit(cache=True)
def _row_iq4_xs(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 136, b * 256  # f16 d | u16 scales_h | scales_l[4] | qs[128]
        d = f16_at(src, o)
        scales_h = np.int32(src[o + 2]) | (np.int32(src[o + 3]) << 8)
        for s in range(8):  # 32-weight sub-block s: qs[16s:16s+16]; 6-bit scale stored + 32
            ls = ((np.int32(src[o + 4 + s // 2]) >> (4 * (s % 2))) & 15) | (((scales_h >> (2 * s)) & 3) << 4)
            _dq_iq4_32(src, o, dst, y + 32 * s, 8 + 16 * s, d * np.float32(ls - 32))


@njit(cache=True)
def _row_tq1_0(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 54, b * 256  # qs[48] | qh[4] | f16 d; digit t of byte l of each part (reference._tq1_0)
        d = f16_at(src, o + 52)
        mul = 1
        for t in range(5):
            _dq_trits32(src, o, dst, y + 32 * t, 0, mul, d)
            _dq_trits16(src, o, dst, y + 160 + 16 * t, 32, mul, d)
            if t < 4:
                _dq_trits4(src, o, dst, y + 240 + 4 * t, 48, mul, d)
            mul *= 3


@njit(cache=True)
def _row_tq2_0(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 66, b * 256  # qs[64] | f16 d; 32-weight chunk c: 2-bit field c % 4 of qs[32 * (c // 4):]
        d = f16_at(src, o + 64)
        for c in range(8):
            _dq_tq2_32(src, o, dst, y + 32 * c, 32 * (c // 4), 2 * (c % 4), d)


# =========================================================================================================
# The composite dispatch
# =========================================================================================================

# The base types' dispatch, inlined where dequant_any_row is, so a constant code prunes it as before.
_base_row = njit(inline="always")(dequant_row.py_func)


def dequant_any_row(src, code, dst):
    """Decode one row of any type the exact path computes with (COMPUTE_TYPES, and the lattice types:
    dequant_lattice.py).

    Plain Python on purpose: exact.py compiles it inlined with a constant code (njit(inline="always")), which
    prunes the branches of the other types; as a jitted dispatch with a runtime code it would compile them all."""
    if code == Q2_K_CODE:
        _row_q2_k(src, dst)
    elif code == Q3_K_CODE:
        _row_q3_k(src, dst)
    elif code == IQ4_NL_CODE:
        _row_iq4_nl(src, dst)
    elif code == IQ4_XS_CODE:
        _row_iq4_xs(src, dst)
    elif code == TQ1_0_CODE:
        _row_tq1_0(src, dst)
    elif code == TQ2_0_CODE:
        _row_tq2_0(src, dst)
    elif code == IQ2_XXS_CODE:
        lattice._row_iq2_xxs(src, dst)
    elif code == IQ2_XS_CODE:
        lattice._row_iq2_xs(src, dst)
    elif code == IQ2_S_CODE:
        lattice._row_iq2_s(src, dst)
    elif code == IQ3_XXS_CODE:
        lattice._row_iq3_xxs(src, dst)
    elif code == IQ3_S_CODE:
        lattice._row_iq3_s(src, dst)
    elif code == IQ1_S_CODE:
        lattice._row_iq1_s(src, dst)
    elif code == IQ1_M_CODE:
        lattice._row_iq1_m(src, dst)
    else:
        _base_row(src, code, dst)
