"""Integer kernels of the legacy 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and MXFP4 and IQ4_NL, which have
their shape) against Q8_0-style activations (quantize.py: xq8 int8 in pair-interleaved order, xs8 [dx, xsum] per
block): LLVM-IR intrinsics for the row dot products and the per-block integer dots (idots_*, the same IR:
int8.integer_dots, tests), and the njit row functions rows_q4_0 .. rows_mxfp4 that int8.rows_into dispatches to.

Integer algebra per block (u = stored unsigned quant, x = int8 activation, exact in int32):
  Q4_0: d*dx*sum(u x) - 8 d*xsum      Q4_1: d*dx*sum(u x) + m*xsum     Q8_0: d*dx*sum(q x)
  Q5_0: d*dx*sum(u x) - 16 d*xsum     Q5_1: d*dx*sum(u x) + m*xsum
  MXFP4: d*dx*sum(u x) - 12 d*xsum, u = the E2M1 code's doubled value + 12 (0..24, one vpshufb of the nibbles),
         d = 2^(e-128) (the doubled values' 1/2 folded in). The +12 keeps u unsigned for vpmaddubsw/vpdpbusd,
         as Q4_0's stored nibble is; the offset comes back through xsum like Q4_0's -8. The blocks are summed
         with 4d = 2^(e-126) (the exponent field e + 1: two integer ops, where the exact 2^(e-128) with its two
         subnormals takes six and cost 13 % of the kernel) and the row's sum is multiplied by 1/4 (exact).
         That is 2^(e-128) exactly for e <= 253, subnormal scales included; ggml's quantizer never writes
         more (its e <= 252 for any finite weight). e = 254 and 255 come out as inf and -0.
  IQ4_NL: d*dx*sum(v x), v = the nibble's signed level (kvalues_iq4nl, -127..113, one vpshufb). vnni:
         d*dx*sum(u x) - 128 d*xsum with u = v + 128 (1..241; vpdpbusd adds in i32, so no sign trick), as Q4_0;
         other tiers: Q8_0's signed product (|v| against x with v's sign: u = 241 would saturate vpmaddubsw).
         integer_dots gives sum(v x) on every tier. Its row functions are iquant.py's.
Blocks are read in pairs whose activations are stored with their halves interleaved, so one 32-byte load of two
blocks' nibbles meets its activations in one register; each row loop prefetches PREFETCH_BYTES ahead.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from engine.kernels.cpu.ir import (FLT, I8, I16, I32, IQ4_NL_CODE, MXFP4_CODE, PREFETCH_BYTES, Q4_0_CODE, Q4_1_CODE,
                                   Q5_0_CODE, Q5_1_CODE, Q8_0_CODE, Emitter, V, is_arr, tier_of)
from engine.kernels.quant_types import type_name
from engine.kernels.reference import IQ4_NL_VALUES

# =========================================================================================================
# Legacy 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4)
# =========================================================================================================

# code -> (block bytes, qs offset, qh offset or None, has min, factor on sum(d or m * xsum))
_LEGACY = {
    Q4_0_CODE: (18, 2, None, False, -8.0),
    Q4_1_CODE: (20, 4, None, True, 1.0),
    Q5_0_CODE: (22, 6, 2, False, -16.0),
    Q5_1_CODE: (24, 8, 4, True, 1.0),
    Q8_0_CODE: (34, 2, None, False, 0.0),
    MXFP4_CODE: (17, 1, None, False, -12.0),
    IQ4_NL_CODE: (18, 2, None, False, 0.0),
}
IQ4_NL_LEVELS = [int(v) for v in IQ4_NL_VALUES]  # ggml's kvalues_iq4nl (IQ4_XS shares them: iquant.py)
IQ4_NL_U = [v + 128 - 256 * (v >= 0) for v in IQ4_NL_LEVELS]  # the levels + 128 as u8 bytes (written as i8)
# MXFP4 code -> u: ggml's kvalues_mxfp4 (E2M1 doubled, -12..12) plus 12 (see the banner)
MXFP4_U = [v + 12 for v in (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)]
_LO_SEL = [0] * 8 + [1] * 8 + [4] * 8 + [5] * 8  # fifth-bit bytes of a pair: low halves of A, then of B
_HI_SEL = [2] * 8 + [3] * 8 + [6] * 8 + [7] * 8


def _signed(code, tier) -> bool:
    """Whether the block's weights are signed bytes (the sign trick) rather than unsigned ones."""
    return code == Q8_0_CODE or (code == IQ4_NL_CODE and tier != "vnni")


