"""Activation quantization: an input x (M, K) f32 (M >= 1 vectors that share every weight read) to the int8
blocks the integer kernels read, once per input, in numba (exact f32 arithmetic, so the numpy reference matches
bit for bit).

  legacy blocks of 32 (for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4; legacy.py), "Q8_0-style":
    xq8 (M, K) int8    q = rint(x / dx), dx = amax / 127 per block, so |q| <= 127
    xs8 (M, 2 * nb) f32 per block [dx, xsum] with xsum = dx * sum(q) (the min / offset term)
    Blocks are stored in pairs with their halves interleaved (x[A 0:16], x[B 0:16], x[A 16:32], x[B 16:32]),
    so one 32-byte load of two blocks' nibbles meets its activations in one register (legacy_x_order()).
  K-quant super-blocks of 256 (for Q4_K, Q5_K, Q6_K; kquant.py), "Q8_K-style" as ggml:
    xqk (M, K) int8, xdk (M, K/256) f32 scale, xbk (M, K/256, 24) int16: 8 sums per 32, then 16 per 16.
  F32/F16/BF16 weights take the f32 activations as they are (an f32 dot; int8.py).

quantize_legacy_into and quantize_k_into are njit-callable (column ranges, for the compiled decode step);
quant32, one block of 32, also serves packed.py's natural-order quantization.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from engine.kernels.cpu.ir import FLT, I8, I16, I32, Emitter, V, is_arr

QK = 32  # weights per legacy block
QK_K = 256  # weights per K super-block
KB_SUMS = 24  # int16 sums per K super-block in xbk: 8 over 32 weights, then 16 over 16

# Each block is one IR intrinsic with explicit vector ops (a numba loop over 32 floats would be scalarized).
# Plain IEEE ops, no fast-math flags: amax / 127, 1 / d, x * inv and rint round exactly as the numpy reference.
# (NaN inputs give unspecified quants: maxnum skips NaNs where numpy's max propagates them.)


def _quant_vec(e: Emitter, v, inv) -> ir.Value:
    """<n x float> -> <n x i32>: rint(v * inv)."""
    n = v.type.count
    r = e.call(f"llvm.rint.v{n}f32", v.type, [e.b.fmul(v, e.splat(inv, n))])
    return e.b.fptosi(r, V(I32, n))


def _scale_of(e: Emitter, amax):
    """d = amax / 127 and inv = 1 / d (0 when d is 0)."""
    b = e.b
    d = b.fdiv(amax, ir.Constant(FLT, 127.0))
    inv = b.select(b.fcmp_ordered(">", d, ir.Constant(FLT, 0.0)), b.fdiv(ir.Constant(FLT, 1.0), d),
                   ir.Constant(FLT, 0.0))
    return d, inv


def _absmax(e: Emitter, vs) -> ir.Value:
    n = vs[0].type.count
    m = e.call(f"llvm.fabs.v{n}f32", vs[0].type, [vs[0]])
    for v in vs[1:]:
        m = e.call(f"llvm.maxnum.v{n}f32", m.type, [m, e.call(f"llvm.fabs.v{n}f32", v.type, [v])])
    return e.call(f"llvm.vector.reduce.fmax.v{n}f32", FLT, [m])


@intrinsic
def quant32(typingctx, x, xo, xq, lo, hi, xs, so):
    """x[xo:xo+32] (flat f32 offset) -> int8 q of weights 0-15 at xq[lo:], 16-31 at xq[hi:]; xs[so] = d,
    xs[so + 1] = d * sum(q)."""
    if not (is_arr(x, types.float32) and is_arr(xq, types.int8) and is_arr(xs, types.float32)):
        return None
    sig = types.none(x, types.intp, xq, types.intp, types.intp, xs, types.intp)

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder, "generic")
        b = builder
        at = signature.args
        x_, xo_, xq_, lo_, hi_, xs_, so_ = args
        v = e.ld(e.base(at[0], x_), e.mul(xo_, 4), V(FLT, 32), align=4)
        d, inv = _scale_of(e, _absmax(e, [v]))
        qi = _quant_vec(e, v, inv)
        q8 = b.trunc(qi, V(I8, 32))
        qp = e.base(at[2], xq_)
        e.st(qp, lo_, e.shuf(q8, None, range(16)))
        e.st(qp, hi_, e.shuf(q8, None, range(16, 32)))
        sp = e.base(at[5], xs_)
        e.st(sp, e.mul(so_, 4), d)
        e.st(sp, e.mul(e.add(so_, 1), 4), b.fmul(d, b.sitofp(e.hsum_i(qi), FLT)))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _quant256(typingctx, x, xo, xq, qo, xd, do, xb, bo):
    """x[xo:xo+256] -> int8 q at xq[qo:], d at xd[do], at xb[bo:] (int16) 8 sums over 32 then 16 over 16."""
    if not (is_arr(x, types.float32) and is_arr(xq, types.int8) and is_arr(xd, types.float32)
            and is_arr(xb, types.int16)):
        return None
    sig = types.none(x, types.intp, xq, types.intp, xd, types.intp, xb, types.intp)

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder, "generic")
        b = builder
        at = signature.args
        x_, xo_, xq_, qo_, xd_, do_, xb_, bo_ = args
        xp = b.gep(e.base(at[0], x_), [e.mul(xo_, 4)], source_etype=I8)
        vs = [e.ld(xp, 128 * c, V(FLT, 32), align=4) for c in range(8)]
        d, inv = _scale_of(e, _absmax(e, vs))
        qp = b.gep(e.base(at[2], xq_), [qo_], source_etype=I8)
        bp = b.gep(e.base(at[6], xb_), [e.mul(bo_, 2)], source_etype=I8)
        for c, v in enumerate(vs):
            qi = _quant_vec(e, v, inv)
            e.st(qp, 32 * c, b.trunc(qi, V(I8, 32)))
            s0, s1 = e.hsum_i(e.shuf(qi, None, range(16))), e.hsum_i(e.shuf(qi, None, range(16, 32)))
            e.st(bp, 2 * c, b.trunc(b.add(s0, s1), I16))
            e.st(bp, 2 * (8 + 2 * c), b.trunc(s0, I16))
            e.st(bp, 2 * (9 + 2 * c), b.trunc(s1, I16))
        e.st(e.base(at[4], xd_), e.mul(do_, 4), d)
        return context.get_dummy_value()

    return sig, codegen


def legacy_x_order(K: int) -> np.ndarray:
    """Index array: legacy activations are stored as xq8[:, j] = q[:, order[j]] (pairs of blocks interleaved
    in 16-weight halves; an odd last block stays in natural order)."""
    nb = K // QK
    order = np.arange(K)
    pairs = nb // 2
    if pairs:
        # (pair, block in pair, half, 16) -> (pair, half, block in pair, 16)
        order[: pairs * 64] = order[: pairs * 64].reshape(pairs, 2, 2, 16).transpose(0, 2, 1, 3).reshape(-1)
    return order


@njit(cache=True)
def quantize_legacy_into(x, xq, xs, c0, c1):
    """Columns [c0, c1) (multiples of 64, or c1 = K; 0 and K for all) of x (M, K) f32 -> xq (M, K) int8 in
    pair-interleaved order, xs (M, 2 * K/32) f32 [dx, dx * sum(q)] per block."""
    M, K = x.shape
    nb = K // 32
    paired = nb // 2 * 2
    for m in range(M):
        for blk in range(c0 // 32, c1 // 32):
            if blk < paired:
                lo = m * K + (blk // 2) * 64 + (blk % 2) * 16
                hi = lo + 32
            else:
                lo = m * K + blk * 32
                hi = lo + 16
            quant32(x, m * K + blk * 32, xq, lo, hi, xs, m * 2 * nb + 2 * blk)


@njit(cache=True)
def quantize_k_into(x, xq, xd, xb, c0, c1):
    """Columns [c0, c1) (multiples of 256; 0 and K for all) of x (M, K) f32 -> xq (M, K) int8, xd (M, K/256)
    f32, xb (M, K/256, 24) int16 (8 sums of 32, 16 of 16)."""
    M, K = x.shape
    nsb = K // 256
    for m in range(M):
        for sb in range(c0 // 256, c1 // 256):
            o = m * K + sb * 256
            _quant256(x, o, xq, o, xd, m * nsb + sb, xb, (m * nsb + sb) * 24)
