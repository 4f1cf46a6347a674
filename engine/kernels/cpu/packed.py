"""Row-interleaved ("R8") layout of the legacy blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) for decode.

GGUF stores each row's blocks one after another, so a matvec over them reads one row at a time and ends every
32-weight block with per-row work: gathering its f16 scales from 18-24 byte strides, shuffling them next to the
products, a horizontal sum per row. On AVX2 that bookkeeping cost more than the multiplies (one thread decoded
~24 G weights/s of Q4_1 and ~16 of Q5_0 when hot). Eight rows interleaved per block make the rows the vector
lanes instead: block b of rows 8g..8g+7 is stored as

    d[8] f16 | m[8] f16 (Q4_1, Q5_1) | fifth bits (Q5_*), 32 bytes | qs, 4 x 32 bytes (Q8_0: 8 x 32)

where qs group j (j = 0..3) holds, for row r at bytes 4r..4r+3, that row's quant bytes 4j..4j+3 (low nibbles:
weights 4j..4j+3, high nibbles: weights 16+4j..16+4j+3), and fifth-bit byte 4r+i holds in bit 2j the fifth bit
of weight 4j+i and in bit 2j+1 that of weight 16+4j+i (Q8_0: group j holds weights 4j..4j+3, signed). One
32-byte load then meets one broadcast 4-byte group
of activations in vpmaddubsw, lane r of vpmaddwd's result belongs to row r, the eight scales are one 16-byte
load, and a fifth bit costs a shift and a mask. Hot, one thread: Q4_1 57 G weights/s, Q5_0 39 (2.4x both),
Q8_0 35 (1.85x).

The packed copy has exactly the bytes of the original (8 rows x block bytes per group); rows past the last full
group of 8 stay in the original layout. It is made once at load into anonymous memory, and the model then
never reads those tensors' mapped pages again (prompts dequantize from it too), so resident memory stays
the file's size. Activations for it are quantized in natural order (quantize_natural_into).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from engine.kernels.cpu.ir import (FLT, I8, I16, I32, Q4_0_CODE, Q4_1_CODE, Q5_0_CODE, Q5_1_CODE, Q8_0_CODE, Emitter,
                                   V, is_arr, tier_of, tier_token)
from engine.kernels.cpu.quantize import quant32
from engine.kernels.quant_types import GGMLType

PACKABLE = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0})
ROWS = 8  # rows per interleaved group
PREFETCH = 1024  # bytes ahead in the group's stream

# code -> (block bytes, d offset, m offset or -1, qh offset or -1, qs offset) in a GGUF block
_SRC = {Q4_0_CODE: (18, 0, -1, -1, 2), Q4_1_CODE: (20, 0, 2, -1, 4), Q5_0_CODE: (22, 0, -1, 2, 6),
        Q5_1_CODE: (24, 0, 2, 4, 8), Q8_0_CODE: (34, 0, -1, -1, 2)}
_CODES = (Q4_0_CODE, Q4_1_CODE, Q5_0_CODE, Q5_1_CODE, Q8_0_CODE)


def _layout(code: int) -> tuple[int, int, int, int]:
    """(group-block bytes, m offset or -1, fifth-bit offset or -1, qs offset) of a packed block of 8 rows."""
    bb, _, mo, qh, _ = _SRC[code]
    m = 16 if mo >= 0 else -1
    hb = (32 if mo >= 0 else 16) if qh >= 0 else -1
    qs = 16 + (16 if mo >= 0 else 0) + (32 if qh >= 0 else 0)
    return 8 * bb, m, hb, qs


_LAYOUT = {c: _layout(c) for c in _SRC}


# =========================================================================================================
# Repacking and dequantizing (numba; once per load, and per prompt chunk)
# =========================================================================================================


@njit(cache=True)
def _src_geometry(code):
    if code == Q8_0_CODE:
        return 34, -1, -1, 2
    if code == Q4_0_CODE:
        return 18, -1, -1, 2
    if code == Q4_1_CODE:
        return 20, 2, -1, 4
    if code == Q5_0_CODE:
        return 22, -1, 2, 6
    return 24, 2, 4, 8  # Q5_1


@njit(cache=True)
def repack_into(raw, code, dst):
    """raw (rows, row bytes) GGUF blocks -> dst (rows // 8 * row bytes,) uint8 in the packed layout.
    Indices are unsigned (numba then drops its negative-index checks) and quants move 4 bytes at a time."""
    bb, mo, qh, qs = _src_geometry(code)
    u = np.uint64
    gbb = u(8 * bb)
    po_m = u(16)
    po_h = u(32 if mo >= 0 else 16)
    po_q = u(16 + (16 if mo >= 0 else 0) + (32 if qh >= 0 else 0))
    nq = 8 if code == Q8_0_CODE else 4
    nb = raw.shape[1] // bb
    dst32 = dst.view(np.uint32)  # packed blocks are multiples of 16 bytes, quants at multiples of 4
    for grp in range(raw.shape[0] // 8):
        for b in range(nb):
            o = u(grp * nb + b) * gbb
            if qh >= 0:
                for k in range(32):
                    dst[o + po_h + u(k)] = 0
            for r in range(8):
                src = raw[grp * 8 + r]
                s = u(b * bb)
                ur = u(r)
                dst[o + u(2) * ur] = src[s]
                dst[o + u(2) * ur + u(1)] = src[s + u(1)]
                if mo >= 0:
                    dst[o + po_m + u(2) * ur] = src[s + u(mo)]
                    dst[o + po_m + u(2) * ur + u(1)] = src[s + u(mo) + u(1)]
                for j in range(nq):
                    a = s + u(qs + 4 * j)
                    v = (np.uint32(src[a]) | (np.uint32(src[a + u(1)]) << np.uint32(8))
                         | (np.uint32(src[a + u(2)]) << np.uint32(16)) | (np.uint32(src[a + u(3)]) << np.uint32(24)))
                    dst32[(o + po_q + u(32 * j) + u(4) * ur) >> u(2)] = v
                if qh >= 0:
                    a = s + u(qh)
                    bits = (np.uint32(src[a]) | (np.uint32(src[a + u(1)]) << np.uint32(8))
                            | (np.uint32(src[a + u(2)]) << np.uint32(16)) | (np.uint32(src[a + u(3)]) << np.uint32(24)))
                    for i in range(4):
                        h = np.uint32(0)
                        for j in range(4):
                            h |= ((bits >> np.uint32(4 * j + i)) & np.uint32(1)) << np.uint32(2 * j)
                            h |= ((bits >> np.uint32(16 + 4 * j + i)) & np.uint32(1)) << np.uint32(2 * j + 1)
                        dst[o + po_h + u(4) * ur + u(i)] = np.uint8(h)


def _quants(e: Emitter, p, off, hb16, j: int) -> list:
    """The unsigned quants of nibble group j at byte off of p: [weights 4j.. of each row (low nibbles), weights
    16+4j.. (high)], <32 x i8> each, lane 4r+i for row r; with fifth bits (hb16, the block's 32 fifth-bit bytes
    as <16 x i16>, or None), bit 2j / 2j+1 of each byte moved to bit 4 (16-bit shifts: the mask drops what
    crosses between the bytes) and or-ed in."""
    b = e.b
    q = e.ld(p, off, V(I8, 32))
    halves = [e.nib_lo(q), e.nib_hi(q)]
    if hb16 is not None:
        for h in range(2):
            k = 2 * j + h
            v = hb16 if k == 4 else (b.shl(hb16, e.splat_c(I16, 4 - k, 16)) if k < 4
                                     else b.lshr(hb16, e.splat_c(I16, k - 4, 16)))
            halves[h] = b.or_(halves[h], b.and_(b.bitcast(v, V(I8, 32)), e.splat_c(I8, 16, 32)))
    return halves


def _dequant_kernel(code: int):
    """Intrinsic (src, g0, g1, cols, out) -> None: row groups [g0, g1) of a packed matrix -> out (8 (g1 - g0),
    cols) f32, with the reference's f32 operations (d * (q - offset), or d * q + m unfused), so bit for bit."""
    gbb, mo, hbo, qso = _LAYOUT[code]
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
                        halves = _quants(e, sp, e.add(o, qso + 32 * j), hb16, j)
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


_d_q4_0, _d_q4_1, _d_q5_0, _d_q5_1, _d_q8_0 = (_dequant_kernel(c) for c in _CODES)


@njit(cache=True)
def dequantize_into(src, code, g0, g1, cols, out):
    """Row groups [g0, g1) of a packed matrix src (flat uint8) -> out (8 (g1 - g0), cols) f32 (C-contiguous),
    equal to dequantizing the original blocks bit for bit."""
    flat = out.reshape(-1)
    if code == Q8_0_CODE:
        _d_q8_0(src, g0, g1, cols, flat)
    elif code == Q4_0_CODE:
        _d_q4_0(src, g0, g1, cols, flat)
    elif code == Q4_1_CODE:
        _d_q4_1(src, g0, g1, cols, flat)
    elif code == Q5_0_CODE:
        _d_q5_0(src, g0, g1, cols, flat)
    else:
        _d_q5_1(src, g0, g1, cols, flat)


@njit(cache=True)
def gather_rows_into(src, code, ids, cols, out):
    """out[k] = row ids[k] (each in a packed group) of a packed matrix: an embedding lookup from the packed
    copy (a whole group is decoded per row: 8x the arithmetic of one row, still microseconds)."""
    scratch = np.empty((8, cols), np.float32)
    for k in range(ids.shape[0]):
        g = ids[k] // 8
        dequantize_into(src, code, g, g + 1, cols, scratch)
        out[k, :] = scratch[ids[k] % 8]


@njit(cache=True)
def quantize_natural_into(x, xq, xs, c0, c1):
    """Columns [c0, c1) (multiples of 32; 0 and K for all) of x (M, K) f32 -> xq (M, K) int8 in natural order,
    xs (M, 2 * K/32) [dx, dx * sum(q)] per block: the same values as quantize.quantize_legacy_into, without its
    pair interleaving (the packed kernels read groups of 4 consecutive activations)."""
    M, K = x.shape
    nb = K // 32
    for m in range(M):
        for blk in range(c0 // 32, c1 // 32):
            o = m * K + blk * 32
            quant32(x, o, xq, o, o + 16, xs, m * 2 * nb + 2 * blk)


# =========================================================================================================
# The kernel: one group of 8 rows against one activation vector
# =========================================================================================================


def _group_kernel(code: int):
    """Intrinsic (w, woff, nb, xq, xoff, xs, soff, out, ooff, tier) -> None: out[ooff + r] (r < 8) = the dot of
    row r of the packed group at byte woff of w (nb blocks) with activations xq[xoff:] (natural order), xs[soff:]
    ([dx, xsum] per block)."""
    gbb, mo, hbo, qso = _LAYOUT[code]
    factor = {Q4_0_CODE: -8.0, Q5_0_CODE: -16.0}.get(code, 0.0)  # on d * xsum; Q*_1 add m * xsum instead, Q8_0 nothing
    five = hbo >= 0

    def impl(typingctx, w, woff, nb, xq, xoff, xs, soff, out, ooff, tier):
        t = tier_of(tier)
        if not (is_arr(w, types.uint8) and is_arr(xq, types.int8) and is_arr(xs, types.float32)
                and is_arr(out, types.float32) and t):
            return None
        ip = types.intp
        sig = types.none(w, ip, ip, xq, ip, xs, ip, out, ip, tier)

        def codegen(context, builder, signature, args):
            e, b = Emitter(context, builder, t), builder
            at = signature.args
            w_, wo, n, x_, xo, s_, so, o_, oo, _ = args
            wp = b.gep(e.base(at[0], w_), [wo], source_etype=I8)
            xp = b.gep(e.base(at[3], x_), [xo], source_etype=I8)
            sp = b.gep(e.base(at[5], s_), [e.mul(so, 4)], source_etype=I8)
            acc, corr = e.fvar(8), e.fvar(8)
            ones = e.splat_c(I16, 1, 16)
            with e.loop(n) as lp:
                o = e.mul(lp.index, gbb)
                for line in range(0, gbb, 64):
                    e.prefetch(wp, e.add(o, PREFETCH + line))
                xb = e.mul(lp.index, 32)
                hb16 = b.bitcast(e.ld(wp, e.add(o, hbo), V(I8, 32)), V(I16, 16)) if five else None
                sums, p16 = [], None
                isum = None
                if code == Q8_0_CODE:  # signed weights: |w| against x with w's sign; pair sums need i32 at once
                    isum = ir.Constant(V(I32, 8), None) if e.tier == "vnni" else None
                    for j in range(8):
                        w8 = e.ld(wp, e.add(o, qso + 32 * j), V(I8, 32))
                        x4 = b.bitcast(e.splat(e.ld(xp, e.add(xb, 4 * j), I32), 8), V(I8, 32))
                        u, sx = e.abs_sign(w8, x4)
                        isum = e.dot4(isum, u, sx)
                for j in range(0 if code == Q8_0_CODE else 4):
                    halves = _quants(e, wp, e.add(o, qso + 32 * j), hb16, j)
                    xs_ = [b.bitcast(e.splat(e.ld(xp, e.add(xb, 16 * h + 4 * j), I32), 8), V(I8, 32)) for h in range(2)]
                    p = b.add(e.madd_u8s8(halves[0], xs_[0]), e.madd_u8s8(halves[1], xs_[1]))
                    p16 = p if p16 is None else b.add(p16, p)
                    # i16 lanes hold at most 2 x 15 x 127 per product pair: 8 pairs fit for 4-bit quants,
                    # 4 for 5-bit ones
                    if five and j == 1:
                        sums.append(p16)
                        p16 = None
                if p16 is not None:
                    sums.append(p16)
                for s in sums:
                    v = e.madd_i16(s, ones)  # lane r: row r
                    isum = v if isum is None else b.add(isum, v)
                d = e.halves(e.ld(wp, o, V(I16, 8)))
                sb = e.mul(lp.index, 8)
                dx = e.splat(e.ld(sp, sb, FLT), 8)
                xsum = e.splat(e.ld(sp, e.add(sb, 4), FLT), 8)
                e.fmacc(acc, b.sitofp(isum, V(FLT, 8)), b.fmul(d, dx))
                if mo >= 0:
                    e.fmacc(corr, e.halves(e.ld(wp, e.add(o, mo), V(I16, 8))), xsum)
                elif factor:
                    e.fmacc(corr, d, b.fmul(xsum, e.splat_c(FLT, factor, 8)))
            op = b.gep(e.base(at[7], o_), [e.mul(oo, 4)], source_etype=I8)
            e.st(op, 0, b.fadd(b.load(acc), b.load(corr)))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_group_{GGMLType(code).name.lower()}"
    return intrinsic(impl)


_g_q4_0, _g_q4_1, _g_q5_0, _g_q5_1, _g_q8_0 = (_group_kernel(c) for c in _CODES)


@njit(cache=True)
def groups_into(code, w, base, nb, g0, g1, xq, xs, out, c0, tier):
    """Row groups [g0, g1) of the packed matrix at byte base of w (nb blocks per row) against all M activation
    vectors (natural order) into out[:, c0 + 8 g ...]; each group stays in L1 across the M vectors."""
    M, R = out.shape
    K, ns = xq.shape[1], xs.shape[1]
    flat = out.reshape(-1)
    gb = nb * _src_geometry(code)[0] * 8  # bytes per group of 8 rows
    for g in range(g0, g1):
        wo = base + g * gb
        for m in range(M):
            oo = m * R + c0 + 8 * g
            if code == Q8_0_CODE:
                _g_q8_0(w, wo, nb, xq, m * K, xs, m * ns, flat, oo, tier)
            elif code == Q4_0_CODE:
                _g_q4_0(w, wo, nb, xq, m * K, xs, m * ns, flat, oo, tier)
            elif code == Q4_1_CODE:
                _g_q4_1(w, wo, nb, xq, m * K, xs, m * ns, flat, oo, tier)
            elif code == Q5_0_CODE:
                _g_q5_0(w, wo, nb, xq, m * K, xs, m * ns, flat, oo, tier)
            else:
                _g_q5_1(w, wo, nb, xq, m * K, xs, m * ns, flat, oo, tier)


@njit(parallel=True, cache=True)
def _groups_parallel(code, w, nb, n_groups, xq, xs, out, n_chunks, tier):
    for ch in prange(n_chunks):
        groups_into(code, w, 0, nb, ch * n_groups // n_chunks, (ch + 1) * n_groups // n_chunks, xq, xs, out, 0, tier)


# =========================================================================================================
# Python side
# =========================================================================================================


def matvec(w, x: np.ndarray, tier: str | None = None) -> np.ndarray:
    """x (M, cols) f32 @ W.T for a QTensor with a packed copy, int8 activations as int8.matvec: the packed
    groups by this module's kernel, the rows past them by int8's. (M, rows) f32."""
    from engine.kernels.cpu import int8

    M, K = x.shape
    n = packed_rows(w.rows)
    out = np.empty((M, w.rows), np.float32)
    xq, xs = np.empty((M, K), np.int8), np.empty((M, 2 * (K // 32)), np.float32)
    quantize_natural_into(x, xq, xs, 0, K)
    _groups_parallel(int(w.ggml_type), w.packed, K // 32, n // ROWS, xq, xs, out,
                     max(1, min(n // ROWS, 4 * numba.config.NUMBA_NUM_THREADS)), tier_token(tier))
    if n < w.rows:
        p = int8.prepare([(w.raw[n:], w.ggml_type)])
        out[:, n:] = int8.matvec(p, int8.quantize(x, p), tier=tier)
    return out



def packed_rows(rows: int) -> int:
    """How many leading rows of a matrix the packed layout holds (whole groups of 8)."""
    return rows // ROWS * ROWS


def dequantize_rows(w, r0: int, r1: int, out: np.ndarray) -> np.ndarray:
    """Rows [r0, r1) of QTensor w (r0 a multiple of 8) -> out (r1 - r0, cols) f32: the packed groups from
    w.packed, the rows past them from w.raw."""
    from engine.kernels.cpu import exact

    n = packed_rows(w.rows) if w.packed is not None else 0
    split = min(max(r0, n), r1)
    if split > r0:
        if r0 % ROWS or split % ROWS:
            raise ValueError(f"packed rows are read in whole groups of {ROWS}, not [{r0}, {split})")
        dequantize_into(w.packed, int(w.ggml_type), r0 // ROWS, -(-split // ROWS), w.cols, out[: split - r0])
    if r1 > split:
        exact.dequantize_into(w.raw[split:r1], w.ggml_type, out[split - r0 :], parallel=False)
    return out


def embed_rows(w, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Rows ids of QTensor w into out (len(ids), cols) f32: from the packed copy where it holds them (so a tied
    embedding/head table's mapped pages stay out of memory), else from raw."""
    from engine.kernels.cpu import exact

    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.rows):
        raise IndexError(f"row ids must be in [0, {w.rows}), got {ids.min()}..{ids.max()}")
    n = packed_rows(w.rows) if w.packed is not None else 0
    inside = ids < n
    if inside.any():
        sel = np.flatnonzero(inside)
        part = np.empty((sel.size, w.cols), np.float32)
        gather_rows_into(w.packed, int(w.ggml_type), ids[sel], w.cols, part)
        out[sel] = part
    if not inside.all():
        sel = np.flatnonzero(~inside)
        out[sel] = exact.dequantize_rows_into(w.raw, w.ggml_type, ids[sel], np.empty((sel.size, w.cols), np.float32))
    return out


def slice_rows(w, r0: int, r1: int):
    """Rows [r0, r1) of QTensor w as a QTensor, keeping its packed copy for the whole groups it covers
    (r0 must then be a multiple of 8)."""
    from engine.kernels.quant_types import QTensor

    part = None
    if w.packed is not None and r0 < packed_rows(w.rows):
        if r0 % ROWS:
            raise ValueError(f"a packed matrix is sliced at multiples of {ROWS} rows, not {r0}")
        rb = w.raw.shape[1]
        part = w.packed[r0 * rb : (r0 + packed_rows(r1 - r0)) * rb]
    return QTensor(w.name, w.ggml_type, (r1 - r0, w.cols), w.raw[r0:r1], part)


def repack(raw: np.ndarray, ggml_type: GGMLType, dst: np.ndarray) -> None:
    """Pack the whole groups of raw (rows, row bytes) into dst (packed_rows(rows) * row bytes,) uint8."""
    code = int(ggml_type)
    if code not in _SRC:
        raise ValueError(f"{GGMLType(code).name} has no packed layout")
    if dst.size != packed_rows(raw.shape[0]) * raw.shape[1]:
        raise ValueError(f"dst holds {dst.size} bytes, the packed rows need {packed_rows(raw.shape[0]) * raw.shape[1]}")
    repack_into(raw, code, dst)