def _factor(code, tier) -> float:
    """The factor on sum(d or m * xsum) (IQ4_NL's + 128 on vnni: see the banner)."""
    return -128.0 if code == IQ4_NL_CODE and tier == "vnni" else _LEGACY[code][4]


def _pair_isum(e: Emitter, code, wp, o, xp, xo) -> ir.Value:
    """Blocks A (at byte o) and B (next) against a pair-interleaved activation pair at xo:
    <8 x i32>, lanes 0-3 sum to A's integer dot, lanes 4-7 to B's."""
    bb, qs, qh, _, _ = _LEGACY[code]
    b = e.b
    xlo, xhi = e.ld(xp, xo, V(I8, 32)), e.ld(xp, e.add(xo, 32), V(I8, 32))
    if code == Q8_0_CODE:
        wa, wb = e.ld(wp, e.add(o, qs), V(I8, 32)), e.ld(wp, e.add(o, bb + qs), V(I8, 32))
        lo = e.shuf(wa, wb, list(range(16)) + list(range(32, 48)))
        hi = e.shuf(wa, wb, list(range(16, 32)) + list(range(48, 64)))
    else:
        v = e.shuf(e.ld(wp, e.add(o, qs), V(I8, 16)), e.ld(wp, e.add(o, bb + qs), V(I8, 16)), range(32))
        lo, hi = e.nib_lo(v), e.nib_hi(v)
    if code == IQ4_NL_CODE:
        table = IQ4_NL_LEVELS if _signed(code, e.tier) else IQ4_NL_U
        lo, hi = e.lut16(lo, table), e.lut16(hi, table)
    if _signed(code, e.tier):
        (u1, s1), (u2, s2) = e.abs_sign(lo, xlo), e.abs_sign(hi, xhi)
        # |q x| pair sums reach 2 * 128 * 127: no room to add two of them in i16
        return e.dot4(e.dot4(ir.Constant(V(I32, 8), None) if e.tier == "vnni" else None, u1, s1), u2, s2)
    if code == MXFP4_CODE:
        lo, hi = e.lut16(lo, MXFP4_U), e.lut16(hi, MXFP4_U)
    if qh is not None:
        h = e.shuf(e.ld(wp, e.add(o, qh), V(I8, 4)), e.ld(wp, e.add(o, bb + qh), V(I8, 4)), range(8))
        lo, hi = b.or_(lo, e.bits_to_16(h, _LO_SEL)), b.or_(hi, e.bits_to_16(h, _HI_SEL))
    return e.dot4_small(lo, xlo, hi, xhi)


