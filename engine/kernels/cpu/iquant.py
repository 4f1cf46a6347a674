"""Integer kernels of the non-linear 4-bit types IQ4_NL and IQ4_XS (llama.cpp's kvalues_iq4nl: 16 signed levels,
denser near zero), and the super-block driver they share with ternary.py. Paired with int8 activations as
llama.cpp pairs them: IQ4_NL (32-weight blocks, Q4_0's nibble layout) with the legacy Q8_0-style blocks (xq8 in
pair-interleaved order, xs8), IQ4_XS (256-weight super-blocks) with the Q8_K-style ones (xqk, xdk, xbk; quantize.py).

Integer algebra (v = a nibble's signed level, -127..113; x = int8 activation; exact in int32):
  IQ4_NL per block:        d*dx*sum(v x)                    (legacy.py's kernels, with IQ4_NL in its tables)
  IQ4_XS per super-block:  d*dx*sum_s ls_s sum(v x)_s,  ls_s = the 6-bit sub-block scale - 32 (-32..31)
The levels are signed and reach -127. On the avx2 and generic tiers u8 x s8 products take |v| and x with v's sign
(vpsign), as Q8_0's do: a pair sum stays below 2 * 127 * 127 < 2^15 (no vpmaddubsw saturation), and the scale
joins through vpmaddwd. On vnni, IQ4_XS reads u = v + 128 (1..241; vpdpbusd adds in i32, so it cannot saturate):
  sum_s ls_s sum(v x)_s = sum_s ls_s sum(u x)_s - 128 sum_s ls_s bsum_s   (bsum_s: xbk's sums of 32)
which drops the two vpsign per 32 weights and the per-sub-block scale multiply (a vphaddd tree gathers the eight
sub-block sums for one vpmulld): IQ4_XS went from about 0.45x to 0.85x of Q4_K's speed on Zen 5 (hot, one thread).
IQ4_NL does the same through Q4_0's - 8 d xsum path (legacy.py). Every tier computes the same integers
(int8.integer_dots: [sum_s ls_s sum(v x)_s, 0] per IQ4_XS super-block, sum(v x) per IQ4_NL block).

The super-block driver (sb_rowdot, sb_idots, which ternary.py shares too) is kquant.py's (k_rowdot, k_idots) with a
type's integer sums per super-block (isums) as its body: the float step is d*dx*(isum - sub) per super-block, sub
an integer term the type may subtract (ternary.py's block sums); each super-block is decoded once for up to four
activation vectors, and each row loop prefetches PREFETCH_BYTES ahead.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit

from engine.kernels.cpu.ir import I8, I16, I32, IQ4_NL_CODE, Emitter, V
from engine.kernels.cpu.kquant import k_idots, k_rowdot
from engine.kernels.cpu.legacy import IQ4_NL_LEVELS, legacy_idots, legacy_rowdot_r
from engine.kernels.cpu.quantize import KB_SUMS

# =========================================================================================================
# The super-block driver: d*dx*(isum - sub) per super-block of 256
# =========================================================================================================


def _k_body(isums, d_off: int, subtract: bool):
    """A type's isums as a body of kquant.k_rowdot / k_idots: the super-block's f16 d as <1 x float>, and per
    vector the integer sum less the type's own term (rows) or both apart (integer_dots reports them so)."""

    def body(e, wp, o, xs_at, bsums):
        dw = e.halves(e.ld(wp, e.add(o, d_off), V(I16, 1)))
        sums = isums(e, wp, o, xs_at, bsums)
        if subtract:
            sums = [(isum if sub is None else e.b.sub(isum, sub), None) for isum, sub in sums]
        return dw, sums

    return body


def sb_rowdot(name, bb, d_off, isums, n):
    """Intrinsic (raw, roff, nsb, xq, xd, xb, m, tier) -> n float32, as kquant's row dots (kquant.k_rowdot runs
    it): one row of nsb super-blocks of bb bytes (f16 d at byte d_off) against activation vectors m .. m + n - 1.
    isums(e, wp, o, xs_at, bsums) -> per vector (<8 x i32> isum, <8 x i32> sub or None)."""
    return k_rowdot(name, bb, _k_body(isums, d_off, subtract=True), n)


def sb_idots(name, bb, isums):
    """Intrinsic (raw, roff, nsb, xq, xoff, xb, boff, out, ooff, tier) -> None: per super-block the integer sum
    and the integer term it subtracts (0 where none) into out[ooff + 2 i], out[ooff + 2 i + 1] (tests)."""
    return k_idots(name, bb, _k_body(isums, 0, subtract=False))


# =========================================================================================================
# IQ4_XS: f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128] (136 bytes; reference._iq4_xs)
# =========================================================================================================

_XS_BB = 136
_U_LEVELS = [v + 128 - 256 * (v >= 0) for v in IQ4_NL_LEVELS]  # the levels + 128 as u8, written as i8 values


