"""Integer kernels of the ternary types TQ1_0 and TQ2_0 (256-weight super-blocks, weights d * (u - 1) with
u in {0, 1, 2}), paired with the Q8_K-style activations (quantize.py: xqk int8, xdk scale, xbk block sums) as
llama.cpp pairs them; iquant.py's super-block driver runs the rows.

Integer algebra per super-block (u = the stored digit, x = int8 activation, exact in int32):
  TQ1_0, TQ2_0:  d*dx*(sum(u x) - bsum),  bsum = sum(x) over the super-block (xbk's eight sums of 32)
u is unsigned and small, so u8 x s8 pair sums (<= 2 * 3 * 127) add up in i16 across the whole super-block before
one vpmaddwd (vpdpbusd on the vnni tier). int8.integer_dots: [sum(u x), bsum] per super-block.
  TQ2_0 (qs[64] | f16 d): 2-bit fields, field j of byte l of half h = weight 128h + 32j + l (reference._crumbs);
         a stored 3 reads as 2, as in ggml (u = 3 gives 2x here too).
  TQ1_0 (qs[48] | qh[4] | f16 d): five (qh: four) base-3 digits per byte as a fixed-point fraction; digit t of
         byte q is ((q * 3^t mod 256) * 3) >> 8 (reference._trits). Weights 32t + l from qs[0:32], 160 + 16t + l
         from qs[32:48], 240 + 4t + l from qh, so eight 32-lane vectors meet the activations in natural order.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit

from engine.kernels.cpu.ir import I8, I16, I32, TQ1_0_CODE, Emitter, V
from engine.kernels.cpu.iquant import sb_idots, sb_rowdot
from engine.kernels.cpu.quantize import KB_SUMS

_TQ1_BB, _TQ2_BB = 54, 66


def _small_dot(e: Emitter, us, xs) -> ir.Value:
    """<8 x i32> summing to sum_k sum(us[k] xs[k]) over 32-byte vectors, us small enough (<= 3 here) that the
    pair sums of all of them add in i16."""
    if e.tier == "vnni":
        acc = ir.Constant(V(I32, 8), None)
        for u, x in zip(us, xs):
            acc = e.dot4(acc, u, x)
        return acc
    p = None
    for u, x in zip(us, xs):
        q = e.madd_u8s8(u, x)
        p = q if p is None else e.b.add(p, q)
    return e.madd_i16(p, e.splat_c(I16, 1, 16))


def _with_bsum(e: Emitter, bsums, dots):
    """Per vector (its integer dot, its block sum over the super-block as <8 x i32>)."""
    return [(dot, e.b.sext(bs(0, V(I16, 8)), V(I32, 8))) for dot, bs in zip(dots, bsums)]


def _tq2_isums(e: Emitter, wp, o, xs_at, bsums):
    b = e.b
    us = []
    for h in range(2):
        q = e.ld(wp, e.add(o, 32 * h), V(I8, 32))
        us += [b.and_(b.lshr(q, e.splat_c(I8, 2 * j, 32)) if j else q, e.splat_c(I8, 3, 32)) for j in range(4)]
    return _with_bsum(e, bsums, [_small_dot(e, us, [xs_at(v, j) for j in range(8)]) for v in range(len(bsums))])


def _trits(e: Emitter, q, pow3) -> ir.Value:
    """<32 x i8> bytes, <32 x i8> multipliers 3^t -> their digits t: ((q * 3^t mod 256) * 3) >> 8."""
    b = e.b
    m = b.zext(b.mul(q, pow3), V(I16, 32))
    return b.trunc(b.lshr(b.mul(m, e.splat_c(I16, 3, 32)), e.splat_c(I16, 8, 32)), V(I8, 32))


def _tq1_isums(e: Emitter, wp, o, xs_at, bsums):
    q0 = e.ld(wp, o, V(I8, 32))  # weights 32t + l: digit t of qs[l]
    us = [_trits(e, q0, e.splat_c(I8, 3 ** t, 32)) for t in range(5)]
    q1 = e.ld(wp, e.add(o, 32), V(I8, 16))  # weights 160 + 16t + l: digit t of qs[32 + l]
    qh = e.shuf(e.ld(wp, e.add(o, 48), V(I8, 4)), None, list(range(4)) * 4)  # 240 + 4t + l: digit t of qh[l]
    pair = e.shuf(q1, None, list(range(16)) * 2)
    us.append(_trits(e, pair, e.vc(I8, [1] * 16 + [3] * 16)))
    us.append(_trits(e, pair, e.vc(I8, [9] * 16 + [27] * 16)))
    last = e.shuf(q1, qh, list(range(16)) + list(range(16, 32)))
    us.append(_trits(e, last, e.vc(I8, [81] * 16 + [3 ** (j // 4) for j in range(16)])))
    return _with_bsum(e, bsums, [_small_dot(e, us, [xs_at(v, j) for j in range(8)]) for v in range(len(bsums))])


_rd1_tq1_0, _rd2_tq1_0, _rd4_tq1_0 = (sb_rowdot("tq1_0", _TQ1_BB, 52, _tq1_isums, n) for n in (1, 2, 4))
_rd1_tq2_0, _rd2_tq2_0, _rd4_tq2_0 = (sb_rowdot("tq2_0", _TQ2_BB, 64, _tq2_isums, n) for n in (1, 2, 4))
idots_tq1_0, idots_tq2_0 = sb_idots("tq1_0", _TQ1_BB, _tq1_isums), sb_idots("tq2_0", _TQ2_BB, _tq2_isums)


# =========================================================================================================
# Row functions: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================

# One function per type, not a factory (see legacy.py): closures would never hit numba's cache.


@njit(cache=True)
def rows_tq1_0(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:  # four vectors per decoded super-block, then two, then one (as kquant.py)
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_tq1_0(raw, ro, nsb, xq, xd, xb,
                                                                                      m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_tq1_0(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_tq1_0(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_tq2_0(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_tq2_0(raw, ro, nsb, xq, xd, xb,
                                                                                      m, tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_tq2_0(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_tq2_0(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def integer_dots(code, raw, xqk, xbk, out, tier):
    """int8.integer_dots of TQ1_0 or TQ2_0 weights: out (M, rows, 2 K/256) (tests)."""
    rb, nsb = raw.shape[1], xqk.shape[1] // 256
    for r in range(raw.shape[0]):
        for m in range(out.shape[0]):
            oo, bo = (m * out.shape[1] + r) * out.shape[2], m * nsb * KB_SUMS
            if code == TQ1_0_CODE:
                idots_tq1_0(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, bo, out, oo, tier)
            else:
                idots_tq2_0(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, bo, out, oo, tier)
