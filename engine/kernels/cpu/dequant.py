"""Exact block decoders: one GGUF row (stored blocks, uint8) to f32, bit for bit as reference.py decodes it.

Blocks are decoded by small LLVM-IR intrinsics (see the banner below), compiled without fast-math, so the
decoded weights equal the reference's bit for bit (docs/design-log.md, "The CPU kernel measurements", 1). `dequant_row`
dispatches on the type code; exact.py's drivers, the packed layout's tail rows and the decode step's embedding
lookup all call it. The low-bit types' decoders live apart, in dequant_lowbit.py (with its own dispatch that
exact.py inlines), so the decode step's compile of this dispatch leaves them out. Block layouts: reference.py.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from engine.kernels.quant_types import GGMLType

# Type codes as plain ints (compile-time constants inside njit).
_F32, _F16, _BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = (int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0),
                                     int(GGMLType.Q5_1), int(GGMLType.Q8_0))
_Q4_K, _Q5_K, _Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q5_K), int(GGMLType.Q6_K)
_MXFP4 = int(GGMLType.MXFP4)

# =========================================================================================================
# Block decoders in LLVM vector IR
#
# Numba intrinsics, because LLVM does not vectorize the plain numba loops: the 16/32-long inner loops are
# fully unrolled, then SLP cannot bundle the u8 loads across f32 stores it must assume may alias (scalar
# cvtsi2ss code, slow: docs/benchmarks.md, "Measurements behind the code", dequant intrinsics). Each intrinsic
# decodes a fixed number of weights with explicit <N x ...> vector ops: plain LLVM IR without target intrinsics,
# so x86 and ARM both lower it.
# No fast-math flags are set: the arithmetic is the reference's, bit for bit. Block, decoder_sig and decoder_codegen
# are shared with dequant_lowbit.py.
# =========================================================================================================

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()


class Block:
    """IR helpers for one decoder call: reads bytes at src[so + off], writes f32 vectors at dst[do]."""

    def __init__(self, context, builder, sig, args):
        src_ty, _, dst_ty = sig.args[:3]
        src, so, dst, do = args[:4]
        self.b = builder
        self.src = builder.gep(context.make_array(src_ty)(context, builder, src).data, [so], source_etype=_I8)
        self.dst = builder.gep(context.make_array(dst_ty)(context, builder, dst).data, [do], source_etype=_F32)

    def _at(self, off):
        off = off if isinstance(off, ir.Value) else ir.Constant(_I64, off)
        return self.b.gep(self.src, [off], source_etype=_I8)

    def bytes(self, off, n: int) -> ir.Value:
        """<n x i8> from src[so + off : so + off + n]."""
        return self.b.load(self._at(off), typ=ir.VectorType(_I8, n), align=1)

    def u32(self, off: int) -> ir.Value:
        return self.b.load(self._at(off), typ=_I32, align=1)

    def f16(self, off: int) -> ir.Value:
        """The little-endian f16 at src[so + off], as float (exact)."""
        h = self.b.load(self._at(off), typ=_I16, align=1)
        return self.b.fpext(self.b.bitcast(h, ir.HalfType()), _F32)

    def vec(self, ty: ir.Type, values) -> ir.Constant:
        return ir.Constant(ir.VectorType(ty, len(values)), list(values))

    def splat(self, x: ir.Value, n: int) -> ir.Value:
        v = self.b.insert_element(ir.Constant(ir.VectorType(x.type, n), None), x, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, v, self.vec(_I32, [0] * n))

    def i32(self, v: ir.Value) -> ir.Value:
        """<n x i8> -> <n x i32>, zero-extended."""
        return self.b.zext(v, ir.VectorType(_I32, v.type.count))

    def nibbles(self, v: ir.Value) -> ir.Value:
        """<n x i8> -> <2n x i32>: all low nibbles, then all high nibbles."""
        n = v.type.count
        lo = self.b.and_(v, self.vec(_I8, [15] * n))
        hi = self.b.lshr(v, self.vec(_I8, [4] * n))
        return self.i32(self.b.shuffle_vector(lo, hi, self.vec(_I32, range(2 * n))))

    def field(self, v: ir.Value, shift: ir.Value, mask: int) -> ir.Value:
        """<n x i8> -> <n x i32>: (v >> shift) & mask, shift a runtime i64 (same for every lane)."""
        n = v.type.count
        s = self.splat(self.b.trunc(shift, _I32), n)
        return self.b.and_(self.b.lshr(self.i32(v), s), self.vec(_I32, [mask] * n))

    def to_f32(self, q: ir.Value) -> ir.Value:
        return self.b.sitofp(q, ir.VectorType(_F32, q.type.count))

    def scale(self, q: ir.Value, d: ir.Value) -> ir.Value:
        """float(q) * d, lane-wise."""
        return self.b.fmul(self.to_f32(q), self.splat(d, q.type.count))

    def store(self, w: ir.Value) -> None:
        self.b.store(w, self.b.bitcast(self.dst, w.type.as_pointer()), align=4)


def decoder_sig(src, dst, *scalars):
    """Type check shared by all decoders: (u8 array, intp, f32 array, intp, *scalars) -> None.
    Offsets are flat from the data pointers, hence C-contiguous arrays only (rows of C arrays are)."""
    ok = (isinstance(src, types.Array) and src.dtype == types.uint8 and src.layout == "C"
          and isinstance(dst, types.Array) and dst.dtype == types.float32 and dst.layout == "C")
    return types.none(src, types.intp, dst, types.intp, *scalars) if ok else None


def decoder_codegen(body):
    def codegen(context, builder, sig, args):
        body(Block(context, builder, sig, args), *args[4:])
        return context.get_dummy_value()

    return codegen


# --- 32-weight legacy blocks: (src, block byte offset, dst, first weight offset) ---------------------------


@intrinsic
def _dq_q4_0(typingctx, src, so, dst, do):
    """block_q4_0: f16 d | qs[16]; w = d * (nibble - 8)."""
    def body(k):
        q = k.b.sub(k.nibbles(k.bytes(2, 16)), k.vec(_I32, [8] * 32))
        k.store(k.scale(q, k.f16(0)))
    return decoder_sig(src, dst), decoder_codegen(body)


@intrinsic
def _dq_q4_1(typingctx, src, so, dst, do):
    """block_q4_1: f16 d | f16 m | qs[16]; w = d * nibble + m."""
    def body(k):
        w = k.scale(k.nibbles(k.bytes(4, 16)), k.f16(0))
        k.store(k.b.fadd(w, k.splat(k.f16(2), 32)))
    return decoder_sig(src, dst), decoder_codegen(body)


def _fifth_bits(k: Block, qh_off: int) -> ir.Value:
    """<32 x i32>: bit j of the u32 at qh_off, moved to value 16, for weight j."""
    qh = k.splat(k.u32(qh_off), 32)
    return k.b.shl(k.b.and_(k.b.lshr(qh, k.vec(_I32, range(32))), k.vec(_I32, [1] * 32)), k.vec(_I32, [4] * 32))


@intrinsic
def _dq_q5_0(typingctx, src, so, dst, do):
    """block_q5_0: f16 d | u32 qh | qs[16]; w = d * ((nibble | bit << 4) - 16)."""
    def body(k):
        q = k.b.or_(k.nibbles(k.bytes(6, 16)), _fifth_bits(k, 2))
        k.store(k.scale(k.b.sub(q, k.vec(_I32, [16] * 32)), k.f16(0)))
    return decoder_sig(src, dst), decoder_codegen(body)


@intrinsic
def _dq_q5_1(typingctx, src, so, dst, do):
    """block_q5_1: f16 d | f16 m | u32 qh | qs[16]; w = d * (nibble | bit << 4) + m."""
    def body(k):
        q = k.b.or_(k.nibbles(k.bytes(8, 16)), _fifth_bits(k, 4))
        k.store(k.b.fadd(k.scale(q, k.f16(0)), k.splat(k.f16(2), 32)))
    return decoder_sig(src, dst), decoder_codegen(body)


@intrinsic
def _dq_q8_0(typingctx, src, so, dst, do):
    """block_q8_0: f16 d | i8 qs[32]; w = d * q."""
    def body(k):
        q = k.b.sext(k.bytes(2, 32), ir.VectorType(_I32, 32))
        k.store(k.scale(q, k.f16(0)))
    return decoder_sig(src, dst), decoder_codegen(body)


@intrinsic
def _dq_mxfp4(typingctx, src, so, dst, do):
    """block_mxfp4: u8 e | qs[16] (E2M1 codes); w = 2^(e-128) * (the code's value doubled, -12..12)."""
    def body(k):
        b = k.b
        c = k.nibbles(k.bytes(1, 16))  # <32 x i32> codes: bit 3 sign, bits 1-2 exponent, bit 0 mantissa
        m1 = b.and_(c, k.vec(_I32, [1] * 32))
        e2 = b.and_(b.lshr(c, k.vec(_I32, [1] * 32)), k.vec(_I32, [3] * 32))
        # doubled magnitude: m1 when e2 = 0 (subnormal), else (2 + m1) << (e2 - 1), written without a -1 shift
        normal = b.lshr(b.shl(b.or_(m1, k.vec(_I32, [2] * 32)), e2), k.vec(_I32, [1] * 32))
        mag = b.select(b.icmp_unsigned("==", e2, k.vec(_I32, [0] * 32)), m1, normal)
        neg = b.icmp_unsigned("!=", b.and_(c, k.vec(_I32, [8] * 32)), k.vec(_I32, [0] * 32))
        q = b.select(neg, b.sub(k.vec(_I32, [0] * 32), mag), mag)
        # E8M0 half: e < 2 are the subnormals 2^-128, 2^-127; else the exponent field e - 1
        e = b.zext(b.load(k._at(0), typ=_I8), _I32)
        sub = b.shl(ir.Constant(_I32, 0x00200000), b.and_(e, ir.Constant(_I32, 1)))
        norm = b.shl(b.sub(e, ir.Constant(_I32, 1)), ir.Constant(_I32, 23))
        d = b.bitcast(b.select(b.icmp_unsigned("<", e, ir.Constant(_I32, 2)), sub, norm), _F32)
        k.store(k.scale(q, d))
    return decoder_sig(src, dst), decoder_codegen(body)


# --- K-quant pieces: numba code walks the super-block and passes offsets, shifts and f32 scales. ---------
# Offsets qs/qh are relative to the block start so; shifts pick the nibble / bit field of each byte.


@intrinsic
def _dq_k32(typingctx, src, so, dst, do, qs, shift, scale, offset):
    """32 Q4_K weights: q = (src[so+qs+l] >> shift) & 15 for l < 32; w = scale * q - offset."""
    def body(k, qs, shift, scale, offset):
        w = k.scale(k.field(k.bytes(qs, 32), shift, 15), scale)
        k.store(k.b.fsub(w, k.splat(offset, 32)))
    return decoder_sig(src, dst, types.intp, types.intp, types.float32, types.float32), decoder_codegen(body)


@intrinsic
def _dq_k32_h(typingctx, src, so, dst, do, qs, shift, qh, qh_bit, scale, offset):
    """32 Q5_K weights: as _dq_k32, plus bit qh_bit of src[so+qh+l] as the 5th bit (value 16)."""
    def body(k, qs, shift, qh, qh_bit, scale, offset):
        high = k.b.shl(k.field(k.bytes(qh, 32), qh_bit, 1), k.vec(_I32, [4] * 32))
        q = k.b.or_(k.field(k.bytes(qs, 32), shift, 15), high)
        k.store(k.b.fsub(k.scale(q, scale), k.splat(offset, 32)))
    return decoder_sig(src, dst, types.intp, types.intp, types.intp, types.intp, types.float32,
                        types.float32), decoder_codegen(body)


@intrinsic
def _dq_q6k16(typingctx, src, so, dst, do, ql, shift, qh, qh_shift, scale):
    """16 Q6_K weights: q = ((src[so+ql+l] >> shift) & 15 | ((src[so+qh+l] >> qh_shift) & 3) << 4) - 32
    for l < 16; w = scale * q."""
    def body(k, ql, shift, qh, qh_shift, scale):
        high = k.b.shl(k.field(k.bytes(qh, 16), qh_shift, 3), k.vec(_I32, [4] * 16))
        q = k.b.or_(k.field(k.bytes(ql, 16), shift, 15), high)
        k.store(k.scale(k.b.sub(q, k.vec(_I32, [32] * 16)), scale))
    return decoder_sig(src, dst, types.intp, types.intp, types.intp, types.intp, types.float32), decoder_codegen(body)


# --- scalar bit casts for the float types ---------------------------------------------------------------


@intrinsic
def half_bits_to_f32(typingctx, bits):
    """Integer holding IEEE half bits in its low 16 bits -> float32 (exact)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = builder.trunc(args[0], _I16) if bits.bitwidth > 16 else args[0]
        return builder.fpext(builder.bitcast(v, ir.HalfType()), _F32)

    return types.float32(bits), codegen


@intrinsic
def u32_bits_to_f32(typingctx, bits):
    """Integer holding IEEE single bits in its low 32 bits -> float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = builder.trunc(args[0], _I32) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(v, _F32)

    return types.float32(bits), codegen


@njit(cache=True, inline="always")
def f16_at(src, o):
    """The little-endian f16 at byte offset o of src, as f32."""
    return half_bits_to_f32(np.uint32(src[o]) | (np.uint32(src[o + 1]) << np.uint32(8)))


# =========================================================================================================
# Row decoders: src = one row of stored blocks (row_bytes,) uint8 -> dst (cols,) f32. Layouts: reference.py
# =========================================================================================================


@njit(cache=True)
def _row_f32(src, dst):
    f = src.view(np.float32)
    # a loop: `dst[:] = f` compiles numba's formatted shape error, seconds of cold compile (docs/benchmarks.md,
    # "Measurements behind the code", dequant _row_f32)
    for c in range(dst.shape[0]):
        dst[c] = f[c]


@njit(cache=True)
def _row_f16(src, dst):
    h = src.view(np.uint16)
    for c in range(dst.shape[0]):
        dst[c] = half_bits_to_f32(h[c])


@njit(cache=True)
def _row_bf16(src, dst):
    h = src.view(np.uint16)
    for c in range(dst.shape[0]):  # bf16 = the high half of an f32
        dst[c] = u32_bits_to_f32(np.uint32(h[c]) << np.uint32(16))


@njit(cache=True)
def _row_q4_0(src, dst):
    for b in range(dst.shape[0] // 32):
        _dq_q4_0(src, b * 18, dst, b * 32)


@njit(cache=True)
def _row_q4_1(src, dst):
    for b in range(dst.shape[0] // 32):
        _dq_q4_1(src, b * 20, dst, b * 32)


@njit(cache=True)
def _row_q5_0(src, dst):
    for b in range(dst.shape[0] // 32):
        _dq_q5_0(src, b * 22, dst, b * 32)


@njit(cache=True)
def _row_q5_1(src, dst):
    for b in range(dst.shape[0] // 32):
        _dq_q5_1(src, b * 24, dst, b * 32)


@njit(cache=True)
def _row_q8_0(src, dst):
    for b in range(dst.shape[0] // 32):
        _dq_q8_0(src, b * 34, dst, b * 32)


@njit(cache=True)
def _row_mxfp4(src, dst):
    for b in range(dst.shape[0] // 32):
        _dq_mxfp4(src, b * 17, dst, b * 32)


@njit(cache=True, inline="always")
def k_scale_min(src, s, j):
    """6-bit (scale, min) of sub-block j from the 12 packed bytes at src[s:] (Q4_K/Q5_K; see reference)."""
    if j < 4:
        return np.int32(src[s + j]) & 63, np.int32(src[s + j + 4]) & 63
    sc = (np.int32(src[s + j + 4]) & 15) | ((np.int32(src[s + j - 4]) >> 6) << 4)
    m = (np.int32(src[s + j + 4]) >> 4) | ((np.int32(src[s + j]) >> 6) << 4)
    return sc, m


@njit(cache=True)
def _row_q4_k(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 144, b * 256  # f16 d | f16 dmin | scales[12] | qs[128]
        d, dmin = f16_at(src, o), f16_at(src, o + 2)
        for s in range(8):  # sub-block s: nibble s % 2 of the 32 bytes qs[32 * (s // 2):]
            sc, m = k_scale_min(src, o + 4, s)
            _dq_k32(src, o, dst, y + 32 * s, 16 + 32 * (s // 2), 4 * (s % 2),
                    d * np.float32(sc), dmin * np.float32(m))


@njit(cache=True)
def _row_q5_k(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 176, b * 256  # f16 d | f16 dmin | scales[12] | qh[32] | qs[128]
        d, dmin = f16_at(src, o), f16_at(src, o + 2)
        for s in range(8):  # as Q4_K; the 5th bit of weight l is bit s of qh[l]
            sc, m = k_scale_min(src, o + 4, s)
            _dq_k32_h(src, o, dst, y + 32 * s, 48 + 32 * (s // 2), 4 * (s % 2), 16, s,
                      d * np.float32(sc), dmin * np.float32(m))


@njit(cache=True)
def _row_q6_k(src, dst):
    for b in range(dst.shape[0] // 256):
        o, y = b * 210, b * 256  # ql[128] | qh[64] | i8 scales[16] | f16 d
        d = f16_at(src, o + 208)
        for g in range(16):  # 16-weight group g has scale g; half h, quarter qt of it, 16-lane part i
            h, qt, i = g // 8, (g // 2) % 4, g % 2
            # quarters 0..3 = low nibbles of ql[0:32], ql[32:64], then their high nibbles; qh bits 2*qt
            sc = np.float32((np.int32(src[o + 192 + g]) ^ 128) - 128)
            _dq_q6k16(src, o, dst, y + 16 * g, 64 * h + 32 * (qt % 2) + 16 * i, 4 * (qt // 2),
                      128 + 32 * h + 16 * i, 2 * qt, d * sc)


@njit(cache=True)
def dequant_row(src, code, dst):
    """Dispatch one row on the type code (one branch per row: negligible)."""
    if code == _Q4_0:
        _row_q4_0(src, dst)
    elif code == _Q4_1:
        _row_q4_1(src, dst)
    elif code == _Q5_0:
        _row_q5_0(src, dst)
    elif code == _Q5_1:
        _row_q5_1(src, dst)
    elif code == _Q8_0:
        _row_q8_0(src, dst)
    elif code == _MXFP4:
        _row_mxfp4(src, dst)
    elif code == _Q4_K:
        _row_q4_k(src, dst)
    elif code == _Q5_K:
        _row_q5_k(src, dst)
    elif code == _Q6_K:
        _row_q6_k(src, dst)
    elif code == _F16:
        _row_f16(src, dst)
    elif code == _BF16:
        _row_bf16(src, dst)
    else:  # _F32; the Python wrappers reject every other code
        _row_f32(src, dst)
