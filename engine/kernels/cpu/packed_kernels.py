"""The LLVM-IR intrinsics over the row-interleaved legacy blocks of packed.py (which describes the layout and
drives these from numba): dequantizing row groups, and the decode matvec of row groups against activations.

The matvec kernel serves a batch of decode sequences in one call: each block's quants and scales are loaded and
unpacked once for up to MB activation vectors, which then each run their own integer dot and float epilogue with
their own accumulators (independent chains, so the dot latency overlaps too). On the vnni tier of a CPU with
AVX-512 it also takes two row groups at once as the halves of 512-bit vectors: each vector's dot and epilogue are
then half as many instructions for the same rows (a batched step is bound by the multiply pipes, and Zen 5 runs
a 512-bit vpdpbusd at the rate of a 256-bit one). Every float operation acts lane by lane in the order of a single
vector against a single group, so a row's result never depends on the batch around it or on the width used.
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels.cpu.ir import (FLT, I8, I16, I32, Q4_0_CODE, Q4_1_CODE, Q5_0_CODE, Q5_1_CODE, Q8_0_CODE, Emitter,
                                   V, is_arr, target_features, tier_of)
from engine.kernels.quant_types import GGMLType

ROWS = 8  # rows per interleaved group
PREFETCH = 1024  # bytes ahead in the group's stream
# Bytes ahead in each stream of a pair of groups (batches only): on a Zen 5 VM one thread's Q4_1 matvecs of
# SmolLM2 at M = 4 got faster at each step from 1 to 8 KB ahead (docs/benchmarks.md, "Measurements behind the
# code", packed prefetch distance).
PREFETCH_WIDE = 8192
MB = 4  # activation vectors per matvec kernel call at most

# code -> (block bytes, d offset, m offset or -1, qh offset or -1, qs offset) in a GGUF block
SRC = {Q4_0_CODE: (18, 0, -1, -1, 2), Q4_1_CODE: (20, 0, 2, -1, 4), Q5_0_CODE: (22, 0, -1, 2, 6),
       Q5_1_CODE: (24, 0, 2, 4, 8), Q8_0_CODE: (34, 0, -1, -1, 2)}
CODES = (Q4_0_CODE, Q4_1_CODE, Q5_0_CODE, Q5_1_CODE, Q8_0_CODE)


def _layout(code: int) -> tuple[int, int, int, int]:
    """(group-block bytes, m offset or -1, fifth-bit offset or -1, qs offset) of a packed block of 8 rows."""
    bb, _, mo, qh, _ = SRC[code]
    m = 16 if mo >= 0 else -1
    hb = (32 if mo >= 0 else 16) if qh >= 0 else -1
    qs = 16 + (16 if mo >= 0 else 0) + (32 if qh >= 0 else 0)
    return 8 * bb, m, hb, qs


LAYOUT = {c: _layout(c) for c in SRC}


@functools.cache
def wide_groups(tier: str) -> bool:
    """Whether the matvec kernel of this tier takes row groups in pairs (512-bit vpdpbusd)."""
    f = target_features()
    return tier == "vnni" and {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= f


def _quants(e: Emitter, q, hb16, j: int) -> list:
    """The unsigned quants of nibble group j, from its quant bytes q (<32 x i8>, or two groups' <64 x i8>):
    [weights 4j.. of each row (low nibbles), weights 16+4j.. (high)], lane 4r+i for row r; with fifth bits (hb16,
    the block's fifth-bit bytes as i16 lanes, or None), bit 2j / 2j+1 of each byte moved to bit 4 (16-bit shifts:
    the mask drops what crosses between the bytes) and or-ed in."""
    b = e.b
    halves = [e.nib_lo(q), e.nib_hi(q)]
    if hb16 is not None:
        n = hb16.type.count
        for h in range(2):
            k = 2 * j + h
            v = hb16 if k == 4 else (b.shl(hb16, e.splat_c(I16, 4 - k, n)) if k < 4
                                     else b.lshr(hb16, e.splat_c(I16, k - 4, n)))
            halves[h] = b.or_(halves[h], b.and_(b.bitcast(v, V(I8, 2 * n)), e.splat_c(I8, 16, 2 * n)))
    return halves


# =========================================================================================================
# Dequantizing row groups
# =========================================================================================================


def _dequant_kernel(code: int):
    """Intrinsic (src, g0, g1, cols, out) -> None: row groups [g0, g1) of a packed matrix -> out (8 (g1 - g0),
    cols) f32, with the reference's f32 operations (d * (q - offset), or d * q + m unfused), so bit for bit."""
    gbb, mo, hbo, qso = LAYOUT[code]
    offset = {Q4_0_CODE: 8, Q5_0_CODE: 16}.get(code, 0)
    five = hbo >= 0

    def impl(typingctx, src, g0, g1, cols, out):
        if not (is_arr(src, types.uint8) and is_arr(out, types.float32)):
            return None
        ip = types.intp
        sig = types.none(src, ip, ip, ip, out)

        def codegen(context, builder, signature, args):
            e, b = Emitter(context, builder, "generic"), builder
            at = signature.args
            s_, g0_, g1_, cols_, o_ = args
            sp, op = e.base(at[0], s_), e.base(at[4], o_)
            nb = b.sdiv(cols_, e.i64(32))
            row_b = e.mul(cols_, 4)
            with e.loop(b.sub(g1_, g0_)) as gl:
                with e.loop(nb) as bl:
                    o = e.mul(e.add(e.mul(e.add(gl.index, g0_), nb), bl.index), gbb)
                    d8 = e.halves(e.ld(sp, o, V(I16, 8)))
                    m8 = e.halves(e.ld(sp, e.add(o, mo), V(I16, 8))) if mo >= 0 else None
                    # lanes 8k..8k+7 of a quant vector are rows 2k (4 lanes) and 2k+1 (4 lanes)
                    ds = [e.shuf(d8, None, [2 * k] * 4 + [2 * k + 1] * 4) for k in range(4)]
                    ms = [e.shuf(m8, None, [2 * k] * 4 + [2 * k + 1] * 4) for k in range(4)] if m8 is not None else None
                    hb16 = b.bitcast(e.ld(sp, e.add(o, hbo), V(I8, 32)), V(I16, 16)) if five else None
                    row0 = e.mul(gl.index, 8)
                    col0 = e.mul(bl.index, 32)
                    if code == Q8_0_CODE:  # 8 groups of 4 signed weights: d * q
                        for j in range(8):
                            q = e.ld(sp, e.add(o, qso + 32 * j), V(I8, 32))
                            for k in range(4):
                                qi = b.sext(e.shuf(q, None, range(8 * k, 8 * k + 8)), V(I32, 8))
                                f = b.fmul(ds[k], b.sitofp(qi, V(FLT, 8)))
                                for half in range(2):
                                    r = e.add(row0, 2 * k + half)
                                    at_ = e.add(e.mul(r, row_b), e.mul(e.add(col0, 4 * j), 4))
                                    e.st(op, at_, e.shuf(f, None, range(4 * half, 4 * half + 4)))
                    for j in range(0 if code == Q8_0_CODE else 4):  # 4-5 bit types: 4 groups of nibble pairs
                        halves = _quants(e, e.ld(sp, e.add(o, qso + 32 * j), V(I8, 32)), hb16, j)
                        for h, qv in enumerate(halves):
                            for k in range(4):
                                qi = b.zext(e.shuf(qv, None, range(8 * k, 8 * k + 8)), V(I32, 8))
                                if offset:
                                    qi = b.sub(qi, e.splat_c(I32, offset, 8))
                                f = b.fmul(ds[k], b.sitofp(qi, V(FLT, 8)))
                                if ms is not None:
                                    f = b.fadd(f, ms[k])
                                col = e.add(col0, 16 * h + 4 * j)
                                for half in range(2):  # rows 2k, 2k+1: 4 consecutive columns each
                                    r = e.add(row0, 2 * k + half)
                                    at_ = e.add(e.mul(r, row_b), e.mul(col, 4))
                                    e.st(op, at_, e.shuf(f, None, range(4 * half, 4 * half + 4)))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_dequant_{GGMLType(code).name.lower()}"
    return intrinsic(impl)


d_q4_0, d_q4_1, d_q5_0, d_q5_1, d_q8_0 = (_dequant_kernel(c) for c in CODES)


# =========================================================================================================
# The matvec kernel: one or two groups of 8 rows against 1..MB activation vectors
# =========================================================================================================


def _group_kernel(code: int):
    """Intrinsic (w, woff, nb, ng, xq, xoff, xstep, xs, soff, sstep, out, ooff, ostep, mb, tier) -> None: for
    each vector v < mb (1..MB), out[ooff + v ostep + r] (r < 8 ng) = the dot of row r of the ng packed groups at
    byte woff of w (nb blocks a row) with activations xq[xoff + v xstep:] (natural order) and xs[soff + v sstep:]
    ([dx, xsum] per block). Two groups and several vectors run as one pair where wide_groups(tier)."""
    gbb, mo, hbo, qso = LAYOUT[code]
    factor = {Q4_0_CODE: -8.0, Q5_0_CODE: -16.0}.get(code, 0.0)  # on d * xsum; Q*_1 add m * xsum instead, Q8_0 nothing
    five = hbo >= 0

    def emit(e, mb, wide, wp, n, xps, sps, ops):
        """The block loop for mb vectors; wide: two groups (the second nb blocks on) as 512-bit vectors."""
        b = e.b
        L = 16 if wide else 8  # lanes: rows
        gs = e.mul(n, gbb)  # bytes per group
        accs, corrs = [e.fvar(L) for _ in range(mb)], [e.fvar(L) for _ in range(mb)]
        ones = e.splat_c(I16, 1, 16)

        def wld(off, ty, count):  # count elements of each group at byte off of its block
            v = e.ld(wp, off, V(ty, count))
            return e.shuf(v, e.ld(wp, e.add(off, gs), V(ty, count)), range(2 * count)) if wide else v

        def xld(xp, off):  # 4 activations against every row's dword
            return b.bitcast(e.splat(e.ld(xp, off, I32), L), V(I8, 4 * L))

        def dot(acc, u, x):  # vpdpbusd (512 bits where wide); i32 sums are exact in any order
            if not wide:
                return e.dot4(acc, u, x)
            v16 = V(I32, 16)
            return e.call("llvm.x86.avx512.vpdpbusd.512", v16, [acc, b.bitcast(u, v16), b.bitcast(x, v16)])

        with e.loop(n) as lp:
            o = e.mul(lp.index, gbb)
            ahead = e.add(o, PREFETCH_WIDE if wide else PREFETCH)
            if wide:  # past the first group's end its stream goes on with the third (the next call's first)
                ahead = b.add(ahead, b.select(b.icmp_signed(">=", ahead, gs), gs, e.i64(0)))
            for g in range(2 if wide else 1):
                for line in range(0, gbb, 64):
                    e.prefetch(wp, e.add(b.add(ahead, gs) if g else ahead, line))
            xb = e.mul(lp.index, 32)
            hb16 = b.bitcast(wld(e.add(o, hbo), I8, 32), V(I16, 2 * L)) if five else None
            block = {}  # the block's weights, unpacked at first use (so one vector keeps the order of a plain loop)

            def unpacked(key):
                if key not in block:
                    if key == "d":
                        block[key] = e.halves(wld(o, I16, 8))
                    elif key == "m":
                        block[key] = e.halves(wld(e.add(o, mo), I16, 8))
                    elif code != Q8_0_CODE:
                        block[key] = _quants(e, wld(e.add(o, qso + 32 * key), I8, 32), hb16, key)
                    else:
                        q = block[key] = wld(e.add(o, qso + 32 * key), I8, 32)
                        if wide:  # no vpsignb on 512 bits: |w|, and where w < 0 a masked negation of x
                            zero = ir.Constant(q.type, None)
                            neg = b.icmp_signed("<", q, zero)
                            block[key] = (b.select(neg, b.sub(zero, q), q), neg)
                return block[key]

            sb = e.mul(lp.index, 8)
            for v in range(mb):
                xp, isum = xps[v], None
                if code == Q8_0_CODE:  # signed weights: pair sums need i32 at once
                    isum = ir.Constant(V(I32, L), None) if e.tier == "vnni" else None
                    for j in range(8):
                        x4 = xld(xp, e.add(xb, 4 * j))
                        if wide:
                            u, neg = unpacked(j)
                            sx = b.select(neg, b.sub(ir.Constant(x4.type, None), x4), x4)
                        else:
                            u, sx = e.abs_sign(unpacked(j), x4)
                        isum = dot(isum, u, sx)
                elif wide or e.tier == "vnni":  # vpdpbusd: i32 sums, exact
                    isum = ir.Constant(V(I32, L), None)
                    for j in range(4):
                        for h in range(2):
                            isum = dot(isum, unpacked(j)[h], xld(xp, e.add(xb, 16 * h + 4 * j)))
                else:
                    sums, p16 = [], None
                    for j in range(4):
                        lo, hi = unpacked(j)
                        p = b.add(e.madd_u8s8(lo, xld(xp, e.add(xb, 4 * j))),
                                  e.madd_u8s8(hi, xld(xp, e.add(xb, 16 + 4 * j))))
                        p16 = p if p16 is None else b.add(p16, p)
                        # i16 lanes hold at most 2 x 15 x 127 per product pair: 8 pairs fit for 4-bit quants,
                        # 4 for 5-bit ones
                        if five and j == 1:
                            sums.append(p16)
                            p16 = None
                    sums.append(p16)
                    for s in sums:
                        vs = e.madd_i16(s, ones)  # lane r: row r
                        isum = vs if isum is None else b.add(isum, vs)
                dx = e.splat(e.ld(sps[v], sb, FLT), L)
                xsum = e.splat(e.ld(sps[v], e.add(sb, 4), FLT), L)
                e.fmacc(accs[v], b.sitofp(isum, V(FLT, L)), b.fmul(unpacked("d"), dx))
                if mo >= 0:
                    e.fmacc(corrs[v], unpacked("m"), xsum)
                elif factor:
                    e.fmacc(corrs[v], unpacked("d"), b.fmul(xsum, e.splat_c(FLT, factor, L)))
        for v in range(mb):
            e.st(ops[v], 0, b.fadd(b.load(accs[v]), b.load(corrs[v])))

    def variant(context, module, tier, wide, mb):
        """The loop for one (width, vector count) as a function of its own (w, nb, ng, x, x step, xs, xs step,
        out, out step; pointers and byte steps), so each gets its own register allocation: inlined side by side,
        their shared constants left one vector's loop slower (EVEX-only registers, a folded load;
        docs/benchmarks.md, "Measurements behind the code", packed variant functions)."""
        p8, i64 = I8.as_pointer(), ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [p8, i64, i64, p8, i64, p8, i64, p8, i64])
        name = f"goinfer_packed_{GGMLType(code).name.lower()}_{tier}_{'wide' if wide else 'narrow'}{mb}"
        fn = cgutils.get_or_insert_function(module, fnty, name)
        if not fn.is_declaration:
            return fn
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        fn.attributes.add("nounwind")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        e = Emitter(context, b, tier)
        wp, n, ng, xp, xst, sp, sst, op, ost = fn.args
        xps = [b.gep(xp, [e.mul(xst, v)], source_etype=I8) for v in range(mb)]
        sps = [b.gep(sp, [e.mul(sst, v)], source_etype=I8) for v in range(mb)]
        ops = [b.gep(op, [e.mul(ost, v)], source_etype=I8) for v in range(mb)]
        if wide:
            emit(e, mb, True, wp, n, xps, sps, ops)
        else:  # the ng groups one after another
            with e.loop(ng) as gl:
                gw = b.gep(wp, [e.mul(e.mul(gl.index, n), gbb)], source_etype=I8)
                gops = [b.gep(p, [e.mul(gl.index, 4 * ROWS)], source_etype=I8) for p in ops]
                emit(e, mb, False, gw, n, xps, sps, gops)
        b.ret_void()
        return fn

    def impl(typingctx, w, woff, nb, ng, xq, xoff, xstep, xs, soff, sstep, out, ooff, ostep, mb, tier):
        t = tier_of(tier)
        if not (is_arr(w, types.uint8) and is_arr(xq, types.int8) and is_arr(xs, types.float32)
                and is_arr(out, types.float32) and t):
            return None
        ip = types.intp
        sig = types.none(w, ip, ip, ip, xq, ip, ip, xs, ip, ip, out, ip, ip, ip, tier)

        def codegen(context, builder, signature, args):
            e, b = Emitter(context, builder, t), builder
            at = signature.args
            w_, wo, n, ng_, x_, xo, xst, s_, so, sst, o_, oo, ost, mb_, _ = args
            ptrs = [b.gep(e.base(at[0], w_), [wo], source_etype=I8), n, ng_,
                    b.gep(e.base(at[4], x_), [xo], source_etype=I8), xst,
                    b.gep(e.base(at[7], s_), [e.mul(so, 4)], source_etype=I8), e.mul(sst, 4),
                    b.gep(e.base(at[10], o_), [e.mul(oo, 4)], source_etype=I8), e.mul(ost, 4)]
            # one function per (width, vectors), picked by the switch key mb (+ MB where wide); wide only for two
            # groups and more than one vector (one vector reads faster from one stream than from two)
            key = mb_
            if wide_groups(t):
                pair = b.and_(b.icmp_signed("==", ng_, e.i64(2)), b.icmp_signed(">", mb_, e.i64(1)))
                key = b.add(key, b.select(pair, e.i64(MB), e.i64(0)))
            variants = [(False, k) for k in range(1, MB + 1)] + [(True, k) for k in range(2, MB + 1) if wide_groups(t)]
            end = b.append_basic_block("kernel_end")
            blocks = [b.append_basic_block(f"{'wide' if wd else 'narrow'}_mb{k}") for wd, k in variants]
            sw = b.switch(key, blocks[0])
            for (wide, k), block in zip(variants, blocks):
                sw.add_case(ir.Constant(key.type, (MB if wide else 0) + k), block)
                b.position_at_end(block)
                b.call(variant(context, b.module, t, wide, k), ptrs)
                b.branch(end)
            b.position_at_end(end)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_group_{GGMLType(code).name.lower()}"
    return intrinsic(impl)


g_q4_0, g_q4_1, g_q5_0, g_q5_1, g_q8_0 = (_group_kernel(c) for c in CODES)

