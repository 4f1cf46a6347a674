"""Prompt matmuls (T input rows at once) in int8: the fast path's prefill for K-quant matrices (Q4_K, Q5_K, Q6_K;
the low-bit Q2_K, Q3_K, TQ1_0, TQ2_0, the lattice types, and IQ4_XS in the 512-bit form: their unpacking,
gemm8_unpack.py and gemm8_lattice.py).

Why: a prompt through dequantized f32 weights and sgemm runs at the f32 FMA peak (8 MACs per 256-bit FMA, 16 per
512-bit); int8 does more per instruction (`vpdpbusd` on 512 bits: 64; AVX2's `vpmaddubsw`: 32 into int16 pairs),
and llama.cpp's prefill on K-quants is integer. On the Qwen2.5-1.5B shape (mostly Q4_K), sgemm left goinfer's
prefill behind llama.cpp's (docs/benchmarks.md, "Measurements behind the code", gemm8 why).

The math is the decode matvec's (kquant.py), so a prompt and a decoded token see the same numbers: the input
quantized as Q8_K (int8 per 256 columns, quantize.py), the weights' own unsigned quants u and, per sub-block j,
w = a_j u - b_j: Q4_K/Q5_K (4/5-bit u, sub-blocks of 32) a_j = d sc_j, b_j = dmin m_j; Q6_K (6-bit u, sub-blocks
of 16) a_j = d sc_j, b_j = 32 d sc_j (the low-bit types likewise: gemm8_unpack.py). Per row and token:
sum_j [a_j (sum u x) - b_j (sum x)] dx. Each type compiles its own GEMM (_gemm_of), on its first prompt.
How, per matrix and prompt chunk (one call split over plain threads, no BLAS, so no OpenMP workers spin against
BLAS threads), in one of two forms (variant): R rows x TT tokens per tile, 16 x 8 with 512-bit VNNI, else 8 x 4:
- each group of R rows is unpacked into the layout the kernel reads: per 4 columns, R rows x 4 bytes of u (one
  register), and per sub-block the R rows' a_j and b_j as f32 (and a_j as an integer scale and d, for the 256);
- the tile kernel (IR intrinsic) computes R rows x TT tokens: per 4 columns one weight register and, per token,
  its 4 bytes broadcast into vpdpbusd (512: per sub-block the integer sums times a_j dx accumulate in f32, or where
  b_j = c a_j the sums of (u - c) x times the integer scale in int32 over the super-block: _symmetric_tile) or
  vpmaddubsw (256: the products' pairs summed in int16 over a few groups, then vpmaddwd by the sub-block's integer
  scale into int32 over the whole super-block, times d dx once per super-block); b_j times the token's scaled
  sum of the sub-block is subtracted in f32.
tests/test_gemm8.py holds both forms to the decode matvec's result on the same input.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels.cpu import ir as kir
from engine.kernels.cpu import gemm8_unpack, plain_threads
from engine.kernels.cpu.dequant_lattice import (IQ1_M_CODE, IQ1_S_CODE, IQ2_S_CODE, IQ2_XS_CODE, IQ2_XXS_CODE,
                                                IQ3_S_CODE, IQ3_XXS_CODE)
from engine.kernels.cpu.ir import (FLT, I32, IQ4_XS_CODE, Q2_K_CODE, Q3_K_CODE, Q4_K_CODE, Q5_K_CODE, Q6_K_CODE, V,
                                   Emitter, is_arr)
from engine.kernels.cpu.quantize import QK_K, quantize_k_into
from engine.kernels.quant_types import LATTICE_TYPES, GGMLType, QTensor, row_bytes

# The two forms of the kernel: (rows, tokens) of a tile, by the token type that selects its code (see _tile_kernel)
WIDE, NARROW = np.int32(0), np.int16(0)  # 512-bit vpdpbusd; 256-bit vpmaddubsw (AVX2)
TILE = {"512": (16, 8), "256": (8, 4)}
TOKENS = 8  # the input is padded to whole tiles of this many tokens (a multiple of both forms')
BLOCK_BYTES = 256 * 1024  # unpacked rows a thread keeps (in L2) while every token tile passes over them
TYPES = frozenset({GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.TQ1_0,
                   GGMLType.TQ2_0}) | LATTICE_TYPES
# IQ4_XS's quants are a codebook's levels (-127..113, here + 128): products with the input overflow the 256-bit
# form's int16 pair sums, so only the 512-bit form (int32 sums) takes it. (IQ4_NL, like the legacy types, reads
# Q8_0 activations at decode: its prompts take dequantize + sgemm, not a GEMM that would see other numbers.)
WIDE_TYPES = frozenset({GGMLType.IQ4_XS})


def variant(tier: str | None = None) -> str | None:
    """The kernel form this CPU runs under `tier` (default: the one in force): "512" (512-bit VNNI), "256" (AVX2's
    vpmaddubsw, and AVX-VNNI without AVX-512), or None (the generic tier: dequantize + sgemm)."""
    return _form(tier or kir.TIER)


@functools.cache  # (asked on every prompt matmul: reading the CPU's features through llvmlite takes ~0.2 ms)
def _form(tier: str) -> str | None:
    if tier == "vnni" and {"avx512f", "avx512bw", "avx512vnni"} <= kir.target_features():
        return "512"
    return "256" if tier in ("avx2", "vnni") else None


def available(tier: str | None = None) -> bool:
    return variant(tier) is not None


def usable(w: QTensor, tier: str | None = None) -> bool:
    return (w.ggml_type in TYPES or (w.ggml_type in WIDE_TYPES and variant(tier) == "512")) and w.cols % QK_K == 0


def carries_most(matrices: list[QTensor], tier: str | None = None) -> bool:
    """Whether this GEMM would carry most of a prompt's matrix work (by weights): the rule for using it on a model.
    Where it would carry little, its calls sit between sgemm calls in every layer, and each pays for the BLAS
    threads still spinning from the last sgemm: Gemma 3 270M Q4_K_M (its ffn_down matrices only) prefilled
    slower with it, the Qwen2.5-1.5B shape (Q4_K and Q6_K) clearly faster (docs/benchmarks.md, "Measurements
    behind the code", gemm8 carries_most)."""
    total = sum(w.rows * w.cols for w in matrices)
    return total > 0 and 2 * sum(w.rows * w.cols for w in matrices if usable(w, tier)) >= total


def _tile_kernel(sub: int, chunk: int, symmetric: bool = False, lut=None):
    """The tile intrinsic for sub-blocks of `sub` columns (32: Q4_K/Q5_K, 16: Q6_K):
    (form, tile, nsb, xq, xoff, K, xd, xm, soff, ws, wi, wd, res) -> res (tokens, rows) f32 = a tile's tokens (rows
    xoff / K .. of xq) x its rows (see module doc). ws: per sub-block, `rows` f32 of its scale a_j then `rows` of
    its min term b_j; xd (T, nsb) scales and xm (T, nsb * 256 / sub) minus dx times the sum of each sub-block, from
    token soff / nsb. wi (sub-blocks, rows) i32 and wd (nsb, rows) f32: a_j split into an integer scale (twice,
    as two i16) and the super-block's d, for the 256-bit form.
    form WIDE: 16 rows x 8 tokens, vpdpbusd on 512 bits, a_j applied per sub-block in f32 (symmetric: the types
    with b_j = c a_j, _symmetric_tile; lut: the levels of the codebook indices in the tile). NARROW: 8 rows x 4
    tokens, vpmaddubsw (u8 x s8 pairs into i16) summed over `chunk` groups of 4 columns in i16 (chunk x 2 x max u x
    127 < 2^15), then vpmaddwd by the integer scale into i32, summed over the super-block; d once per super-block."""
    nsub = QK_K // sub

    def impl(typingctx, form, tile, nsb, xq, xoff, K, xd, xm, xs, soff, ws, wi, wd, res):
        if not (isinstance(form, types.Integer) and form.bitwidth in (16, 32) and is_arr(tile, types.uint8)
                and is_arr(xq, types.int8) and is_arr(xd, types.float32) and is_arr(xm, types.float32)
                and is_arr(xs, types.int32) and is_arr(ws, types.float32) and is_arr(wi, types.int32)
                and is_arr(wd, types.float32) and is_arr(res, types.float32)):
            return None
        wide = form.bitwidth == 32
        if lut is not None and not (wide and symmetric):
            return None
        rows, tokens = TILE["512" if wide else "256"]
        sig = types.none(form, tile, types.intp, xq, types.intp, types.intp, xd, xm, xs, types.intp, ws, wi, wd, res)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, "vnni" if wide else "avx2")
            b = builder
            at = signature.args
            _, tl, n, x, xo, k, d, m, xsum, so, w, wint, wdd, r = args
            tp, wp, rp = e.base(at[1], tl), e.base(at[10], w), e.base(at[13], r)
            xp = b.gep(e.base(at[3], x), [xo], source_etype=kir.I8)
            dp = b.gep(e.base(at[6], d), [e.mul(so, 4)], source_etype=kir.I8)
            mp = b.gep(e.base(at[7], m), [e.mul(so, 4 * nsub)], source_etype=kir.I8)
            vi, vf = V(I32, rows), V(FLT, rows)
            group = rows * 4  # bytes of one group of 4 columns
            facc = [e.fvar(rows) for _ in range(tokens)]
            iacc = [cgutils.alloca_once(b, vi) for _ in range(tokens)]  # entry block: kept in registers

            def weights(j, g, ty):  # group g of sub-block j: 4 columns of the tile's rows
                w = e.ld(tp, e.add(e.mul(j, sub // 4 * group), g * group), ty)
                if lut is None:
                    return w
                v64 = V(kir.I8, 64)  # the tile holds codebook indices: their levels, one vpshufb per register
                table = e.vc(kir.I8, [int(v) - 256 * (v > 127) for v in lut] * 4)
                return b.bitcast(e.call("llvm.x86.avx512.pshuf.b.512", v64, [table, b.bitcast(w, v64)]), ty)

            def inputs(j, g, t):  # token t's 4 bytes at group g of sub-block j, in every lane
                return e.splat(e.ld(xp, e.add(e.add(e.mul(j, sub), 4 * g), e.mul(k, t)), I32), rows)

            def dx_of(t, sb):
                return e.splat(e.ld(dp, e.mul(e.add(e.mul(n, t), sb), 4), FLT), rows)

            def min_terms(j):  # facc += b_j times the token's -dx (sum of the sub-block's x)
                mins = e.ld(wp, e.add(e.mul(j, 2 * rows * 4), rows * 4), vf)
                for t in range(tokens):
                    e.fmacc(facc[t], mins, e.splat(e.ld(mp, e.mul(e.add(e.mul(e.mul(n, nsub), t), j), 4), FLT), rows))

            if wide and symmetric:  # b_j = c a_j: integer sums over the super-block (see _symmetric_tile)
                _symmetric_tile(e, n, nsub, sub, tokens, rows, iacc, facc, weights, inputs, dx_of,
                                b.gep(e.base(at[8], xsum), [e.mul(so, 4 * nsub)], source_etype=kir.I8),
                                e.base(at[11], wint), e.base(at[12], wdd))
            elif wide:
                with e.loop(e.mul(n, nsub)) as lp:  # sub-blocks, over all super-blocks
                    j = lp.index
                    sb = b.udiv(j, e.i64(nsub))
                    for t in range(tokens):
                        b.store(ir.Constant(vi, None), iacc[t])
                    for g in range(sub // 4):
                        wv = weights(j, g, vi)
                        for t in range(tokens):
                            b.store(e.call("llvm.x86.avx512.vpdpbusd.512", vi, [b.load(iacc[t]), wv, inputs(j, g, t)]),
                                    iacc[t])
                    scale = e.ld(wp, e.mul(j, 2 * rows * 4), vf)
                    for t in range(tokens):
                        e.fmacc(facc[t], b.fmul(b.sitofp(b.load(iacc[t]), vf), scale), dx_of(t, sb))
                    min_terms(j)
            else:
                v32, v16 = V(kir.I8, 32), V(kir.I16, 16)
                wip, wdp = e.base(at[11], wint), e.base(at[12], wdd)
                with e.loop(n) as lp:  # super-blocks
                    sb = lp.index
                    for t in range(tokens):
                        b.store(ir.Constant(vi, None), iacc[t])
                    # a loop, not unrolled: unrolled, LLVM's schedule spilled and ran slower (docs/benchmarks.md,
                    # "Measurements behind the code", gemm8 sub-block loop)
                    with e.loop(nsub) as lj:
                        j = e.add(e.mul(sb, nsub), lj.index)
                        scale = b.bitcast(e.ld(wip, e.mul(j, rows * 4), vi), v16)  # (sc, sc) per row
                        for c0 in range(0, sub // 4, chunk):
                            part = [None] * tokens
                            for g in range(c0, c0 + chunk):
                                wv = weights(j, g, v32)
                                for t in range(tokens):
                                    p = e.madd_u8s8(wv, b.bitcast(inputs(j, g, t), v32))
                                    part[t] = p if part[t] is None else b.add(part[t], p)
                            for t in range(tokens):
                                b.store(b.add(b.load(iacc[t]), e.madd_i16(part[t], scale)), iacc[t])
                        min_terms(j)
                    dv = e.ld(wdp, e.mul(sb, rows * 4), vf)
                    for t in range(tokens):
                        e.fmacc(facc[t], b.fmul(b.sitofp(b.load(iacc[t]), vf), dv), dx_of(t, sb))
            for t in range(tokens):
                e.st(rp, t * rows * 4, b.load(facc[t]))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_tile{sub}_{chunk}{'_sym' if symmetric else ''}{'_lut' if lut is not None else ''}"
    return intrinsic(impl)


def _symmetric_tile(e, n, nsub, sub, tokens, rows, iacc, facc, weights, inputs, dx_of, xsp, wip, wdp):
    """The 512-bit form for the types whose min term is a constant c times the scale (w = a_j (u - c), a_j = d s_j
    with s_j an integer: IQ4_XS, Q6_K, Q3_K, TQ1_0, TQ2_0). Each sub-block's vpdpbusd sums start from the token's
    -c sum(x) over the sub-block (xsp: int32 per token and sub-block), so they come out as sum (u - c) x; times
    s_j (vpmulld) they add up in int32 over the super-block, and d dx is applied once per super-block. Per token and
    sub-block that is a multiply and an add where the float form takes a convert, a multiply and two FMAs (the min
    term): the GEMM's overhead beside its vpdpbusd (docs/benchmarks.md, "Measurements behind the code", gemm8
    symmetric sums). No overflow: IQ4_XS's |s_j (u - c) x| summed <= 8 x 32 x 32 x 127 x 127 < 2^31."""
    b = e.b
    vi, vf = V(I32, rows), V(FLT, rows)
    sacc = [cgutils.alloca_once(b, vi) for _ in range(tokens)]
    with e.loop(n) as lp:  # super-blocks
        sb = lp.index
        for t in range(tokens):
            b.store(ir.Constant(vi, None), sacc[t])
        with e.loop(nsub) as lj:
            j = e.add(e.mul(sb, nsub), lj.index)
            for t in range(tokens):  # sum (u - c) x = -c sum x + sum u x
                b.store(e.splat(e.ld(xsp, e.mul(e.add(e.mul(e.mul(n, nsub), t), j), 4), I32), rows), iacc[t])
            for g in range(sub // 4):
                wv = weights(j, g, vi)
                for t in range(tokens):
                    b.store(e.call("llvm.x86.avx512.vpdpbusd.512", vi, [b.load(iacc[t]), wv, inputs(j, g, t)]),
                            iacc[t])
            # s_j: wi holds it in both i16 halves (for the 256-bit form's vpmaddwd); the high one, sign-extended
            scale = b.ashr(e.ld(wip, e.mul(j, rows * 4), vi), e.splat_c(I32, 16, rows))
            for t in range(tokens):
                b.store(b.add(b.load(sacc[t]), b.mul(b.load(iacc[t]), scale)), sacc[t])
        dv = e.ld(wdp, e.mul(sb, rows * 4), vf)
        for t in range(tokens):
            e.fmacc(facc[t], b.fmul(b.sitofp(b.load(sacc[t]), vf), dv), dx_of(t, sb))


# Q4_K: u <= 15, 8 groups in i16; Q5_K: u <= 31, 4; Q6_K: u <= 63, 2 (|x| <= 127)
_tile_q4, _tile_q5, _tile_q6 = _tile_kernel(32, 8), _tile_kernel(32, 4), _tile_kernel(16, 2)
# IQ4_XS, TQ1_0, TQ2_0 (sub-blocks of 32); Q6_K, Q3_K (16): the same, but symmetric in the 512-bit form
_tile_sym32, _tile_sym16 = _tile_kernel(32, 8, True), _tile_kernel(16, 2, True)
# The lattice types (gemm8_lattice.OFFSETS): u <= 124 (IQ2_*, IQ3_XXS), u <= 30 (IQ3_S, IQ1_*)
_tile_wide32, _tile_wide16 = _tile_kernel(32, 1, True), _tile_kernel(16, 1, True)
_tile_mid32, _tile_mid16 = _tile_kernel(32, 4, True), _tile_kernel(16, 4, True)
# IQ4_XS: sym32 with the codebook's levels (+ 128) looked up from the indices in the tile
_tile_iq4 = _tile_kernel(32, 8, True, lut=gemm8_unpack.IQ4_LEVELS)


_unpack_of = njit(inline="always")(gemm8_unpack.unpack)


def _gemm(form, R, TT, raw, code, xq, xd, xm32, xm16, xs, out, n_chunks, ch):
    """Chunk ch of n_chunks (a range of row groups) of out = x @ W.T in tiles of R rows x TT tokens (the form's);
    the chunks run on plain threads. Plain Python: compiled per type (_gemm_of), its code a constant."""
    rows, K = raw.shape[0], xq.shape[1]
    nsb, T = K // QK_K, out.shape[0]
    n_groups = (rows + R - 1) // R
    sb_bytes = QK_K * R  # one super-block of the group's rows
    per_block = max(1, BLOCK_BYTES // (nsb * sb_bytes))  # groups whose tiles stay in L2 while the tokens pass
    u = np.empty(4 * K, np.uint8)  # a row's quants (TQ1_0), or its f32 weights (the lattice types)
    tiles = np.empty((per_block, nsb * sb_bytes), np.uint8)
    ws = np.empty((per_block, nsb * (QK_K // 16), 2, R), np.float32)  # room for 16 sub-blocks (Q6_K)
    wi = np.empty((per_block, nsb * (QK_K // 16), R), np.int32)
    wd = np.empty((per_block, nsb, R), np.float32)
    res = np.empty((TT, R), np.float32)
    g_end = (ch + 1) * n_groups // n_chunks
    for g0 in range(ch * n_groups // n_chunks, g_end, per_block):
        ng = min(per_block, g_end - g0)
        for j in range(ng):
            _unpack_of(form, raw, code, (g0 + j) * R, rows, nsb, u, tiles[j], ws[j], wi[j], wd[j])
        for t0 in range(0, xq.shape[0], TT):  # one tile of tokens (L1) against every group of the block
            for j in range(ng):
                r0 = (g0 + j) * R
                if code == Q6_K_CODE or code == Q3_K_CODE:  # sub-blocks of 16, b_j = c a_j
                    _tile_sym16(form, tiles[j], nsb, xq, t0 * K, K, xd, xm16, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                elif code == Q2_K_CODE:  # sub-blocks of 16, mins of their own
                    _tile_q6(form, tiles[j], nsb, xq, t0 * K, K, xd, xm16, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                elif code == Q5_K_CODE:
                    _tile_q5(form, tiles[j], nsb, xq, t0 * K, K, xd, xm32, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                elif code == Q4_K_CODE:
                    _tile_q4(form, tiles[j], nsb, xq, t0 * K, K, xd, xm32, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                elif code == IQ4_XS_CODE:  # (the 512-bit form only)
                    _tile_iq4(form, tiles[j], nsb, xq, t0 * K, K, xd, xm32, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                elif code == IQ2_XXS_CODE or code == IQ3_XXS_CODE:  # (u <= 124: one group a time in i16)
                    _tile_wide32(form, tiles[j], nsb, xq, t0 * K, K, xd, xm32, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                elif code == IQ2_XS_CODE or code == IQ2_S_CODE:
                    _tile_wide16(form, tiles[j], nsb, xq, t0 * K, K, xd, xm16, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                elif code == IQ3_S_CODE or code == IQ1_S_CODE:  # (u <= 30)
                    _tile_mid32(form, tiles[j], nsb, xq, t0 * K, K, xd, xm32, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                elif code == IQ1_M_CODE:
                    _tile_mid16(form, tiles[j], nsb, xq, t0 * K, K, xd, xm16, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                else:  # the ternary types (u <= 3): b_j = c a_j
                    _tile_sym32(form, tiles[j], nsb, xq, t0 * K, K, xd, xm32, xs, t0 * nsb, ws[j], wi[j], wd[j], res)
                for t in range(min(TT, T - t0)):
                    for r in range(min(R, rows - r0)):
                        out[t0 + t, r0 + r] = res[t, r]


_gemm_inline = njit(inline="always")(_gemm)


@functools.cache
def _gemm_of(code: int):
    """The GEMM for one weight type (a closure holding its code: numba compiles that type's unpacker and tile
    kernel only, and its cache keys the closure by the code), so a model compiles the types it has."""

    @njit(nogil=True, cache=True)
    def gemm(form, R, TT, raw, xq, xd, xm32, xm16, xs, out, n_chunks, ch):
        _gemm_inline(form, R, TT, raw, code, xq, xd, xm32, xm16, xs, out, n_chunks, ch)

    return gemm


class QuantizedInput:
    """x (T, K) quantized once (Q8_K) for every matrix that reads it, padded with zeros to whole tiles of tokens."""

    def __init__(self, x: np.ndarray):
        T, K = x.shape
        Tp = -(-T // TOKENS) * TOKENS
        nsb = K // QK_K
        self.T = T
        self.xq, self.xd = np.empty((Tp, K), np.int8), np.empty((Tp, nsb), np.float32)
        sums = np.empty((Tp, nsb, 24), np.int16)  # 8 sums over 32 columns, then 16 over 16
        quantize_k_into(np.ascontiguousarray(x, np.float32), self.xq[:T], self.xd[:T], sums[:T], 0, K)
        self.xq[T:], self.xd[T:], sums[T:] = 0, 0.0, 0  # the padding tokens: zeros (no copy of x to pad it)
        # minus dx times each sub-block's sum (of 32 columns, and of 16): the min terms' share, per token
        self.xm32, self.xm16 = np.empty((Tp, nsb * 8), np.float32), np.empty((Tp, nsb * 16), np.float32)
        _min_terms(self.xd, sums, self.xm32, self.xm16)
        self._sums, self._offset_sums = sums, {}

    def offset_sums(self, code: int) -> np.ndarray:
        """(Tp, sub-blocks) int32: -c times each sub-block's sum of quants, for a type whose min term is c times its
        scale (gemm8_unpack.OFFSETS; the 512-bit form starts its sums there); a placeholder for the other types."""
        if code not in gemm8_unpack.OFFSETS:
            return _NO_SUMS
        c, sub = gemm8_unpack.OFFSETS[code]
        if (c, sub) not in self._offset_sums:
            part = self._sums[:, :, :8] if sub == 32 else self._sums[:, :, 8:]
            self._offset_sums[c, sub] = (np.int32(-c) * part.astype(np.int32)).reshape(part.shape[0], -1)
        return self._offset_sums[c, sub]


_NO_SUMS = np.zeros((1, 1), np.int32)


@njit(cache=True)
def _min_terms(xd, sums, xm32, xm16):
    for t in range(xd.shape[0]):
        for sb in range(xd.shape[1]):
            d = -xd[t, sb]
            for j in range(8):
                xm32[t, sb * 8 + j] = d * np.float32(sums[t, sb, j])
            for j in range(16):
                xm16[t, sb * 16 + j] = d * np.float32(sums[t, sb, 8 + j])


def matmul(qin: QuantizedInput, w: QTensor, tier: str | None = None) -> np.ndarray:
    """(T, rows) f32 = x @ W.T for a usable(w) matrix, with the decode matvec's integer math, in the form the CPU
    runs under `tier` (variant; the caller checks available(tier)).

    Split over plain threads (the kernel releases the GIL), not numba's OpenMP pool: OpenMP workers spin for a
    while after a parallel region, and the sgemm calls between these (attention, other matrix types) then run
    several times slower against them (on Gemma 3 prompts were slower with a parallel region here:
    docs/benchmarks.md, "Measurements behind the code", plain threads)."""
    form = variant(tier)
    R, TT = TILE[form]
    out = np.empty((qin.T, w.rows), np.float32)
    n = max(1, min(-(-w.rows // R), numba.get_num_threads()))
    xs = qin.offset_sums(int(w.ggml_type)) if form == "512" else _NO_SUMS
    args = (WIDE if form == "512" else NARROW, R, TT, w.raw, qin.xq, qin.xd, qin.xm32, qin.xm16, xs, out, n)
    plain_threads.split(_gemm_of(int(w.ggml_type)), args, n)
    return out


def warm(ggml_types=(GGMLType.Q4_K,), tier: str | None = None) -> None:
    """Compile the GEMM of these weight types for the form this CPU runs into numba's on-disk cache (seconds, once
    per machine), on one tile of zeros: engine/loading/precompile.py calls it for a model that uses it, so a first
    long prompt does not wait for it."""
    if not available(tier):
        return
    rows = TILE[variant(tier)][0]
    qin = QuantizedInput(np.zeros((TOKENS, QK_K), np.float32))
    for t in ggml_types:
        t = GGMLType(int(t))
        w = QTensor("warm", t, (rows, QK_K), np.zeros((rows, row_bytes(t, QK_K)), np.uint8))
        if usable(w, tier):
            matmul(qin, w, tier)
