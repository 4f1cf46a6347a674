"""Integer kernels of the lattice types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) against Q8_K-style
activations (quantize.py: xqk int8, xdk f32 scale, xbk int16 sums), on kquant.py's row-dot and integer-dot
factories (the same loop, prefetching, four vectors per decoded super-block as the K-quants): rows_iq2_xxs ..
rows_iq1_m (kquant.rows_q4_k's signature) and idots_* (int8.integer_dots, tests). Like the other low-bit types they
stay out of int8.rows_into's run-time dispatch: a model compiles the lattice types it holds, and no others.

Integer algebra (llama.cpp's vec_dot_iq*_q8_K): every type's weight is w = d f ls_g q, with q a small signed integer
per weight, ls_g = 2 s_g + 1 an odd integer scale per group of 32 (IQ2_XS, IQ2_S, IQ1_M: per 16) and f a power of
two per type, so per super-block
    dot = d f dx sum_g ls_g sum(q x)_g         (integer_dots: [sum_g ls_g sum(q x)_g, 0])
  IQ2_*:   q = grid point (8, 25, 43) x sign,  f = 1/8   (d (0.5 + s) 0.25 = d (2 s + 1) / 8)
  IQ3_XXS: q = grid point (4 .. 62) x sign,    f = 1/4   (d (0.5 + s) 0.5)
  IQ3_S:   q = grid point (1 .. 15) x sign,    f = 1     (d (1 + 2 s))
  IQ1_*:   q = 8 (grid point (-1, 0, 1) + delta) = 8 g +- 1,  f = 1/8   (delta = +-1/8: exact in integers)
Each is exact in int32 (|ls q x| <= 31 x 62 x 127, 256 of them), and the float weights ggml decodes are exactly
d f ls q (every product fits f32's mantissa), so these kernels compute what the reference dequantizes.

Decoding a group of 32: its grid points are gathered from a table (a constant in the compiled code) by the 8- to
11-bit indices of the block, as eight-byte (or four-byte) words, into one register of magnitudes; the signs (7-bit
indices through ksigns, or 8 explicit bits a byte) become a register of +-1 that flips the activations (vpsign),
so the products are u8 x s8 (vpmaddubsw pairs, |pair| <= 2 x 62 x 127 < 2^15), then vpmaddwd by the group's
scale(s). IQ1's q are signed: |q| and the flipped activations (Emitter.abs_sign).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit

from engine.kernels.cpu.dequant_lattice import (IQ1_M_CODE, IQ1_S_CODE, IQ2_S_CODE, IQ2_XS_CODE, IQ2_XXS_CODE,
                                                IQ3_S_CODE, IQ3_XXS_CODE)
from engine.kernels.cpu.ir import I8, I16, I32, Emitter, V
from engine.kernels.cpu.kquant import k_idots, k_rowdot
from engine.kernels.cpu.quantize import KB_SUMS
from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType
from engine.kernels.reference_lattice import grid, ksigns

I64 = ir.IntType(64)
_V32 = V(I8, 32)


def _table_bytes(kind: str) -> bytes:
    """The grid of a type as bytes, one point after another (IQ1: 8 g, signed)."""
    g = grid(kind)
    return (g * 8).astype(np.int8).tobytes() if kind.startswith("IQ1") else g.astype(np.uint8).tobytes()


_KSIGN_MASKS = np.where((ksigns()[:, None] >> np.arange(8)) & 1, -1, 1).astype(np.int8).tobytes()  # (128, 8) +-1
_TABLES = {"ksigns": _KSIGN_MASKS, **{k: _table_bytes(k) for k in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                                                                     "IQ3_S", "IQ1_S")}}


def _table(e: Emitter, kind: str):
    """i8* to a table, a private constant of the function's module (made once per module)."""
    name = f"goinfer_lattice_{kind.lower()}"
    mod = e.b.module
    g = mod.globals.get(name)
    if g is None:
        data = _TABLES[kind]
        g = ir.GlobalVariable(mod, ir.ArrayType(I8, len(data)), name)
        g.initializer = ir.Constant(g.value_type, bytearray(data))
        g.global_constant = True
        g.linkage = "internal"
    return e.b.bitcast(g, I8.as_pointer())


def _u(e: Emitter, wp, off, ty=I8):
    """The unsigned scalar at byte off, as i64."""
    return e.b.zext(e.ld(wp, off, ty), I64)


def _field(e: Emitter, v, shift: int, mask: int):
    return e.b.and_(e.b.lshr(v, ir.Constant(I64, shift)) if shift else v, ir.Constant(I64, mask))


