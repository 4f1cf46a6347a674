"""Integer kernels of the 2- and 3-bit K-quants (Q2_K, Q3_K) against Q8_K-style activations (quantize.py: xqk int8,
xdk f32 scale, xbk int16 sums per super-block), on kquant.py's row-dot and integer-dot factories (the same loop,
prefetching, four vectors per decoded super-block and float steps as Q4_K..Q6_K): rows_q2_k and rows_q3_k (the
signature of kquant.rows_q4_k) and idots_q2_k / idots_q3_k (int8.integer_dots, tests). They stay out of
int8.rows_into's run-time dispatch (quant_types.LOWBIT_TYPES says why); int8's per-combination closures reach them.

Both store 2-bit fields in reference._crumbs' order: in each 128-weight half h, byte l of qs[32h:32h+32] holds
weight 128h + 32j + l in bits 2j, 2j+1, so chunk k = 4h + j (shift 2j, mask 3) meets activations 32k..32k+31 in
one register, and its 16-weight groups are g = 2k, 2k + 1 (lanes 0-15, 16-31).

Integer algebra per super-block (x = int8 activation, dx its scale, bsum16_g the sum of x over group g; every
integer sum is exact in int32: |scale * quant * x| <= 32 * 7 * 127, 256 of them):
  Q2_K (u = 2-bit quant 0..3, sc_g / m_g = low / high nibble of scales[g], d and dmin f16):
    w = d sc_g u - dmin m_g, so dot = d dx sum_g sc_g sum(u x) - dmin dx sum_g m_g bsum16_g
    (integer_dots: [sum_g sc_g sum(u x), sum_g m_g bsum16_g], as Q4_K's pair)
  Q3_K (u = low 2 bits | hmask bit k << 2, 0..7; q = u - 4; s_g = 6-bit scale - 32, d f16):
    w = d s_g (u - 4), so dot = d dx sum_g s_g (sum(u x) - 4 bsum16_g)
    (integer_dots: [that sum, 0], as Q6_K's offset)
Forms (the unpacking, tables and scale shuffles done once per super-block for every vector a row meets):
  Q2_K: the weight bytes become sc_g u (<= 45) before the activations meet them, a lookup (vpshufb) in tables
    [0, s, 2 s, 3 s]; generic IR multiplies bytes. A chunk is then one u8 x s8 dot per vector: vpdpbusd (VNNI), or
    vpmaddubsw pair sums of two chunks added in i16 (AVX2).
  Q3_K: its signed scales times u leave a byte, so Q6_K's form: u8 x s8 pair sums (|.| <= 2 * 7 * 127), then i16
    pairs with the chunk's two group scales.
  In the vnni tier with AVX-512 (BW, VNNI) both take two chunks per 512-bit instruction, and GFNI, where the target
  has it, takes a bit field out of its byte in one instruction: at M = 1 these kernels are bound by vector
  instructions, not by memory (docs/benchmarks.md, "Measurements behind the code", lowbit K-quant forms).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit

from engine.kernels.cpu.ir import I8, I16, I32, Q2_K_CODE, Q3_K_CODE, Emitter, V, target_features
from engine.kernels.cpu.kquant import k_idots, k_rowdot
from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType

CODES = (Q2_K_CODE, Q3_K_CODE)
# Target features beyond a tier's guarantees, read as gemm8.variant reads them (numba compiles for target_features):
# GFNI in the avx2 and vnni tiers, AVX-512 BW + VNNI for the vnni tier's 512-bit form.
_GFNI = "gfni" in target_features()
_WIDE = {"avx512f", "avx512bw", "avx512vnni"} <= target_features()
_V64 = V(I8, 64)


def _wide(e: Emitter) -> bool:
    return _WIDE and e.tier == "vnni"


def _both(e: Emitter, q):
    """<32 x i8> -> <64 x i8>: q twice (the two chunks of a 512-bit pass read the same bytes)."""
    return e.shuf(q, None, list(range(32)) * 2)


def _lanes(tier: str) -> int:
    """Lanes of the integer sums a row dot accumulates (kquant.k_rowdot): 16 in 512 bits."""
    return 16 if _WIDE and tier == "vnni" else 8


def _bits(e: Emitter, q, srcs, dst: int, width: int, extra: int = 0):
    """<32 n x i8> q, n = len(srcs): in its 32-byte part i, bits srcs[i] .. srcs[i] + width - 1 of every byte moved
    to dst .., the other bits 0, or'ed with the constant extra (clear where the field lands). One GFNI affine (a bit
    matrix per 64-bit lane) where the CPU has it, else 16-bit shifts (the mask drops the bits that cross bytes)."""
    b = e.b
    nb = 32 * len(srcs)
    if _GFNI and e.tier != "generic":
        rows = []
        for src in srcs:  # result bit i = parity(matrix byte 7 - i & x) ^ extra's bit i
            r = [0] * 8
            for i in range(width):
                r[7 - (dst + i)] = 1 << (src + i)
            rows += r * 4
        return e.call(f"llvm.x86.vgf2p8affineqb.{8 * nb}", V(I8, nb), [q, e.vc(I8, rows), ir.Constant(I8, extra)])
    w = b.bitcast(q, V(I16, nb // 2))
    if all(src >= dst for src in srcs):
        w = b.lshr(w, e.vc(I16, [src - dst for src in srcs for _ in range(16)]))
    else:  # (the callers' fields move one way in every part)
        w = b.shl(w, e.vc(I16, [dst - src for src in srcs for _ in range(16)]))
    v = b.and_(b.bitcast(w, V(I8, nb)), e.splat_c(I8, ((1 << width) - 1) << dst, nb))
    return b.or_(v, e.splat_c(I8, extra, nb)) if extra else v


def _chunk(e: Emitter, q, j: int, extra: int = 0):
    """<32 x i8> 2-bit field j (bits 2j, 2j+1) of every byte of q (| extra)."""
    return _bits(e, q, (2 * j,), 0, 2, extra)


def _chunk_dots(e: Emitter, us, xs_at, n: int):
    """Per vector the <8 x i32> sums of us[k] x activations k over the 8 chunks of a super-block (us: u8 <= 63, so
    the AVX2 form adds two chunks' pair sums in i16, Emitter.dot4_small); VNNI in two chains of vpdpbusd."""
    b = e.b
    out = []
    for v in range(n):
        if e.tier == "vnni":
            acc = [ir.Constant(V(I32, 8), None)] * 2
            for k, u in enumerate(us):
                acc[k % 2] = e.dot4(acc[k % 2], u, xs_at(v, k))
            out.append(b.add(acc[0], acc[1]))
        else:
            parts = [e.dot4_small(us[k], xs_at(v, k), us[k + 1], xs_at(v, k + 1)) for k in range(0, 8, 2)]
            out.append(b.add(b.add(parts[0], parts[1]), b.add(parts[2], parts[3])))
    return out


def _tables(e: Emitter, sc, order):
    """<16 x i8> scales -> <16 x i32>: dword i the bytes [0, s, 2 s, 3 s] of s = sc[order[i]] (s <= 15)."""
    return e.b.mul(e.b.zext(e.shuf(sc, None, list(order)), V(I32, 16)), e.splat_c(I32, 0x03020100, 16))


def _q2_k_wide(e: Emitter, wp, o, xs_at, bsums, sc, mins):
    # _q2_k in 512 bits: pass (h, p) takes chunks 4h + 2p, 4h + 2p + 1 (64 activations in a row); its 128-bit lane m
    # holds group 4c + m (c = 2h + p), whose table [0, s, 2 s, 3 s] is dword c of lane m of one table for all four
    # passes, so the index is u | 4c
    b = e.b
    n = len(bsums)
    t = b.bitcast(_tables(e, sc, [4 * c + m for m in range(4) for c in range(4)]), _V64)
    acc = [ir.Constant(V(I32, 16), None)] * n
    for h in range(2):
        qz = _both(e, e.ld(wp, e.add(o, 16 + 32 * h), V(I8, 32)))
        for p in range(2):
            idx = _bits(e, qz, (4 * p, 4 * p + 2), 0, 2, 4 * (2 * h + p))
            u = b.bitcast(e.call("llvm.x86.avx512.pshuf.b.512", _V64, [t, idx]), V(I32, 16))
            for v in range(n):
                xw = b.bitcast(xs_at(v, 4 * h + 2 * p, 64), V(I32, 16))
                acc[v] = e.call("llvm.x86.avx512.vpdpbusd.512", V(I32, 16), [acc[v], u, xw])
    return e.halves(e.ld(wp, e.add(o, 80), V(I16, 2))), list(zip(acc, mins))


def _q2_k(e: Emitter, wp, o, xs_at, bsums):
    # block_q2_K (84 B): u8 scales[16] (low nibble sc, high nibble m) | u8 qs[64] | f16 d | f16 dmin
    # The weights' bytes become sc_g * u (<= 45) before any activation meets them, so each chunk is one u8 x s8 dot
    # per vector and no per-group scale step: on AVX2 a lookup (vpshufb) of the chunk's two groups' tables
    # [0, sc, 2 sc, 3 sc]; generic IR multiplies bytes.
    b = e.b
    n = len(bsums)
    packed = e.ld(wp, o, V(I8, 16))
    sc = e.nib_lo(packed)
    mn = b.zext(e.nib_hi(packed), V(I16, 16))
    mins = [e.madd_i16(mn, bsums[v](16, V(I16, 16))) for v in range(n)]  # m_g * bsum16_g (xbk's sums of 16)
    if _wide(e):
        return _q2_k_wide(e, wp, o, xs_at, bsums, sc, mins)
    qs = [e.ld(wp, e.add(o, 16 + 32 * h), V(I8, 32)) for h in range(2)]
    us = []
    if e.tier == "generic":
        for k in range(8):
            gsc = e.shuf(sc, None, [2 * k] * 16 + [2 * k + 1] * 16)
            us.append(b.mul(_chunk(e, qs[k // 4], k % 4), gsc))
    else:
        # dword g: bytes [0, sc_g, 2 sc_g, 3 sc_g]; half h's table holds groups 8h + 2j (+1 in the high 128 bits) at
        # bytes 4j..4j+3, so chunk j of half h looks up u | 4j
        order = [8 * h + 2 * j + lane for h in range(2) for lane in (0, 1) for j in range(4)]
        tab = _tables(e, sc, order)
        for h in range(2):
            t = b.bitcast(e.shuf(tab, None, range(8 * h, 8 * h + 8)), V(I8, 32))
            for j in range(4):
                us.append(e.call("llvm.x86.avx2.pshuf.b", V(I8, 32), [t, _chunk(e, qs[h], j, 4 * j)]))
    isums = _chunk_dots(e, us, xs_at, n)
    return e.halves(e.ld(wp, e.add(o, 80), V(I16, 2))), list(zip(isums, mins))


def _q3_scales(e: Emitter, wp, o) -> ir.Value:
    """The 16 6-bit scales at o+96 minus 32 -> <16 x i16> (reference._q3_k): low 4 bits of groups 0-7 in the low
    nibbles of bytes 0-7, of groups 8-15 in their high nibbles; top 2 bits of group g at bits 2 (g // 4) of byte
    8 + g % 4. Four words of four groups each, as _k4_scales does for Q4_K."""
    b = e.b
    c = lambda v: ir.Constant(I32, v)  # noqa: E731
    a0, a1, top = (e.ld(wp, e.add(o, 96 + 4 * j), I32) for j in range(3))
    low = (b.and_(a0, c(0x0F0F0F0F)), b.and_(a1, c(0x0F0F0F0F)),
           b.and_(b.lshr(a0, c(4)), c(0x0F0F0F0F)), b.and_(b.lshr(a1, c(4)), c(0x0F0F0F0F)))
    v = ir.Constant(V(I32, 4), None)
    for j, w in enumerate(low):
        hi = b.and_(b.lshr(top, c(2 * j)) if j else top, c(0x03030303))
        v = b.insert_element(v, b.or_(w, b.shl(hi, c(4))), ir.Constant(I32, j))
    return b.sub(b.zext(b.bitcast(v, V(I8, 16)), V(I16, 16)), e.splat_c(I16, 32, 16))


def _q3_k_wide(e: Emitter, wp, o, xs_at, isums, sc):
    # _q3_k in 512 bits, chunks in pairs as _q2_k_wide: lane m of pass c = 2h + p holds group 4c + m, whose scale is
    # word c of lane m of one scale table (an in-lane vpshufb per pass)
    b = e.b
    n = len(isums)
    tab = e.shuf(sc, None, [4 * c + m for m in range(4) for c in list(range(4)) * 2])  # <32 x i16>
    tab = b.bitcast(tab, _V64)
    hmz = _both(e, e.ld(wp, o, V(I8, 32)))
    acc = [e.shuf(isum, ir.Constant(isum.type, None), range(16)) for isum in isums]  # the -4 terms, widened
    for h in range(2):
        qz = _both(e, e.ld(wp, e.add(o, 32 + 32 * h), V(I8, 32)))
        for p in range(2):
            c, k = 2 * h + p, 4 * h + 2 * p
            u = b.or_(_bits(e, qz, (4 * p, 4 * p + 2), 0, 2), _bits(e, hmz, (k, k + 1), 2, 1))
            pick = e.vc(I8, [2 * c + i for i in range(2)] * 32)
            gsc = b.bitcast(e.call("llvm.x86.avx512.pshuf.b.512", _V64, [tab, pick]), V(I32, 16))
            for v in range(n):
                pairs = e.call("llvm.x86.avx512.pmaddubs.w.512", V(I16, 32), [u, xs_at(v, k, 64)])
                acc[v] = e.call("llvm.x86.avx512.vpdpwssd.512", V(I32, 16), [acc[v], b.bitcast(pairs, V(I32, 16)), gsc])
    return acc


def _q3_k(e: Emitter, wp, o, xs_at, bsums):
    # block_q3_K (110 B): u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d; the third bit of chunk k's weight l is
    # bit k of hmask[l]. The signed scales (-32..31) times u (0..7) leave bytes, so Q6_K's form: u8 x s8 pair sums,
    # then i16 pairs with the chunk's two group scales.
    b = e.b
    n = len(bsums)
    sc = _q3_scales(e, wp, o)
    sc4 = b.mul(sc, e.splat_c(I16, -4, 16))  # every weight's -4 (|-4 s| <= 128: i16)
    isums = [e.madd_i16(sc4, bsums[v](16, V(I16, 16))) for v in range(n)]
    dw = e.halves(e.ld(wp, e.add(o, 108), V(I16, 1)))
    if _wide(e):
        return dw, [(isum, None) for isum in _q3_k_wide(e, wp, o, xs_at, isums, sc)]
    hm = e.ld(wp, o, V(I8, 32))
    for k in range(8):
        q = e.ld(wp, e.add(o, 32 + 32 * (k // 4)), V(I8, 32))
        u = b.or_(_chunk(e, q, k % 4), _bits(e, hm, (k,), 2, 1))
        gsc = e.shuf(sc, None, [2 * k] * 8 + [2 * k + 1] * 8)  # once for every vector
        for v in range(n):
            part = e.madd_i16(e.madd_u8s8(u, xs_at(v, k)), gsc)
            isums[v] = b.add(isums[v], part)
    return dw, [(isum, None) for isum in isums]


_BB = {c: BLOCK_GEOMETRY[GGMLType(c)][1] for c in CODES}
_rd1_q2_k, _rd2_q2_k, _rd4_q2_k = (k_rowdot("q2_k", _BB[Q2_K_CODE], _q2_k, n, min_lanes=8, lanes=_lanes)
                                   for n in (1, 2, 4))
_rd1_q3_k, _rd2_q3_k, _rd4_q3_k = (k_rowdot("q3_k", _BB[Q3_K_CODE], _q3_k, n, lanes=_lanes) for n in (1, 2, 4))
idots_q2_k = k_idots("q2_k", _BB[Q2_K_CODE], _q2_k)
idots_q3_k = k_idots("q3_k", _BB[Q3_K_CODE], _q3_k)


# =========================================================================================================
# Row functions: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================

# One function per type, as kquant.py's (closures would never hit numba's cache); vectors four, two, then one at a
# time, each vector's result bit for bit its result alone.


@njit(cache=True)
def rows_q2_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_q2_k(raw, ro, nsb, xq, xd, xb, m,
                                                                                     tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_q2_k(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_q2_k(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def rows_q3_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    nsb, M = xq.shape[1] // 256, out.shape[0]
    for r in range(r0, r1):
        ro, col, m = base + r * rb, c0 + r, 0
        while m + 4 <= M:
            out[m, col], out[m + 1, col], out[m + 2, col], out[m + 3, col] = _rd4_q3_k(raw, ro, nsb, xq, xd, xb, m,
                                                                                     tier)
            m += 4
        if m + 2 <= M:
            out[m, col], out[m + 1, col] = _rd2_q3_k(raw, ro, nsb, xq, xd, xb, m, tier)
            m += 2
        if m < M:
            out[m, col] = _rd1_q3_k(raw, ro, nsb, xq, xd, xb, m, tier)


@njit(cache=True)
def integer_dots_into(code, raw, xqk, xbk, out, tier):
    """int8.integer_dots for Q2_K / Q3_K (tests): out (M, rows, 2 * K/256) int32, kquant's pair per super-block."""
    rb, nsb = raw.shape[1], xqk.shape[1] // 256
    for r in range(raw.shape[0]):
        for m in range(out.shape[0]):
            oo = (m * out.shape[1] + r) * out.shape[2]
            if code == Q2_K_CODE:
                idots_q2_k(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, m * nsb * 24, out, oo, tier)
            else:
                idots_q3_k(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, m * nsb * 24, out, oo, tier)