def _single_isum(e: Emitter, code, wp, o, xp, xo) -> ir.Value:
    """One block at byte o against natural-order activations at xo: <8 x i32> summing to its integer dot."""
    _, qs, qh, _, _ = _LEGACY[code]
    x = e.ld(xp, xo, V(I8, 32))
    if code == Q8_0_CODE:
        u, s = e.abs_sign(e.ld(wp, e.add(o, qs), V(I8, 32)), x)
        return e.dot4(ir.Constant(V(I32, 8), None) if e.tier == "vnni" else None, u, s)
    q = e.ld(wp, e.add(o, qs), V(I8, 16))
    v = e.shuf(e.nib_lo(q), e.nib_hi(q), range(32))
    if code == IQ4_NL_CODE:
        if _signed(code, e.tier):
            u, s = e.abs_sign(e.lut16(v, IQ4_NL_LEVELS), x)
            return e.dot4(None, u, s)
        v = e.lut16(v, IQ4_NL_U)
    if code == MXFP4_CODE:
        v = e.lut16(v, MXFP4_U)
    if qh is not None:
        v = e.b.or_(v, e.bits_to_16(e.ld(wp, e.add(o, qh), V(I8, 4)), [j // 8 for j in range(32)]))
    return e.dot4(ir.Constant(V(I32, 8), None) if e.tier == "vnni" else None, v, x)


def _group_scales(e: Emitter, code, wp, o, sp, i, g) -> ir.Value:
    """<2g x float> [d_j dx_j, (m_j or d_j) xsum_j] for the g blocks from block i (byte o); sp = xs8 row."""
    bb, _, _, has_min, _ = _LEGACY[code]
    offs = [e.add(o, bb * j) for j in range(g)]
    if has_min:  # f16 d and f16 m are adjacent: one 32-bit load per block
        dm = e.halves(e.b.bitcast(e.gather(wp, offs, I32), V(I16, 2 * g)))
    elif code == MXFP4_CODE:  # 4d (see the banner)
        dm = e.shuf(_e8m0_quad(e, e.gather(wp, offs, I8)), None, [j // 2 for j in range(2 * g)])
    else:
        d = e.halves(e.gather(wp, offs, I16))
        dm = e.shuf(d, None, [j // 2 for j in range(2 * g)])
    xs = e.ld(sp, e.mul(i, 8), V(FLT, 2 * g), align=4)
    return e.b.fmul(dm, xs)


def _e8m0_quad(e: Emitter, v) -> ir.Value:
    """<g x i8> E8M0 exponents -> <g x float> 4 * 2^(e-128) = 2^(e-126), the float with exponent field e + 1
    (exact for e <= 253; see the banner)."""
    b, g = e.b, v.type.count
    x = b.add(b.zext(v, V(I32, g)), e.splat_c(I32, 1, g))
    return b.bitcast(b.shl(x, e.splat_c(I32, 23, g)), V(FLT, g))


def legacy_rowdot_r(code, R):
    """Intrinsic (raw, roff, nb, xq, xoff, xs, soff, out, ooff, tier) -> None: R consecutive rows of nb blocks
    from byte roff of raw against activation vector xq[xoff:], xs[soff:] (flat offsets), into out[ooff:ooff+R].
    R = 2 shares the activation loads and the loop between two rows (rows of 18-20 blocks are short enough
    for the per-row overhead to show: -12 % for Q4_1 576 columns); Q5 types run out of registers with it."""
    bb = _LEGACY[code][0]

    def impl(typingctx, raw, roff, nb, xq, xoff, xs, soff, out, ooff, tier):
        t = tier_of(tier)
        if not (is_arr(raw, types.uint8) and is_arr(xq, types.int8) and is_arr(xs, types.float32)
                and is_arr(out, types.float32) and t):
            return None
        factor = _factor(code, t)
        sig = types.none(raw, types.intp, types.intp, xq, types.intp, xs, types.intp, out, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, t)
            b = builder
            at = signature.args
            r, ro, n, x, xo, s, so, o_, oo, _ = args
            rb = e.mul(n, bb)
            w0 = b.gep(e.base(at[0], r), [ro], source_etype=I8)
            wps = [b.gep(w0, [e.mul(rb, j)], source_etype=I8) for j in range(R)]
            xp = b.gep(e.base(at[3], x), [xo], source_etype=I8)
            sp = b.gep(e.base(at[5], s), [e.mul(so, 4)], source_etype=I8)
            accs = [(e.fvar(8), e.fvar(8), e.fvar(8)) for _ in range(R)]
            ng = b.sdiv(n, e.i64(4))
            with e.loop(ng) as lp:  # groups of 4 blocks = 2 interleaved pairs
                i = e.mul(lp.index, 4)
                o = e.mul(i, bb)
                for wp, (acc0, acc1, corr) in zip(wps, accs):
                    for line in range(0, 4 * bb, 64):  # every cache line of the group, PREFETCH_BYTES ahead
                        e.prefetch(wp, e.add(o, PREFETCH_BYTES + line))
                    sc = _group_scales(e, code, wp, o, sp, i, 4)
                    if factor:
                        e.facc(corr, sc)
                    for p, acc in enumerate((acc0, acc1)):
                        isum = _pair_isum(e, code, wp, e.add(o, 2 * p * bb), xp, e.mul(e.add(i, 2 * p), 32))
                        e.fmacc(acc, b.sitofp(isum, V(FLT, 8)), e.fperm8(sc, [4 * p] * 4 + [4 * p + 2] * 4))
            rem = b.sub(n, e.mul(ng, 4))
            with b.if_then(b.icmp_signed(">=", rem, e.i64(2))):  # one more pair
                i = e.mul(ng, 4)
                o = e.mul(i, bb)
                for wp, (acc0, acc1, corr) in zip(wps, accs):
                    sc = _group_scales(e, code, wp, o, sp, i, 2)
                    if factor:
                        e.facc(corr, e.shuf(sc, ir.Constant(sc.type, None), range(8)))
                    isum = _pair_isum(e, code, wp, o, xp, e.mul(i, 32))
                    e.fmacc(acc0, b.sitofp(isum, V(FLT, 8)), e.shuf(sc, None, [0] * 4 + [2] * 4))
            with b.if_then(b.icmp_signed("==", b.and_(rem, e.i64(1)), e.i64(1))):  # a last, unpaired block
                i = b.sub(n, e.i64(1))
                o = e.mul(i, bb)
                for wp, (acc0, acc1, corr) in zip(wps, accs):
                    sc = _group_scales(e, code, wp, o, sp, i, 1)
                    if factor:
                        e.facc(corr, e.shuf(sc, ir.Constant(sc.type, None), [0, 1] + [2] * 6))
                    isum = _single_isum(e, code, wp, o, xp, e.mul(i, 32))
                    e.fmacc(acc0, b.sitofp(isum, V(FLT, 8)), e.shuf(sc, None, [0] * 8))
            op = b.gep(e.base(at[7], o_), [e.mul(oo, 4)], source_etype=I8)
            for j, (acc0, acc1, corr) in enumerate(accs):
                tot = b.fadd(b.load(acc0), b.load(acc1))
                if factor:
                    tot = e.call("llvm.fmuladd.v8f32", tot.type, [b.load(corr), e.vc(FLT, [0.0, factor] * 4), tot])
                res = e.hsum_f(tot)
                if code == MXFP4_CODE:  # the blocks were summed with 4d
                    res = b.fmul(res, ir.Constant(FLT, 0.25))
                e.st(op, 4 * j, res)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_rowdot{R}_{type_name(code).lower()}"
    return intrinsic(impl)


def _minus_offset(e: Emitter, code, isum, xp, i, g) -> ir.Value:
    """isum less the offset the unsigned weights carry (IQ4_NL on vnni: 128 sum(x), lanes as isum's; the row
    kernels take it through xsum): integer_dots is then the same on every tier."""
    if code != IQ4_NL_CODE or _signed(code, e.tier):
        return isum
    one = e.splat_c(I8, 1, 32)
    xsum = ir.Constant(V(I32, 8), None)
    for h in range(g):  # g = 2: a pair's halves (lanes 0-3 block A, 4-7 block B), else one block in order
        xsum = e.dot4(xsum, one, e.ld(xp, e.add(e.mul(i, 32), 32 * h), V(I8, 32)))
    return e.b.sub(isum, e.b.shl(xsum, e.splat_c(I32, 7, 8)))


def legacy_idots(code):
    """Intrinsic (raw, roff, nb, xq, xoff, out, ooff, tier) -> None: the nb per-block integer dots of one row
    into out[ooff:] (int32), from the same IR as the row kernels (tests check them exactly)."""
    bb = _LEGACY[code][0]

    def impl(typingctx, raw, roff, nb, xq, xoff, out, ooff, tier):
        t = tier_of(tier)
        if not (is_arr(raw, types.uint8) and is_arr(xq, types.int8) and is_arr(out, types.int32) and t):
            return None
        sig = types.none(raw, types.intp, types.intp, xq, types.intp, out, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, t)
            b = builder
            at = signature.args
            r, ro, n, x, xo, out_, oo, _ = args
            wp = b.gep(e.base(at[0], r), [ro], source_etype=I8)
            xp = b.gep(e.base(at[3], x), [xo], source_etype=I8)
            op = b.gep(e.base(at[5], out_), [e.mul(oo, 4)], source_etype=I8)
            with e.loop(b.sdiv(n, e.i64(2))) as lp:
                i = e.mul(lp.index, 2)
                isum = _minus_offset(e, code, _pair_isum(e, code, wp, e.mul(i, bb), xp, e.mul(i, 32)), xp, i, 2)
                e.st(op, e.mul(i, 4), e.hsum_i(e.shuf(isum, None, [0, 1, 2, 3])))
                e.st(op, e.mul(e.add(i, 1), 4), e.hsum_i(e.shuf(isum, None, [4, 5, 6, 7])))
            with b.if_then(b.icmp_signed("==", b.and_(n, e.i64(1)), e.i64(1))):
                i = b.sub(n, e.i64(1))
                isum = _single_isum(e, code, wp, e.mul(i, bb), xp, e.mul(i, 32))
                e.st(op, e.mul(i, 4), e.hsum_i(_minus_offset(e, code, isum, xp, i, 1)))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_idots_{type_name(code).lower()}"
    return intrinsic(impl)


_CODES = (Q4_0_CODE, Q4_1_CODE, Q5_0_CODE, Q5_1_CODE, Q8_0_CODE, MXFP4_CODE)
_rd_q4_0, _rd_q4_1, _rd_q5_0, _rd_q5_1, _rd_q8_0, _rd_mxfp4 = (legacy_rowdot_r(c, 1) for c in _CODES)
_rd2_q4_0, _rd2_q4_1, _rd2_q8_0, _rd2_mxfp4 = (legacy_rowdot_r(c, 2) for c in (Q4_0_CODE, Q4_1_CODE, Q8_0_CODE,
                                                                                  MXFP4_CODE))
idots_q4_0, idots_q4_1, idots_q5_0, idots_q5_1, idots_q8_0, idots_mxfp4 = (legacy_idots(c) for c in _CODES)


# =========================================================================================================
# Row functions: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================

# One function per type, not a factory: numba keys a closure's cache entry on its pickled cells, and an
# intrinsic pickles with a per-process id, so closures would never hit the cache.


@njit(cache=True)
def rows_q4_0(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    r = r0
    while r + 1 < r1:  # two rows per call
        for m in range(M):  # the rows stay in L1 across the M vectors
            _rd2_q4_0(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)
        r += 2
    if r < r1:
        for m in range(M):
            _rd_q4_0(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)


@njit(cache=True)
def rows_q4_1(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    r = r0
    while r + 1 < r1:  # two rows per call
        for m in range(M):  # the rows stay in L1 across the M vectors
            _rd2_q4_1(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)
        r += 2
    if r < r1:
        for m in range(M):
            _rd_q4_1(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)


@njit(cache=True)
def rows_q5_0(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    for r in range(r0, r1):
        for m in range(M):  # the row stays in L1 across the M vectors
            _rd_q5_0(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)


@njit(cache=True)
def rows_q5_1(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    for r in range(r0, r1):
        for m in range(M):  # the row stays in L1 across the M vectors
            _rd_q5_1(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)


@njit(cache=True)
def rows_q8_0(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    r = r0
    while r + 1 < r1:  # two rows per call
        for m in range(M):  # the rows stay in L1 across the M vectors
            _rd2_q8_0(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)
        r += 2
    if r < r1:
        for m in range(M):
            _rd_q8_0(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)


@njit(cache=True)
def rows_mxfp4(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    r = r0
    while r + 1 < r1:  # two rows per call
        for m in range(M):  # the rows stay in L1 across the M vectors
            _rd2_mxfp4(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)
        r += 2
    if r < r1:
        for m in range(M):
            _rd_mxfp4(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)
