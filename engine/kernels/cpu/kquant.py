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


def _k_isums(e: Emitter, code, wp, o, xs_at, bsums):
    """One super-block at byte o against n vectors of Q8_K activations, its weights decoded once for all of them:
    xs_at(v, j) loads vector v's 32 int8 activations j (0..7), bsums[v](off, ty) its block sums at byte off.
    Per vector (<8 x i32> summing to the scaled integer dot, <4 x i32> summing to the min term, or None)."""
    b = e.b
    n = len(bsums)
    if code == Q6_K_CODE:
        sc = b.sext(e.ld(wp, e.add(o, 192), V(I8, 16)), V(I16, 16))
        m32 = e.splat_c(I32, -32, 8)
        isums = [b.mul(e.madd_i16(sc, bsums[v](16, V(I16, 16))), m32) for v in range(n)]  # every weight's -32
        for h in range(2):
            ql0, ql1 = e.ld(wp, e.add(o, 64 * h), V(I8, 32)), e.ld(wp, e.add(o, 64 * h + 32), V(I8, 32))
            qh = e.ld(wp, e.add(o, 128 + 32 * h), V(I8, 32))
            three = e.splat_c(I8, 3, 32)
            for t, (ql, lo_nib) in enumerate(((ql0, True), (ql1, True), (ql0, False), (ql1, False))):
                low = e.nib_lo(ql) if lo_nib else e.nib_hi(ql)
                high = b.and_(b.lshr(qh, e.splat_c(I8, 2 * t, 32)), three) if t else b.and_(qh, three)
                q = b.or_(low, b.shl(high, e.splat_c(I8, 4, 32)))
                g = 8 * h + 2 * t  # scales of weights 0-15 and 16-31 of this 32
                gsc = e.shuf(sc, None, [g] * 8 + [g + 1] * 8)
                for v in range(n):
                    isums[v] = b.add(isums[v], e.madd_i16(e.madd_u8s8(q, xs_at(v, 4 * h + t)), gsc))
        return [(isum, None) for isum in isums]
    scm = _k4_scales(e, wp, o)
    msc = e.shuf(scm, None, range(8, 16))
    mins = [e.madd_i16(msc, bsums[v](0, V(I16, 8))) for v in range(n)]  # m_s * bsum32_s
    qs = 16 if code == Q4_K_CODE else 48
    qh = e.ld(wp, e.add(o, 16), V(I8, 32)) if code == Q5_K_CODE else None
    isums = [None] * n
    for c in range(4):  # 64-weight chunk c: low nibbles = sub-block 2c, high nibbles = 2c + 1
        q = e.ld(wp, e.add(o, qs + 32 * c), V(I8, 32))
        for s, u in ((2 * c, e.nib_lo(q)), (2 * c + 1, e.nib_hi(q))):
            if qh is not None:  # the fifth bit of weight l of sub-block s is bit s of qh[l]
                bit = b.and_(b.lshr(qh, e.splat_c(I8, s, 32)), e.splat_c(I8, 1, 32))
                u = b.or_(u, b.shl(bit, e.splat_c(I8, 4, 32)))
            ssc = e.shuf(scm, None, [s] * 16)
            for v in range(n):
                part = e.madd_i16(e.madd_u8s8(u, xs_at(v, s)), ssc)
                isums[v] = part if isums[v] is None else b.add(isums[v], part)
    return list(zip(isums, mins))


def _k_body(code):
    """The decode body of Q4_K, Q5_K or Q6_K for k_rowdot / k_idots."""

    def body(e: Emitter, wp, o, xs_at, bsums):
        if code == Q6_K_CODE:
            dw = e.halves(e.ld(wp, e.add(o, 208), V(I16, 1)))
        else:  # f16 d, f16 dmin at o
            dw = e.halves(e.ld(wp, o, V(I16, 2)))
        return dw, _k_isums(e, code, wp, o, xs_at, bsums)

    return body


