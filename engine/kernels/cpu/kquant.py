"""Integer kernels of the K-quant super-blocks of 256 (Q4_K, Q5_K, Q6_K) against Q8_K-style activations
(quantize.py: xqk int8, xdk f32 scale, xbk int16 sums per super-block): LLVM-IR intrinsics for the row dot
products and the per-super-block integer dots (idots_*, the same IR: int8.integer_dots, tests), and the njit row
functions rows_q4_k .. rows_q6_k that int8.rows_into dispatches to.

Integer algebra per super-block (u = stored unsigned quant, x = int8 activation, exact in int32):
  Q4_K/Q5_K: d*dx*sum_s sc_s sum(u x) - dmin*dx*sum_s m_s bsum32_s
  Q6_K: d*dx*sum_g sc_g (sum(u x) - 32 bsum16_g)
Each row loop prefetches PREFETCH_BYTES ahead.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from engine.kernels.cpu.ir import (FLT, I8, I16, I32, PREFETCH_BYTES, Q4_K_CODE, Q5_K_CODE, Q6_K_CODE, Emitter, V,
                                   is_arr, tier_of)
from engine.kernels.cpu.quantize import KB_SUMS, QK_K
from engine.kernels.quant_types import type_name

# =========================================================================================================
# K-quant super-blocks (Q4_K, Q5_K, Q6_K) against Q8_K-style activations
# =========================================================================================================

_KBB = {Q4_K_CODE: 144, Q5_K_CODE: 176, Q6_K_CODE: 210}


def _k4_scales(e: Emitter, wp, o) -> ir.Value:
    """Q4_K/Q5_K packed 6-bit scales at o+4 -> <16 x i16> [sc0..sc7, m0..m7] (reference.k_scale_min)."""
    b = e.b
    b0, b1, b2 = (e.ld(wp, e.add(o, 4 + 4 * j), I32) for j in range(3))
    c = lambda v: ir.Constant(I32, v)  # noqa: E731
    sc_lo, m_lo = b.and_(b0, c(0x3F3F3F3F)), b.and_(b1, c(0x3F3F3F3F))
    sc_hi = b.or_(b.and_(b2, c(0x0F0F0F0F)), b.and_(b.lshr(b0, c(2)), c(0x30303030)))
    m_hi = b.or_(b.and_(b.lshr(b2, c(4)), c(0x0F0F0F0F)), b.and_(b.lshr(b1, c(2)), c(0x30303030)))
    v = ir.Constant(V(I32, 4), None)
    for j, w in enumerate((sc_lo, sc_hi, m_lo, m_hi)):
        v = b.insert_element(v, w, ir.Constant(I32, j))
    return b.zext(b.bitcast(v, V(I8, 16)), V(I16, 16))


def _k_isums(e: Emitter, code, wp, o, xp, xo, bp, bo):
    """One super-block at byte o against Q8_K activations at xo (sums at byte bo of bp):
    (<8 x i32> summing to the scaled integer dot, <4 x i32> summing to the min term, or None)."""
    b = e.b
    xs = [e.ld(xp, e.add(xo, 32 * j), V(I8, 32)) for j in range(8)]
    if code == Q6_K_CODE:
        sc = b.sext(e.ld(wp, e.add(o, 192), V(I8, 16)), V(I16, 16))
        bs16 = e.ld(bp, e.add(bo, 16), V(I16, 16))  # the 16 sums over 16 weights
        isum = b.mul(e.madd_i16(sc, bs16), e.splat_c(I32, -32, 8))  # the -32 offset of every weight
        for h in range(2):
            ql0, ql1 = e.ld(wp, e.add(o, 64 * h), V(I8, 32)), e.ld(wp, e.add(o, 64 * h + 32), V(I8, 32))
            qh = e.ld(wp, e.add(o, 128 + 32 * h), V(I8, 32))
            three = e.splat_c(I8, 3, 32)
            for t, (ql, lo_nib) in enumerate(((ql0, True), (ql1, True), (ql0, False), (ql1, False))):
                low = e.nib_lo(ql) if lo_nib else e.nib_hi(ql)
                high = b.and_(b.lshr(qh, e.splat_c(I8, 2 * t, 32)), three) if t else b.and_(qh, three)
                q = b.or_(low, b.shl(high, e.splat_c(I8, 4, 32)))
                g = 8 * h + 2 * t  # scales of weights 0-15 and 16-31 of this 32
                p = e.madd_u8s8(q, xs[4 * h + t])
                isum = b.add(isum, e.madd_i16(p, e.shuf(sc, None, [g] * 8 + [g + 1] * 8)))
        return isum, None
    scm = _k4_scales(e, wp, o)
    mins = e.madd_i16(e.shuf(scm, None, range(8, 16)), e.ld(bp, bo, V(I16, 8)))  # m_s * bsum32_s
    qs = 16 if code == Q4_K_CODE else 48
    qh = e.ld(wp, e.add(o, 16), V(I8, 32)) if code == Q5_K_CODE else None
    isum = None
    for c in range(4):  # 64-weight chunk c: low nibbles = sub-block 2c, high nibbles = 2c + 1
        q = e.ld(wp, e.add(o, qs + 32 * c), V(I8, 32))
        for s, v in ((2 * c, e.nib_lo(q)), (2 * c + 1, e.nib_hi(q))):
            if qh is not None:  # the fifth bit of weight l of sub-block s is bit s of qh[l]
                bit = b.and_(b.lshr(qh, e.splat_c(I8, s, 32)), e.splat_c(I8, 1, 32))
                v = b.or_(v, b.shl(bit, e.splat_c(I8, 4, 32)))
            part = e.madd_i16(e.madd_u8s8(v, xs[s]), e.shuf(scm, None, [s] * 16))
            isum = part if isum is None else b.add(isum, part)
    return isum, mins


def _k_rowdot(code):
    """Intrinsic (raw, roff, nsb, xq, xoff, xd, doff, xb, boff, tier) -> float32 for one row of nsb super-blocks
    (doff: f32 element offset into xd; boff: int16 element offset into xb)."""
    bb = _KBB[code]

    def impl(typingctx, raw, roff, nsb, xq, xoff, xd, doff, xb, boff, tier):
        t = tier_of(tier)
        if not (is_arr(raw, types.uint8) and is_arr(xq, types.int8) and is_arr(xd, types.float32)
                and is_arr(xb, types.int16) and t):
            return None
        sig = types.float32(raw, types.intp, types.intp, xq, types.intp, xd, types.intp, xb, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, t)
            b = builder
            at = signature.args
            r, ro, n, x, xo, d, do, xb_, bo, _ = args
            wp = b.gep(e.base(at[0], r), [ro], source_etype=I8)
            xp = b.gep(e.base(at[3], x), [xo], source_etype=I8)
            dp = b.gep(e.base(at[5], d), [e.mul(do, 4)], source_etype=I8)
            bp = b.gep(e.base(at[7], xb_), [e.mul(bo, 2)], source_etype=I8)
            acc, accm = e.fvar(8), e.fvar(4)
            with e.loop(n) as lp:
                i = lp.index
                o = e.mul(i, bb)
                for line in range(0, bb, 64):
                    e.prefetch(wp, e.add(o, PREFETCH_BYTES + line))
                isum, mins = _k_isums(e, code, wp, o, xp, e.mul(i, QK_K), bp, e.mul(i, 2 * KB_SUMS))
                dx = e.ld(dp, e.mul(i, 4), FLT, align=4)
                if code == Q6_K_CODE:
                    dd = b.fmul(e.halves(e.ld(wp, e.add(o, 208), V(I16, 1))), e.splat(dx, 1))
                    e.fmacc(acc, b.sitofp(isum, V(FLT, 8)), e.shuf(dd, None, [0] * 8))
                else:  # f16 d, f16 dmin at o
                    dd = b.fmul(e.halves(e.ld(wp, o, V(I16, 2))), e.splat(dx, 2))
                    e.fmacc(acc, b.sitofp(isum, V(FLT, 8)), e.shuf(dd, None, [0] * 8))
                    e.fmacc(accm, b.sitofp(mins, V(FLT, 4)), e.shuf(dd, None, [1] * 4))
            res = e.hsum_f(b.load(acc))
            if code != Q6_K_CODE:
                res = b.fsub(res, e.hsum_f(b.load(accm)))
            return res

        return sig, codegen

    impl.__name__ = f"_rowdot_{type_name(code).lower()}"
    return intrinsic(impl)


def _k_idots(code):
    """Intrinsic (raw, roff, nsb, xq, xoff, xb, boff, out, ooff, tier) -> None: per super-block the integer
    dot (sum of scale * quant dot) and the integer min term into out[ooff + 2 i], out[ooff + 2 i + 1]."""
    bb = _KBB[code]

    def impl(typingctx, raw, roff, nsb, xq, xoff, xb, boff, out, ooff, tier):
        t = tier_of(tier)
        if not (is_arr(raw, types.uint8) and is_arr(xq, types.int8) and is_arr(xb, types.int16)
                and is_arr(out, types.int32) and t):
            return None
        sig = types.none(raw, types.intp, types.intp, xq, types.intp, xb, types.intp, out, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, t)
            b = builder
            at = signature.args
            r, ro, n, x, xo, xb_, bo, out_, oo, _ = args
            wp = b.gep(e.base(at[0], r), [ro], source_etype=I8)
            xp = b.gep(e.base(at[3], x), [xo], source_etype=I8)
            bp = b.gep(e.base(at[5], xb_), [e.mul(bo, 2)], source_etype=I8)
            op = b.gep(e.base(at[7], out_), [e.mul(oo, 4)], source_etype=I8)
            with e.loop(n) as lp:
                i = lp.index
                isum, mins = _k_isums(e, code, wp, e.mul(i, bb), xp, e.mul(i, QK_K), bp, e.mul(i, 2 * KB_SUMS))
                e.st(op, e.mul(i, 8), e.hsum_i(isum))
                e.st(op, e.add(e.mul(i, 8), 4), ir.Constant(I32, 0) if mins is None else e.hsum_i(mins))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_idots_{type_name(code).lower()}"
    return intrinsic(impl)


_rd_q4_k, _rd_q5_k, _rd_q6_k = (_k_rowdot(c) for c in (Q4_K_CODE, Q5_K_CODE, Q6_K_CODE))
idots_q4_k, idots_q5_k, idots_q6_k = (_k_idots(c) for c in (Q4_K_CODE, Q5_K_CODE, Q6_K_CODE))


# =========================================================================================================
# Row functions: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================

# One function per type, not a factory (see legacy.py): closures would never hit numba's cache.


@njit(cache=True)
def rows_q4_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    K = xq.shape[1]
    nsb = K // 256
    for r in range(r0, r1):
        for m in range(out.shape[0]):
            out[m, c0 + r] = _rd_q4_k(raw, base + r * rb, nsb, xq, m * K, xd, m * nsb, xb, m * nsb * 24, tier)


@njit(cache=True)
def rows_q5_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    K = xq.shape[1]
    nsb = K // 256
    for r in range(r0, r1):
        for m in range(out.shape[0]):
            out[m, c0 + r] = _rd_q5_k(raw, base + r * rb, nsb, xq, m * K, xd, m * nsb, xb, m * nsb * 24, tier)


@njit(cache=True)
def rows_q6_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    K = xq.shape[1]
    nsb = K // 256
    for r in range(r0, r1):
        for m in range(out.shape[0]):
            out[m, c0 + r] = _rd_q6_k(raw, base + r * rb, nsb, xq, m * K, xd, m * nsb, xb, m * nsb * 24, tier)


