"""Prompt matmuls (T input rows at once) in int8 with AVX512-VNNI: the fast path's prefill for K-quant matrices.

Why: a prompt through dequantized f32 weights and sgemm runs at the f32 FMA peak (16 MACs per instruction);
`vpdpbusd` on 512 bits does 64 int8 MACs per instruction, and llama.cpp's prefill on K-quants is integer. Measured
on the Qwen2.5-1.5B shape (mostly Q4_K), sgemm left goinfer's prefill at 0.8x llama.cpp's.

The math is the decode matvec's (kquant.py), so a prompt and a decoded token see the same numbers: the input
quantized as Q8_K (int8 per 256 columns, quantize.py), the weights' own unsigned quants u and, per sub-block j,
w = a_j u - b_j: Q4_K/Q5_K (4/5-bit u, sub-blocks of 32) a_j = d sc_j, b_j = dmin m_j; Q6_K (6-bit u, sub-blocks
of 16) a_j = d sc_j, b_j = 32 d sc_j. Per row and token: sum_j [a_j (sum u x) - b_j (sum x)] dx.
How, per matrix and prompt chunk (one parallel call, no BLAS, so no OpenMP workers spin against BLAS threads):
- each group of 16 rows is unpacked into the layout the kernel reads: per 4 columns, 16 rows x 4 bytes of u (one
  512-bit register), and per sub-block the 16 rows' a_j and b_j as f32;
- the tile kernel (IR intrinsic) computes 16 rows x 8 tokens: per 4 columns one weight register and, per token,
  vpdpbusd with the token's 4 bytes broadcast; per sub-block the integer sums times a_j dx, less b_j times the
  token's scaled sum, accumulate in f32.
tests/test_gemm8.py holds it to the decode matvec's result on the same input.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels.cpu import ir as kir
from engine.kernels.cpu import plain_threads
from engine.kernels.cpu.dequant import f16_at, k_scale_min
from engine.kernels.cpu.ir import FLT, I32, Q5_K_CODE, Q6_K_CODE, V, Emitter, is_arr
from engine.kernels.cpu.quantize import QK_K, quantize_k_into
from engine.kernels.quant_types import GGMLType, QTensor

ROWS = 16  # rows per tile: one 512-bit register of int32 sums
TOKENS = 8  # tokens per tile: 8 accumulators of each kind stay in registers
GROUP_BYTES = ROWS * 4  # one group of 4 columns of the 16 rows
SB_BYTES = (QK_K // 4) * GROUP_BYTES  # one super-block of the 16 rows: 4096
BLOCK_BYTES = 256 * 1024  # unpacked rows a thread keeps (in L2) while every token tile passes over them
TYPES = frozenset({GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})


def available() -> bool:
    """The CPU (as numba compiles for it) has 512-bit VNNI, and the vnni tier is in force."""
    feats = kir.target_features()
    return kir.TIER == "vnni" and {"avx512f", "avx512bw", "avx512vnni"} <= feats


def usable(w: QTensor) -> bool:
    return w.ggml_type in TYPES and w.cols % QK_K == 0


def carries_most(matrices: list[QTensor]) -> bool:
    """Whether this GEMM would carry most of a prompt's matrix work (by weights): the rule for using it on a model.
    Where it would carry little, its calls sit between sgemm calls in every layer, and each pays for the BLAS
    threads still spinning from the last sgemm: Gemma 3 270M Q4_K_M (its ffn_down matrices only) prefilled
    15-25 % slower with it; the Qwen2.5-1.5B shape (Q4_K and Q6_K) 1.35-1.6x faster."""
    total = sum(w.rows * w.cols for w in matrices)
    return total > 0 and 2 * sum(w.rows * w.cols for w in matrices if usable(w)) >= total


def _tile_kernel(sub: int):
    """The tile intrinsic for sub-blocks of `sub` columns (32: Q4_K/Q5_K, 16: Q6_K):
    (tile, nsb, xq, xoff, K, xd, xm, soff, ws, res) -> res (8, 16) f32 = 8 tokens (rows xoff / K .. of xq) x the
    16 rows of tile (see module doc). ws: per sub-block, 16 f32 of its scale then 16 of its min term; xd (T, nsb)
    scales and xm (T, nsb * 256 / sub) minus dx times the sum of each sub-block, both from token soff / nsb."""
    nsub = QK_K // sub

    def impl(typingctx, tile, nsb, xq, xoff, K, xd, xm, soff, ws, res):
        if not (is_arr(tile, types.uint8) and is_arr(xq, types.int8) and is_arr(xd, types.float32)
                and is_arr(xm, types.float32) and is_arr(ws, types.float32) and is_arr(res, types.float32)):
            return None
        sig = types.none(tile, types.intp, xq, types.intp, types.intp, xd, xm, types.intp, ws, res)

        def codegen(context, builder, signature, args):
            e = Emitter(context, builder, "vnni")
            b = builder
            at = signature.args
            tl, n, x, xo, k, d, m, so, w, r = args
            tp, wp, rp = e.base(at[0], tl), e.base(at[8], w), e.base(at[9], r)
            xp = b.gep(e.base(at[2], x), [xo], source_etype=kir.I8)
            dp = b.gep(e.base(at[5], d), [e.mul(so, 4)], source_etype=kir.I8)
            mp = b.gep(e.base(at[6], m), [e.mul(so, 4 * nsub)], source_etype=kir.I8)
            v16, f16 = V(I32, 16), V(FLT, 16)
            facc = [e.fvar(16) for _ in range(TOKENS)]
            iacc = [cgutils.alloca_once(b, v16) for _ in range(TOKENS)]  # entry block: kept in registers
            with e.loop(e.mul(n, nsub)) as lp:  # sub-blocks, over all super-blocks
                j = lp.index
                sb = b.udiv(j, e.i64(nsub))
                for t in range(TOKENS):
                    b.store(ir.Constant(v16, None), iacc[t])
                for g in range(sub // 4):
                    wv = e.ld(tp, e.add(e.mul(j, sub // 4 * GROUP_BYTES), g * GROUP_BYTES), v16)
                    col = e.add(e.mul(j, sub), 4 * g)
                    for t in range(TOKENS):
                        xv = e.splat(e.ld(xp, e.add(col, e.mul(k, t)), I32), 16)
                        b.store(e.call("llvm.x86.avx512.vpdpbusd.512", v16, [b.load(iacc[t]), wv, xv]), iacc[t])
                scale = e.ld(wp, e.mul(j, 2 * ROWS * 4), f16)
                mins = e.ld(wp, e.add(e.mul(j, 2 * ROWS * 4), ROWS * 4), f16)
                for t in range(TOKENS):
                    dx = e.splat(e.ld(dp, e.mul(e.add(e.mul(n, t), sb), 4), FLT), 16)
                    xs = e.splat(e.ld(mp, e.mul(e.add(e.mul(e.mul(n, nsub), t), j), 4), FLT), 16)
                    e.fmacc(facc[t], b.fmul(b.sitofp(b.load(iacc[t]), f16), scale), dx)
                    e.fmacc(facc[t], mins, xs)
            for t in range(TOKENS):
                e.st(rp, t * ROWS * 4, b.load(facc[t]))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_tile{sub}"
    return intrinsic(impl)


_tile32, _tile16 = _tile_kernel(32), _tile_kernel(16)


@njit(cache=True)
def _unpack(raw, code, r0, rows, nsb, u, tile, ws):
    """Rows [r0, r0 + 16) of raw (zeros past `rows`) -> tile (their quants u, layout above) and ws (sub-blocks, 2,
    16) f32 (each sub-block's scale and min term); u: scratch of one row (K,) uint8."""
    t32 = tile.view(np.uint32)
    u32 = u.view(np.uint32)
    for r in range(ROWS):
        if r0 + r >= rows:
            u[:] = 0
            ws[:, :, r] = 0.0
        elif code == Q6_K_CODE:
            _unpack_q6_k(raw[r0 + r], nsb, u, ws, r)
        else:
            _unpack_q45_k(raw[r0 + r], code, nsb, u, ws, r)
        for i in range(nsb * QK_K // 4):  # 4 columns at a time into their group
            t32[i * ROWS + r] = u32[i]


@njit(cache=True)
def _unpack_q45_k(src, code, nsb, u, ws, r):
    """Q4_K/Q5_K: w = d sc_j u - dmin m_j per sub-block j of 32 (u: 4 bits, Q5_K's fifth from qh)."""
    bb = 176 if code == Q5_K_CODE else 144  # bytes per super-block
    qs = 48 if code == Q5_K_CODE else 16  # where the 4-bit quants start
    for sb in range(nsb):
        o = sb * bb
        d, dmin = f16_at(src, o), f16_at(src, o + 2)
        for j in range(8):  # sub-block j: nibble j % 2 of the 32 bytes at qs + 32 (j // 2)
            sc, m = k_scale_min(src, o + 4, j)
            ws[sb * 8 + j, 0, r] = d * np.float32(sc)
            ws[sb * 8 + j, 1, r] = dmin * np.float32(m)
            q0, sh, y = o + qs + 32 * (j // 2), 4 * (j % 2), sb * QK_K + 32 * j
            for c in range(32):
                v = (src[q0 + c] >> sh) & 15
                if code == Q5_K_CODE:  # the fifth bit of weight c is bit j of qh[c]
                    v |= ((src[o + 16 + c] >> j) & 1) << 4
                u[y + c] = v


@njit(cache=True)
def _unpack_q6_k(src, nsb, u, ws, r):
    """Q6_K: w = d sc_g (u - 32) per sub-block g of 16 (u: 6 bits; reference.py gives the weight order), so the
    scale is d sc_g and the min term 32 d sc_g."""
    for sb in range(nsb):
        o = sb * 210  # ql[128] | qh[64] | i8 scales[16] | f16 d
        d = f16_at(src, o + 208)
        for g in range(16):
            sc = d * np.float32((np.int32(src[o + 192 + g]) ^ 128) - 128)
            ws[sb * 16 + g, 0, r] = sc
            ws[sb * 16 + g, 1, r] = np.float32(32.0) * sc
        for n in range(QK_K):
            h, qt, c = n // 128, (n % 128) // 32, n % 32
            low = (src[o + 64 * h + 32 * (qt % 2) + c] >> (4 * (qt // 2))) & 15
            u[sb * QK_K + n] = low | (((src[o + 128 + 32 * h + c] >> (2 * qt)) & 3) << 4)


@njit(nogil=True, cache=True)
def _gemm(raw, code, xq, xd, xm32, xm16, out, n_chunks, ch):
    """Chunk ch of n_chunks (a range of row groups) of out = x @ W.T; the chunks run on plain threads."""
    rows, K = raw.shape[0], xq.shape[1]
    nsb, T = K // QK_K, out.shape[0]
    n_groups = (rows + ROWS - 1) // ROWS
    per_block = max(1, BLOCK_BYTES // (nsb * SB_BYTES))  # groups whose tiles stay in L2 while the tokens pass
    u = np.empty(K, np.uint8)
    tiles = np.empty((per_block, nsb * SB_BYTES), np.uint8)
    ws = np.empty((per_block, nsb * (QK_K // 16), 2, ROWS), np.float32)  # room for 16 sub-blocks (Q6_K)
    res = np.empty((TOKENS, ROWS), np.float32)
    g_end = (ch + 1) * n_groups // n_chunks
    for g0 in range(ch * n_groups // n_chunks, g_end, per_block):
        ng = min(per_block, g_end - g0)
        for j in range(ng):
            _unpack(raw, code, (g0 + j) * ROWS, rows, nsb, u, tiles[j], ws[j])
        for t0 in range(0, xq.shape[0], TOKENS):  # one tile of tokens (L1) against every group of the block
            for j in range(ng):
                r0 = (g0 + j) * ROWS
                if code == Q6_K_CODE:  # sub-blocks of 16
                    _tile16(tiles[j], nsb, xq, t0 * K, K, xd, xm16, t0 * nsb, ws[j], res)
                else:
                    _tile32(tiles[j], nsb, xq, t0 * K, K, xd, xm32, t0 * nsb, ws[j], res)
                for t in range(min(TOKENS, T - t0)):
                    for r in range(min(ROWS, rows - r0)):
                        out[t0 + t, r0 + r] = res[t, r]


class QuantizedInput:
    """x (T, K) quantized once (Q8_K) for every matrix that reads it, padded to whole tiles of tokens."""

    def __init__(self, x: np.ndarray):
        T, K = x.shape
        Tp = -(-T // TOKENS) * TOKENS
        xp = np.zeros((Tp, K), np.float32)
        xp[:T] = x
        nsb = K // QK_K
        self.T = T
        self.xq, self.xd = np.empty((Tp, K), np.int8), np.empty((Tp, nsb), np.float32)
        sums = np.empty((Tp, nsb, 24), np.int16)  # 8 sums over 32 columns, then 16 over 16
        quantize_k_into(xp, self.xq, self.xd, sums, 0, K)
        # minus dx times each sub-block's sum (of 32 columns, and of 16): the min terms' share, per token
        self.xm32 = (-self.xd[:, :, None] * sums[:, :, :8]).reshape(Tp, nsb * 8).astype(np.float32)
        self.xm16 = (-self.xd[:, :, None] * sums[:, :, 8:]).reshape(Tp, nsb * 16).astype(np.float32)


def matmul(qin: QuantizedInput, w: QTensor) -> np.ndarray:
    """(T, rows) f32 = x @ W.T for a usable(w) matrix, with the decode matvec's integer math.

    Split over plain threads (the kernel releases the GIL), not numba's OpenMP pool: OpenMP workers spin for a
    while after a parallel region, and the sgemm calls between these (attention, other matrix types) then run
    several times slower against them (measured on Gemma 3: prompts 1.5x slower with a parallel region here)."""
    out = np.empty((qin.T, w.rows), np.float32)
    n = max(1, min(-(-w.rows // ROWS), numba.get_num_threads()))
    plain_threads.split(_gemm, (w.raw, np.int64(int(w.ggml_type)), qin.xq, qin.xd, qin.xm32, qin.xm16, out, n), n)
    return out