def _or_high(e: Emitter, low, high, shift: int = 8):
    return e.b.or_(low, e.b.shl(high, ir.Constant(I64, shift)))


def _points(e: Emitter, kind: str, idxs):
    """<32 x i8>: the grid points idxs (8 of 4 bytes, or 4 of 8), side by side."""
    ty = I32 if len(idxs) == 8 else I64
    tab = _table(e, kind)
    return e.b.bitcast(e.gather(tab, [e.mul(i, ty.width // 8) for i in idxs], ty), _V32)


def _ksigns(e: Emitter, sidxs):
    """<32 x i8> +-1 of four 7-bit sign indices (ksigns: the eighth sign makes an even count of minus signs)."""
    return _points(e, "ksigns", sidxs)


def _sign_bits(e: Emitter, wp, off):
    """<32 x i8> +-1 of the 32 sign bits in the 4 bytes at off (bit j of byte l: weight 8 l + j negative)."""
    b = e.b
    rep = e.shuf(e.ld(wp, off, V(I8, 4)), None, [j // 8 for j in range(32)])
    neg = b.icmp_unsigned("!=", b.and_(rep, e.vc(I8, [1 << (j % 8) for j in range(32)])), ir.Constant(_V32, None))
    return b.select(neg, e.splat_c(I8, -1, 32), e.splat_c(I8, 1, 32))


def _odd(e: Emitter, s):
    """2 s + 1 (the group scale ls)."""
    return e.b.add(e.b.shl(s, ir.Constant(I64, 1)), ir.Constant(I64, 1))


def _scales16(e: Emitter, lo, hi):
    """<16 x i16>: the pair sums' scales, ls of the group's first 16 weights (lo) then of its last 16 (hi)."""
    b = e.b
    v = ir.Constant(V(I16, 2), None)
    v = b.insert_element(v, b.trunc(lo, I16), ir.Constant(I32, 0))
    v = b.insert_element(v, b.trunc(hi, I16), ir.Constant(I32, 1))
    return e.shuf(v, None, [0] * 8 + [1] * 8)


def _nibble_scales(e: Emitter, wp, off):
    """A byte of two 4-bit scales (low: the first 16 weights) as _scales16."""
    s = _u(e, wp, off)
    return _scales16(e, _odd(e, _field(e, s, 0, 15)), _odd(e, _field(e, s, 4, 15)))


# --- one group of 32 per type: (q magnitudes or signed q, +-1 signs or None, scales) --------------------------------


def _iq2_xxs(e, wp, o, g):
    # f16 d | per group: 4 index bytes, u32 of four 7-bit sign indices and the scale (bits 28-31)
    s = _u(e, wp, e.add(o, 6 + 8 * g), I32)
    ls = _odd(e, _field(e, s, 28, 15))
    q = _points(e, "IQ2_XXS", [_u(e, wp, e.add(o, 2 + 8 * g + k)) for k in range(4)])
    return q, _ksigns(e, [_field(e, s, 7 * k, 127) for k in range(4)]), _scales16(e, ls, ls)


def _iq2_xs(e, wp, o, g):
    # f16 d | u16 qs[32] (9-bit index, 7-bit sign index) | scales[8]
    qs = [_u(e, wp, e.add(o, 2 + 8 * g + 2 * k), I16) for k in range(4)]
    q = _points(e, "IQ2_XS", [_field(e, v, 0, 511) for v in qs])
    return q, _ksigns(e, [_field(e, v, 9, 127) for v in qs]), _nibble_scales(e, wp, e.add(o, 66 + g))


def _iq2_s(e, wp, o, g):
    # f16 d | qs[32] | signs[32] | qh[8] | scales[8]: index qs[4g + k] | bits 2k, 2k+1 of qh[g] << 8
    qh = _u(e, wp, e.add(o, 66 + g))
    q = _points(e, "IQ2_S", [_or_high(e, _u(e, wp, e.add(o, 2 + 4 * g + k)), _field(e, qh, 2 * k, 3))
                             for k in range(4)])
    return q, _sign_bits(e, wp, e.add(o, 34 + 4 * g)), _nibble_scales(e, wp, e.add(o, 74 + g))


def _iq3_xxs(e, wp, o, g):
    # f16 d | qs[64] (indices of 4-weight points) | u32 per group: four 7-bit sign indices and the scale
    s = _u(e, wp, e.add(o, 66 + 4 * g), I32)
    ls = _odd(e, _field(e, s, 28, 15))
    q = _points(e, "IQ3_XXS", [_u(e, wp, e.add(o, 2 + 8 * g + k)) for k in range(8)])
    return q, _ksigns(e, [_field(e, s, 7 * k, 127) for k in range(4)]), _scales16(e, ls, ls)


def _iq3_s(e, wp, o, g):
    # f16 d | qs[64] | qh[8] (bit k of qh[g]: bit 8 of point k's index) | signs[32] | scales[4] (nibbles)
    qh = _u(e, wp, e.add(o, 66 + g))
    q = _points(e, "IQ3_S", [_or_high(e, _u(e, wp, e.add(o, 2 + 8 * g + k)), _field(e, qh, k, 1))
                             for k in range(8)])
    ls = _odd(e, _field(e, _u(e, wp, e.add(o, 106 + g // 2)), 4 * (g % 2), 15))
    return q, _sign_bits(e, wp, e.add(o, 74 + 4 * g)), _scales16(e, ls, ls)


def _deltas(e: Emitter, signs):
    """<32 x i8>: +1, or -1 where signs[k] (i64 0/1) is set, for weights 8k .. 8k + 7 (k = 0..3; one sign: all)."""
    b = e.b
    v = ir.Constant(V(I8, len(signs)), None)
    for k, s in enumerate(signs):
        v = b.insert_element(v, b.trunc(b.sub(ir.Constant(I64, 1), b.shl(s, ir.Constant(I64, 1))), I8),
                             ir.Constant(I32, k))
    return e.shuf(v, None, [j * len(signs) // 32 for j in range(32)])


def _iq1_s(e, wp, o, g):
    # f16 d | qs[32] | u16 qh[8]: bits 3k..3k+2 extend point k's index, 12-14 the scale, 15 the delta's sign
    qh = _u(e, wp, e.add(o, 34 + 2 * g), I16)
    pts = _points(e, "IQ1_S", [_or_high(e, _u(e, wp, e.add(o, 2 + 4 * g + k)), _field(e, qh, 3 * k, 7))
                               for k in range(4)])
    ls = _odd(e, _field(e, qh, 12, 7))
    return e.b.add(pts, _deltas(e, [_field(e, qh, 15, 1)])), None, _scales16(e, ls, ls)


def _iq1_m(e, wp, o, g):
    # qs[32] | qh[16] (a nibble per point: index bits 8-10, delta sign) | u16 scales[4] (3 bits per 16 weights, d in
    # the top nibbles)
    nib = [_field(e, _u(e, wp, e.add(o, 32 + 2 * g + k // 2)), 4 * (k % 2), 15) for k in range(4)]
    pts = _points(e, "IQ1_S", [_or_high(e, _u(e, wp, e.add(o, 4 * g + k)), _field(e, n, 0, 7))
                               for k, n in enumerate(nib)])
    sc = _u(e, wp, e.add(o, 48 + 2 * (g // 2)), I16)
    lo, hi = (_odd(e, _field(e, sc, 3 * (2 * (g % 2) + h), 7)) for h in range(2))
    return e.b.add(pts, _deltas(e, [_field(e, n, 3, 1) for n in nib])), None, _scales16(e, lo, hi)


def _iq1_m_d(e: Emitter, wp, o):
    """IQ1_M's f16 d: the top nibbles of its four scale words (low nibble first), as <1 x float>."""
    b = e.b
    w = [_u(e, wp, e.add(o, 48 + 2 * i), I16) for i in range(4)]
    bits = b.or_(b.or_(_field(e, w[0], 12, 0xF), b.and_(b.lshr(w[1], ir.Constant(I64, 8)), ir.Constant(I64, 0xF0))),
                 b.or_(b.and_(b.lshr(w[2], ir.Constant(I64, 4)), ir.Constant(I64, 0xF00)),
                       b.and_(w[3], ir.Constant(I64, 0xF000))))
    return e.halves(b.insert_element(ir.Constant(V(I16, 1), None), b.trunc(bits, I16), ir.Constant(I32, 0)))


# code -> (group decoder, f)
_TYPES = {IQ2_XXS_CODE: (_iq2_xxs, 0.125), IQ2_XS_CODE: (_iq2_xs, 0.125), IQ2_S_CODE: (_iq2_s, 0.125),
          IQ3_XXS_CODE: (_iq3_xxs, 0.25), IQ3_S_CODE: (_iq3_s, 1.0), IQ1_S_CODE: (_iq1_s, 0.125),
          IQ1_M_CODE: (_iq1_m, 0.125)}


def _body(code: int):
    """The super-block body of a lattice type for kquant.k_rowdot / k_idots: <1 x float> d f and, per vector,
    (<8 x i32> summing to sum_g ls_g sum(q x)_g, None)."""
    group, f = _TYPES[code]

    def body(e: Emitter, wp, o, xs_at, bsums):
        b = e.b
        isums = [None] * len(bsums)
        for g in range(8):
            q, signs, sc = group(e, wp, o, g)
            for v in range(len(bsums)):
                x = xs_at(v, g)
                if signs is None:  # signed q (IQ1)
                    u, x = e.abs_sign(q, x)
                else:
                    u = q
                    x = e.call("llvm.x86.avx2.psign.b", _V32, [x, signs]) if e.tier != "generic" else b.mul(x, signs)
                part = e.madd_i16(e.madd_u8s8(u, x), sc)
                isums[v] = part if isums[v] is None else b.add(isums[v], part)
        dw = _iq1_m_d(e, wp, o) if code == IQ1_M_CODE else e.halves(e.ld(wp, o, V(I16, 1)))
        if f != 1.0:
            dw = b.fmul(dw, ir.Constant(dw.type, [f]))
        return dw, [(isum, None) for isum in isums]

    return body


def _kernels(code: int):
    name, bb = GGMLType(code).name.lower(), BLOCK_GEOMETRY[GGMLType(code)][1]
    return (*(k_rowdot(name, bb, _body(code), n) for n in (1, 2, 4)), k_idots(name, bb, _body(code)))


_rd1_iq2_xxs, _rd2_iq2_xxs, _rd4_iq2_xxs, idots_iq2_xxs = _kernels(IQ2_XXS_CODE)
_rd1_iq2_xs, _rd2_iq2_xs, _rd4_iq2_xs, idots_iq2_xs = _kernels(IQ2_XS_CODE)
_rd1_iq2_s, _rd2_iq2_s, _rd4_iq2_s, idots_iq2_s = _kernels(IQ2_S_CODE)
_rd1_iq3_xxs, _rd2_iq3_xxs, _rd4_iq3_xxs, idots_iq3_xxs = _kernels(IQ3_XXS_CODE)
_rd1_iq3_s, _rd2_iq3_s, _rd4_iq3_s, idots_iq3_s = _kernels(IQ3_S_CODE)
_rd1_iq1_s, _rd2_iq1_s, _rd4_iq1_s, idots_iq1_s = _kernels(IQ1_S_CODE)
_rd1_iq1_m, _rd2_iq1_m, _rd4_iq1_m, idots_iq1_m = _kernels(IQ1_M_CODE)


# =========================================================================================================
# Row functions: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================

# One function per type, as kquant.py's (closures would never hit numba's cache); vectors four, two, then one at a
# time, each vector's result bit for bit its result alone.


@njit(cache=True)
def rows_iq2_xxs(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_iq2_xxs(raw, ro, nsb, xq, xd, xb,
                                                                                        m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_iq2_xxs(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_iq2_xxs(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_iq2_xs(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_iq2_xs(raw, ro, nsb, xq, xd, xb,
                                                                                       m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_iq2_xs(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_iq2_xs(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_iq2_s(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_iq2_s(raw, ro, nsb, xq, xd, xb,
                                                                                      m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_iq2_s(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_iq2_s(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_iq3_xxs(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_iq3_xxs(raw, ro, nsb, xq, xd, xb,
                                                                                        m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_iq3_xxs(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_iq3_xxs(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_iq3_s(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_iq3_s(raw, ro, nsb, xq, xd, xb,
                                                                                      m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_iq3_s(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_iq3_s(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_iq1_s(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_iq1_s(raw, ro, nsb, xq, xd, xb,
                                                                                      m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_iq1_s(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_iq1_s(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_iq1_m(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_iq1_m(raw, ro, nsb, xq, xd, xb,
                                                                                      m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_iq1_m(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_iq1_m(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def integer_dots(code, raw, xqk, xbk, out, tier):
    """int8.integer_dots of lattice weights (tests): out (M, rows, 2 K/256) int32, [sum_g ls_g sum(q x)_g, 0] per
    super-block. Compiles every lattice type (tests only)."""
    rb, nsb = raw.shape[1], xqk.shape[1] // 256
    for r in range(raw.shape[0]):
        for m in range(out.shape[0]):
            args = (raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, m * nsb * KB_SUMS, out,
                    (m * out.shape[1] + r) * out.shape[2], tier)
            if code == IQ2_XXS_CODE:
                idots_iq2_xxs(*args)
            elif code == IQ2_XS_CODE:
                idots_iq2_xs(*args)
            elif code == IQ2_S_CODE:
                idots_iq2_s(*args)
            elif code == IQ3_XXS_CODE:
                idots_iq3_xxs(*args)
            elif code == IQ3_S_CODE:
                idots_iq3_s(*args)
            elif code == IQ1_S_CODE:
                idots_iq1_s(*args)
            else:
                idots_iq1_m(*args)