def _xs_scales(e: Emitter, wp, o) -> ir.Value:
    """<8 x i16> ls_s - 32: low 4 bits = nibble s % 2 of scales_l[s // 2], top 2 = bits 2s, 2s+1 of scales_h."""
    b = e.b
    low = e.shuf(e.ld(wp, e.add(o, 4), V(I8, 4)), None, [s // 2 for s in range(8)])
    low = b.and_(b.lshr(low, e.vc(I8, [0, 4] * 4)), e.splat_c(I8, 15, 8))
    high = b.lshr(e.splat(e.ld(wp, e.add(o, 2), I16), 8), e.vc(I16, range(0, 16, 2)))
    high = b.shl(b.and_(high, e.splat_c(I16, 3, 8)), e.splat_c(I16, 4, 8))
    return b.sub(b.or_(b.zext(low, V(I16, 8)), high), e.splat_c(I16, 32, 8))


def _xs_isums(e: Emitter, wp, o, xs_at, bsums):
    """One IQ4_XS super-block against len(bsums) vectors: per vector (<8 x i32> sum_s ls_s sum(v x)_s, None)."""
    if e.tier == "vnni":
        return _xs_isums_vnni(e, wp, o, xs_at, bsums)
    b = e.b
    n = len(bsums)
    ls = _xs_scales(e, wp, o)
    isums = [None] * n
    for c in range(4):  # one 32-byte load: sub-blocks 2c and 2c + 1, low nibbles (weights 0-15) then high
        q = e.ld(wp, e.add(o, 8 + 32 * c), V(I8, 32))
        lo, hi = e.lut16(e.nib_lo(q), IQ4_NL_LEVELS), e.lut16(e.nib_hi(q), IQ4_NL_LEVELS)
        for j in range(2):
            s = 2 * c + j
            w = e.shuf(lo, hi, [16 * j + k for k in range(16)] + [32 + 16 * j + k for k in range(16)])
            ssc = e.shuf(ls, None, [s] * 16)
            for v in range(n):
                u, sx = e.abs_sign(w, xs_at(v, s))
                part = e.madd_i16(e.madd_u8s8(u, sx), ssc)
                isums[v] = part if isums[v] is None else b.add(isums[v], part)
    return [(isum, None) for isum in isums]


def _hadd(e: Emitter, a, c) -> ir.Value:
    """vphaddd: per 128-bit half, the sums of adjacent lanes of a, then of c."""
    return e.call("llvm.x86.avx2.phadd.d", a.type, [a, c])


def _xs_isums_vnni(e: Emitter, wp, o, xs_at, bsums):
    """_xs_isums with vpdpbusd (see the banner): the levels + 128 against x, each sub-block's sum in i32, a
    vphaddd tree over the eight, one vpmulld by their scales, less 128 sum_s ls_s bsum_s. The x of two sub-blocks
    are interleaved by halves to meet one 32-byte load's low, then high nibbles (the weights' order)."""
    b = e.b
    ls = _xs_scales(e, wp, o)
    ls32 = e.shuf(b.sext(ls, V(I32, 8)), None, [0, 2, 4, 6, 1, 3, 5, 7])  # the tree's lane order
    res = []
    for v, bs in enumerate(bsums):
        parts = []
        for c in range(4):  # lanes 0-3 sum sub-block 2c, lanes 4-7 sub-block 2c + 1
            q = e.ld(wp, e.add(o, 8 + 32 * c), V(I8, 32))
            x0, x1 = xs_at(v, 2 * c), xs_at(v, 2 * c + 1)
            xa = e.shuf(x0, x1, list(range(16)) + list(range(32, 48)))  # weights 0-15 of both sub-blocks
            xb = e.shuf(x0, x1, list(range(16, 32)) + list(range(48, 64)))
            acc = e.dot4(ir.Constant(V(I32, 8), None), e.lut16(e.nib_lo(q), _U_LEVELS), xa)
            parts.append(e.dot4(acc, e.lut16(e.nib_hi(q), _U_LEVELS), xb))
        tree = _hadd(e, _hadd(e, parts[0], parts[1]), _hadd(e, parts[2], parts[3]))  # sub-blocks 0 2 4 6 1 3 5 7
        lsb = e.madd_i16(ls, bs(0, V(I16, 8)))  # <4 x i32>: ls_s bsum_s in pairs
        off = b.shl(e.shuf(lsb, ir.Constant(lsb.type, None), list(range(4)) + [4] * 4), e.splat_c(I32, 7, 8))
        res.append((b.sub(b.mul(tree, ls32), off), None))
    return res


_rd1_iq4_xs, _rd2_iq4_xs, _rd4_iq4_xs = (sb_rowdot("iq4_xs", _XS_BB, 0, _xs_isums, n) for n in (1, 2, 4))
idots_iq4_xs = sb_idots("iq4_xs", _XS_BB, _xs_isums)

# IQ4_NL: legacy.py's row dots and block dots, one row per call. Not two as Q4_0's GGUF-order rows: on Zen 5 two
# rows at once (two streams a thread) read a 1536 x 8960 matrix from DRAM at 15 GB/s against 26 GB/s one row at a
# time (one thread, CPU time; Q4_0 itself 15), at the same speed from cache (tests/bench/bench_iquant_matvec.py).
_rd_iq4_nl = legacy_rowdot_r(IQ4_NL_CODE, 1)
idots_iq4_nl = legacy_idots(IQ4_NL_CODE)


# =========================================================================================================
# Row functions: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================

# One function per type, not a factory (see legacy.py): closures would never hit numba's cache.


@njit(cache=True)
def rows_iq4_nl(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    for r in range(r0, r1):
        for m in range(M):  # the row stays in L1 across the M vectors
            _rd_iq4_nl(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)


@njit(cache=True)
def rows_iq4_xs(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:  # four vectors per decoded super-block, then two, then one (as kquant.py)
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_iq4_xs(raw, ro, nsb, xq, xd, xb,
                                                                                       m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_iq4_xs(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_iq4_xs(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def integer_dots(code, raw, xq8, xqk, xbk, out, tier):
    """int8.integer_dots of IQ4_NL (out (M, rows, K/32)) or IQ4_XS (out (M, rows, 2 K/256)) weights (tests)."""
    rb = raw.shape[1]
    for r in range(raw.shape[0]):
        for m in range(out.shape[0]):
            oo = (m * out.shape[1] + r) * out.shape[2]
            if code == IQ4_NL_CODE:
                idots_iq4_nl(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            else:
                nsb = xqk.shape[1] // 256
                idots_iq4_xs(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, m * nsb * KB_SUMS, out, oo, tier)