def k_rowdot(name: str, bb: int, body, n: int, min_lanes: int = 4, lanes=lambda tier: 8):
    """Intrinsic (raw, roff, nsb, xq, xd, xb, m, tier) -> n float32 (a float for n = 1, else a tuple): one row of
    nsb super-blocks of bb bytes at byte roff of raw against activation vectors m .. m + n - 1 (rows of xq (M, K),
    their scales xd (M, K/256) and sums xb (M, K/256, 24)). body(e, wp, o, xs_at, bsums) decodes the super-block at
    byte o once for the n vectors (xs_at(v, j, n=32): vector v's n int8 activations from 32 j; bsums[v](off, ty):
    its block sums at byte off) and returns (<1 x float> [d] or <2 x float> [d, dmin], per vector (<lanes(tier) x i32>
    summing to the scaled integer dot, <min_lanes x i32> summing to the min term, or None)); the float steps stay per
    vector:
    sum over super-blocks of d dx isum - dmin dx mins. Shared by every K super-block type (kquant_low.py too).
    n = 4 ran a vector faster than n = 1, a little for Q4_K and most for Q5_K and Q6_K (docs/benchmarks.md,
    "Measurements behind the code", kquant four vectors)."""

    def impl(typingctx, raw, roff, nsb, xq, xd, xb, m, tier):
        t = tier_of(tier)
        if not (is_arr(raw, types.uint8) and is_arr(xq, types.int8) and is_arr(xd, types.float32)
                and is_arr(xb, types.int16) and t):
            return None
        ret = types.float32 if n == 1 else types.UniTuple(types.float32, n)
        sig = ret(raw, types.intp, types.intp, xq, xd, xb, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, t)
            b = builder
            at = signature.args
            r, ro, ns, x, d, xb_, m, _ = args
            wp = b.gep(e.base(at[0], r), [ro], source_etype=I8)
            vecs = [e.add(m, v) for v in range(n)]
            xps = [b.gep(e.base(at[3], x), [e.mul(e.mul(vm, ns), QK_K)], source_etype=I8) for vm in vecs]
            dps = [b.gep(e.base(at[4], d), [e.mul(e.mul(vm, ns), 4)], source_etype=I8) for vm in vecs]
            bps = [b.gep(e.base(at[5], xb_), [e.mul(e.mul(vm, ns), 2 * KB_SUMS)], source_etype=I8) for vm in vecs]
            nl = lanes(t)
            accs = [(e.fvar(nl), e.fvar(min_lanes)) for _ in range(n)]
            has_min = False
            with e.loop(ns) as lp:
                i = lp.index
                o = e.mul(i, bb)
                for line in range(0, bb, 64):
                    e.prefetch(wp, e.add(o, PREFETCH_BYTES + line))
                xo, bo = e.mul(i, QK_K), e.mul(i, 2 * KB_SUMS)
                xs_at = lambda v, j, n=32: e.ld(xps[v], e.add(xo, 32 * j), V(I8, n))  # noqa: E731
                bsums = [lambda off, ty, v=v: e.ld(bps[v], e.add(bo, off), ty) for v in range(n)]
                dw, sums = body(e, wp, o, xs_at, bsums)
                for v, (isum, mins) in enumerate(sums):
                    acc, accm = accs[v]
                    dx = e.ld(dps[v], e.mul(i, 4), FLT, align=4)
                    dd = b.fmul(dw, e.splat(dx, dw.type.count))
                    e.fmacc(acc, b.sitofp(isum, V(FLT, nl)), e.shuf(dd, None, [0] * nl))
                    if mins is not None:
                        has_min = True
                        e.fmacc(accm, b.sitofp(mins, V(FLT, min_lanes)), e.shuf(dd, None, [1] * min_lanes))
            res = []
            for acc, accm in accs:
                r_ = e.hsum_f(b.load(acc))
                res.append(b.fsub(r_, e.hsum_f(b.load(accm))) if has_min else r_)
            return res[0] if n == 1 else context.make_tuple(b, signature.return_type, res)

        return sig, codegen

    impl.__name__ = f"_rowdot{n}_{name}"
    return intrinsic(impl)


def k_idots(name: str, bb: int, body):
    """Intrinsic (raw, roff, nsb, xq, xoff, xb, boff, out, ooff, tier) -> None: per super-block (bb bytes, decoded
    by body as for k_rowdot) the integer dot (sum of scale * quant dot) and the integer min term into
    out[ooff + 2 i], out[ooff + 2 i + 1] (0 where body has none)."""

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
                xo, bo = e.mul(i, QK_K), e.mul(i, 2 * KB_SUMS)
                xs_at = lambda v, j, n=32: e.ld(xp, e.add(xo, 32 * j), V(I8, n))  # noqa: E731
                bsums = [lambda off, ty: e.ld(bp, e.add(bo, off), ty)]
                _, [(isum, mins)] = body(e, wp, e.mul(i, bb), xs_at, bsums)
                e.st(op, e.mul(i, 8), e.hsum_i(isum))
                e.st(op, e.add(e.mul(i, 8), 4), ir.Constant(I32, 0) if mins is None else e.hsum_i(mins))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_idots_{name}"
    return intrinsic(impl)


_K3 = [(type_name(c).lower(), _KBB[c], _k_body(c)) for c in (Q4_K_CODE, Q5_K_CODE, Q6_K_CODE)]
_rd1_q4_k, _rd1_q5_k, _rd1_q6_k = (k_rowdot(nm, bb, body, 1) for nm, bb, body in _K3)
_rd2_q4_k, _rd2_q5_k, _rd2_q6_k = (k_rowdot(nm, bb, body, 2) for nm, bb, body in _K3)
_rd4_q4_k, _rd4_q5_k, _rd4_q6_k = (k_rowdot(nm, bb, body, 4) for nm, bb, body in _K3)
idots_q4_k, idots_q5_k, idots_q6_k = (k_idots(nm, bb, body) for nm, bb, body in _K3)


# =========================================================================================================
# Row functions: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================

# One function per type, not a factory (see legacy.py): closures would never hit numba's cache. Each row meets the
# vectors four at a time (then two, then one): a prompt's short tiles, a MoE expert's tokens and batched decode
# all run M > 1, and the weights' unpacking is then shared. The results are those of one vector at a time, bit
# for bit (the same integer sums and the same float operations per vector).


@njit(cache=True)
def rows_q4_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_q4_k(raw, ro, nsb, xq, xd, xb, m,
                                                                                     tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_q4_k(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_q4_k(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_q5_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_q5_k(raw, ro, nsb, xq, xd, xb, m,
                                                                                     tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_q5_k(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_q5_k(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_q6_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_q6_k(raw, ro, nsb, xq, xd, xb, m,
                                                                                     tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_q6_k(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_q6_k(raw, ro, nsb, xq, xd, xb, m, tier)
