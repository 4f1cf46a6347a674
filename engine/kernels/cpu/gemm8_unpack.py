"""The weight side of the int8 prompt GEMM (gemm8.py): a group of R rows unpacked into the layout its tile kernel
reads. Per weight type, each row's quants as unsigned bytes u in column order and, per sub-block j, w = a_j u - b_j:
a_j and b_j as f32 (ws), a_j's integer part for the 256-bit form's int16 products (wi, twice as two i16) and the
super-block's d (wd). The block layouts are reference.py's; the types and their (a, b) are in each unpacker's line.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels.cpu import gemm8_lattice
from engine.kernels.cpu.dequant import f16_at, k_scale_min
from engine.kernels.cpu.dequant_lattice import (IQ1_M_CODE, IQ1_S_CODE, IQ2_S_CODE, IQ2_XS_CODE, IQ2_XXS_CODE,
                                                IQ3_S_CODE, IQ3_XXS_CODE)
from engine.kernels.cpu.ir import (I8, I32, IQ4_XS_CODE, Q2_K_CODE, Q3_K_CODE, Q4_K_CODE, Q5_K_CODE, Q6_K_CODE,
                                   TQ1_0_CODE, TQ2_0_CODE, V, Emitter, is_arr)
from engine.kernels.cpu.quantize import QK_K
from engine.kernels.reference import IQ4_NL_VALUES


def unpack(form, raw, code, r0, rows, nsb, u, tile, ws, wi, wd):
    """Rows [r0, r0 + R) of raw (R = ws.shape[2], the tile's rows, the form's; past `rows` zero scales) -> tile
    (their quants u, layout above), ws (sub-blocks, 2, R) f32 (each sub-block's scale and min term), wi (sub-blocks,
    R) i32 (its integer scale as two i16) and wd (nsb, R) f32 (each super-block's d); u: scratch (4 K,) uint8.
    The quants go straight into the tile (_quant_tile), TQ1_0's (base 3) through u, a row at a time, the lattice
    types' a row at a time too (gemm8_lattice.py; u then holds a row's f32 weights).
    Plain Python: inlined into each type's GEMM (gemm8._gemm_of) with its code a constant, the other types pruned."""
    t32 = tile.view(np.uint32)
    u32 = u.view(np.uint32)
    R = ws.shape[2]
    for r in range(R):
        if r0 + r >= rows:
            u[:] = 0
            ws[:, :, r] = 0.0
            wi[:, r] = 0
            wd[:, r] = 0.0
        elif code == Q6_K_CODE:
            _scales_q6_k(raw[r0 + r], nsb, ws, wi, wd, r)
        elif code == Q2_K_CODE:
            _scales_q2_k(raw[r0 + r], nsb, ws, wi, wd, r)
        elif code == Q3_K_CODE:
            _scales_q3_k(raw[r0 + r], nsb, ws, wi, wd, r)
        elif code == IQ4_XS_CODE:
            _scales_iq4_xs(raw[r0 + r], nsb, ws, wi, wd, r)
        elif code == TQ1_0_CODE:
            _unpack_tq1_0(raw[r0 + r], nsb, u, ws, wi, wd, r)
        elif (code == IQ2_XXS_CODE or code == IQ2_XS_CODE or code == IQ2_S_CODE or code == IQ3_XXS_CODE
              or code == IQ3_S_CODE or code == IQ1_S_CODE or code == IQ1_M_CODE):
            _unpack_lattice(raw[r0 + r], code, nsb, u, tile, ws, wi, wd, r)
        elif code == TQ2_0_CODE:
            for sb in range(nsb):
                _ternary_scales(ws, wi, wd, sb, r, f16_at(raw[r0 + r], sb * 66 + 64))  # qs[64] | f16 d
        else:
            _scales_q45_k(raw[r0 + r], code, nsb, ws, wi, wd, r)
        if code == TQ1_0_CODE:  # (base-3 digits: no SIMD form yet)
            for i in range(nsb * QK_K // 4):  # 4 columns at a time into their group
                t32[i * R + r] = u32[i]
    if code == Q4_K_CODE:
        _tile_q4_k(form, raw, r0, nsb, tile)
    elif code == Q5_K_CODE:
        _tile_q5_k(form, raw, r0, nsb, tile)
    elif code == Q6_K_CODE:
        _tile_q6_k(form, raw, r0, nsb, tile)
    elif code == Q2_K_CODE:
        _tile_q2_k(form, raw, r0, nsb, tile)
    elif code == Q3_K_CODE:
        _tile_q3_k(form, raw, r0, nsb, tile)
    elif code == IQ4_XS_CODE:
        _tile_iq4_xs(form, raw, r0, nsb, tile)
    elif code == TQ2_0_CODE:
        _tile_tq2_0(form, raw, r0, nsb, tile)


_unpack_lattice = njit(inline="always")(gemm8_lattice.unpack)


@njit(cache=True)
def _scales_q45_k(src, code, nsb, ws, wi, wd, r):
    """Q4_K/Q5_K: w = d sc_j u - dmin m_j per sub-block j of 32 (u: 4 bits, Q5_K's fifth from qh: _quant_tile)."""
    bb = 176 if code == Q5_K_CODE else 144  # bytes per super-block
    for sb in range(nsb):
        o = sb * bb
        d, dmin = f16_at(src, o), f16_at(src, o + 2)
        wd[sb, r] = d
        for j in range(8):
            sc, m = k_scale_min(src, o + 4, j)
            wi[sb * 8 + j, r] = sc | (sc << 16)
            ws[sb * 8 + j, 0, r] = d * np.float32(sc)
            ws[sb * 8 + j, 1, r] = dmin * np.float32(m)


@njit(cache=True)
def _scales_q6_k(src, nsb, ws, wi, wd, r):
    """Q6_K: w = d sc_g (u - 32) per sub-block g of 16 (u: 6 bits), so the scale is d sc_g and the min term
    32 d sc_g."""
    for sb in range(nsb):
        o = sb * 210  # ql[128] | qh[64] | i8 scales[16] | f16 d
        d = f16_at(src, o + 208)
        wd[sb, r] = d
        for g in range(16):
            isc = (np.int32(src[o + 192 + g]) ^ 128) - 128
            _scales(ws, wi, sb * 16 + g, r, d * np.float32(isc), np.float32(32.0) * d * np.float32(isc), isc)


@njit(cache=True, inline="always")
def _scales(ws, wi, j, r, a, b, isc):
    """Sub-block j of row r: w = a u - b (f32), a's integer part isc (twice, as two i16) for the 256-bit form."""
    ws[j, 0, r] = a
    ws[j, 1, r] = b
    wi[j, r] = np.int32((isc & 0xFFFF) | (isc << 16))


@njit(cache=True)
def _scales_q2_k(src, nsb, ws, wi, wd, r):
    """Q2_K: w = d sc_g u - dmin m_g per sub-block g of 16 (u: 2 bits)."""
    for sb in range(nsb):
        o = sb * 84  # scales[16] | qs[64] | f16 d | f16 dmin
        d, dmin = f16_at(src, o + 80), f16_at(src, o + 82)
        wd[sb, r] = d
        for g in range(16):
            sc, m = np.int32(src[o + g] & 15), np.int32(src[o + g] >> 4)
            _scales(ws, wi, sb * 16 + g, r, d * np.float32(sc), dmin * np.float32(m), sc)


@njit(cache=True)
def _scales_q3_k(src, nsb, ws, wi, wd, r):
    """Q3_K: w = d s_g (u - 4) per sub-block g of 16, u = low 2 bits | hmask bit << 2 (0..7), s_g signed."""
    for sb in range(nsb):
        o = sb * 110  # hmask[32] | qs[64] | scales[12] | f16 d
        d = f16_at(src, o + 108)
        wd[sb, r] = d
        for g in range(16):
            lo = (np.int32(src[o + 96 + g]) & 15) if g < 8 else (np.int32(src[o + 88 + g]) >> 4)
            hi = (np.int32(src[o + 104 + g % 4]) >> (2 * (g // 4))) & 3
            sc = (lo | (hi << 4)) - 32
            a = d * np.float32(sc)
            _scales(ws, wi, sb * 16 + g, r, a, np.float32(4.0) * a, sc)


# The types whose min term is c times the scale (w = a_j (u - c)), by code: (c, columns of a sub-block). The 512-bit
# form sums (u - c) x in int32 for them (gemm8._symmetric_tile).
OFFSETS = {IQ4_XS_CODE: (128, 32), Q6_K_CODE: (32, 16), Q3_K_CODE: (4, 16), TQ1_0_CODE: (1, 32), TQ2_0_CODE: (1, 32),
           **gemm8_lattice.OFFSETS}

IQ4_LEVELS = tuple(int(v) + 128 for v in IQ4_NL_VALUES)  # the codebook's levels as unsigned quants u


@njit(cache=True)
def _scales_iq4_xs(src, nsb, ws, wi, wd, r):
    """IQ4_XS: w = d ls_s (u - 128) per sub-block s of 32, u = a codebook level + 128 (512-bit form only); the
    tile holds the levels' indices (_quant_tile), which the kernel looks up (one vpshufb a register)."""
    for sb in range(nsb):
        o = sb * 136  # f16 d | u16 scales_h | scales_l[4] | qs[128]
        d = f16_at(src, o)
        wd[sb, r] = d
        high = np.int32(src[o + 2]) | (np.int32(src[o + 3]) << 8)
        for s in range(8):
            ls = (((np.int32(src[o + 4 + s // 2]) >> (4 * (s % 2))) & 15) | (((high >> (2 * s)) & 3) << 4)) - 32
            a = d * np.float32(ls)
            _scales(ws, wi, sb * 8 + s, r, a, np.float32(128.0) * a, ls)


def _quant_tile(code: int):
    """A type's quants (IQ4_XS: its codebook indices) straight into the tile layout, R rows at a time in SIMD:
    (form, raw, r0, nsb, tile), R = the form's rows (gemm8.TILE). Per 32 columns, each row's 32 quants (one 256-bit
    register, _quants32) and then a transpose of the R x 8 groups of 4 bytes into the tile's groups (R x 4 bytes
    each) by two-register shuffles (vpermt2d). Rows past the matrix repeat its last (their scales are zero).
    Why: a row at a time through u in scalar code (numba vectorizes none of those short loops: src and u may
    alias) took a sixth of a prompt matmul; this, a twenty-fifth (docs/benchmarks.md, "Measurements behind the code",
    gemm8 quant tiles)."""

    def impl(typingctx, form, raw, r0, nsb, tile):
        if not (isinstance(form, types.Integer) and form.bitwidth in (16, 32) and isinstance(raw, types.Array)
                and raw.ndim == 2 and raw.dtype == types.uint8 and raw.layout == "C" and is_arr(tile, types.uint8)):
            return None
        R = 16 if form.bitwidth == 32 else 8
        sig = types.none(form, raw, types.intp, types.intp, tile)

        def codegen(context, builder, signature, args):
            e, b = Emitter(context, builder, "vnni" if R == 16 else "avx2"), builder
            _, rw, first, n, tl = args
            arr = context.make_array(signature.args[1])(context, builder, rw)
            nrows, stride = cgutils.unpack_tuple(b, arr.shape)[0], cgutils.unpack_tuple(b, arr.strides)[0]
            base, tp = b.bitcast(arr.data, I8.as_pointer()), e.base(signature.args[4], tl)
            last = b.sub(nrows, e.i64(1))
            rowp = []
            for r in range(R):
                rr = b.add(first, e.i64(r))
                rr = b.select(b.icmp_signed("<", rr, last), rr, last)
                rowp.append(b.gep(base, [b.mul(rr, stride)], source_etype=I8))
            with e.loop(e.mul(n, 8)) as lp:  # sub-blocks of 32 columns, over all super-blocks
                j = lp.index
                sb, k = b.udiv(j, e.i64(8)), b.urem(j, e.i64(8))
                quants = [_quants32(e, code, p, sb, k) for p in rowp]
                for g, v in _transpose(e, quants):
                    e.st(tp, e.add(e.mul(j, 32 * R), g * R * 4), v)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_quant_tile_{code}"
    return intrinsic(impl)


def _quants32(e, code, p, sb, k):
    """<32 x i8>: the quants of columns 32 k .. 32 k + 31 of super-block sb of the row at p (reference.py's
    layouts, as in the row decoders)."""
    b, v32 = e.b, V(I8, 32)

    def at(off, k_off):  # 32 bytes at byte off + k_off of the super-block
        return e.ld(p, e.add(e.add(e.mul(sb, SUPER_BLOCK_BYTES[code]), off), k_off), v32)

    def field(v, shift, mask):  # (v >> shift) & mask, shift an i64 value
        return b.and_(b.lshr(v, e.splat(b.trunc(shift, I8), 32)), e.splat_c(I8, mask, 32))

    half, quarter = b.lshr(k, e.i64(2)), b.and_(k, e.i64(3))  # k = 4 half + quarter
    if code == IQ4_XS_CODE:  # 16 bytes: low nibbles are weights 0..15, high ones 16..31
        v = e.ld(p, e.add(e.add(e.mul(sb, 136), 8), e.mul(k, 16)), V(I8, 16))
        return e.shuf(e.nib_lo(v), e.nib_hi(v), range(32))
    if code in (Q4_K_CODE, Q5_K_CODE):  # nibble k % 2 of the 32 bytes at qs + 32 (k // 2)
        u = field(at(48 if code == Q5_K_CODE else 16, e.mul(b.lshr(k, e.i64(1)), 32)), e.mul(b.and_(k, e.i64(1)), 4),
                  15)
        if code == Q5_K_CODE:  # the fifth bit of weight c is bit k of qh[c]
            u = b.or_(u, b.shl(field(at(16, 0), k, 1), e.splat_c(I8, 4, 32)))
        return u
    if code == Q6_K_CODE:  # nibble quarter // 2 of ql[64 half + 32 (quarter % 2)], and field quarter of
        # qh[32 half] as bits 4-5
        lo = field(at(0, e.add(e.mul(half, 64), e.mul(b.and_(quarter, e.i64(1)), 32))),
                   e.mul(b.lshr(quarter, e.i64(1)), 4), 15)
        return b.or_(lo, b.shl(field(at(128, e.mul(half, 32)), e.mul(quarter, 2), 3), e.splat_c(I8, 4, 32)))
    # the 2-bit fields (Q2_K, Q3_K, TQ2_0: reference._crumbs): field `quarter` of the 32 bytes of half `half`
    u = field(at({Q2_K_CODE: 16, Q3_K_CODE: 32, TQ2_0_CODE: 0}[code], e.mul(half, 32)), e.mul(quarter, 2), 3)
    if code == Q3_K_CODE:  # the third bit: bit k of hmask[c]
        u = b.or_(u, b.shl(field(at(0, 0), k, 1), e.splat_c(I8, 2, 32)))
    return u


def _transpose(e, rows):
    """R rows of 8 groups (4 bytes each, <32 x i8>) -> [(first group, <16 x i32>)]: the groups in the tile's order
    (group-major, R rows within). Pairs of registers holding the same groups and neighbouring rows are merged,
    each pair's 32 lanes sorted by (group, row) into two: log2(R / 2) rounds of R / 2 shuffles."""
    b, v8 = e.b, V(I32, 8)
    regs = [(e.shuf(b.bitcast(rows[k], v8), b.bitcast(rows[k + 1], v8), range(16)),
             [(k, g) for g in range(8)] + [(k + 1, g) for g in range(8)]) for k in range(0, len(rows), 2)]
    while len({r for r, _ in regs[0][1]}) < len(rows):
        by_groups = {}
        for reg in regs:
            by_groups.setdefault(frozenset(g for _, g in reg[1]), []).append(reg)
        regs = []
        for same in by_groups.values():
            same.sort(key=lambda reg: min(reg[1]))
            for (va, la), (vb, lb) in zip(same[0::2], same[1::2]):
                lanes = sorted(la + lb, key=lambda rg: (rg[1], rg[0]))
                for half in (lanes[:16], lanes[16:]):
                    regs.append((e.shuf(va, vb, [(la + lb).index(x) for x in half]), half))
    return [(labels[0][1], v) for v, labels in regs]


SUPER_BLOCK_BYTES = {Q4_K_CODE: 144, Q5_K_CODE: 176, Q6_K_CODE: 210, Q2_K_CODE: 84, Q3_K_CODE: 110, IQ4_XS_CODE: 136,
                     TQ2_0_CODE: 66}
_tile_q4_k, _tile_q5_k, _tile_q6_k, _tile_q2_k, _tile_q3_k, _tile_iq4_xs, _tile_tq2_0 = (
    _quant_tile(c) for c in SUPER_BLOCK_BYTES)


@njit(cache=True)
def _unpack_tq1_0(src, nsb, u, ws, wi, wd, r):
    """TQ1_0: w = d (u - 1), u a base-3 digit (reference._trits: digit t of byte l is weight n t + l for the n
    bytes of a run)."""
    for sb in range(nsb):
        o = sb * 54  # qs[48] | qh[4] | f16 d
        _ternary_scales(ws, wi, wd, sb, r, f16_at(src, o + 52))
        y = sb * QK_K
        for q0, n, k, y0 in ((0, 32, 5, 0), (32, 16, 5, 160), (48, 4, 4, 240)):
            p = 1
            for t in range(k):
                for c in range(n):
                    u[y + y0 + n * t + c] = (((np.int32(src[o + q0 + c]) * p) & 255) * 3) >> 8
                p *= 3


@njit(cache=True, inline="always")
def _ternary_scales(ws, wi, wd, sb, r, d):
    wd[sb, r] = d
    for j in range(8):
        _scales(ws, wi, sb * 8 + j, r, d, d, 1)
