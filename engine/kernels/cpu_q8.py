"""Integer CPU kernels (llama.cpp-style): activations quantized to int8 once per input vector, weights read in
their GGUF blocks in place, integer dot products per block, f32 scale algebra per block.

Activations (x (M, K) f32, M >= 1 vectors that share every weight read):
  legacy blocks of 32 (for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), "Q8_0-style":
    xq8 (M, K) int8    q = rint(x / dx), dx = amax / 127 per block, so |q| <= 127
    xs8 (M, 2 * nb) f32 per block [dx, xsum] with xsum = dx * sum(q) (the min / offset term)
    Blocks are stored in pairs with their halves interleaved (x[A 0:16], x[B 0:16], x[A 16:32], x[B 16:32]),
    so one 32-byte load of two blocks' nibbles meets its activations in one register (legacy_x_order()).
  K-quant super-blocks of 256 (for Q4_K, Q5_K, Q6_K), "Q8_K-style" as ggml:
    xqk (M, K) int8, xdk (M, K/256) f32 scale, xbk (M, K/256, 24) int16: 8 sums per 32, then 16 per 16.
  F32/F16/BF16 weights take the f32 activations as they are (an f32 dot).

Integer algebra per block (u = stored unsigned quant, x = int8 activation, exact in int32):
  Q4_0: d*dx*sum(u x) - 8 d*xsum      Q4_1: d*dx*sum(u x) + m*xsum     Q8_0: d*dx*sum(q x)
  Q5_0: d*dx*sum(u x) - 16 d*xsum     Q5_1: d*dx*sum(u x) + m*xsum
  Q4_K/Q5_K: d*dx*sum_s sc_s sum(u x) - dmin*dx*sum_s m_s bsum32_s
  Q6_K: d*dx*sum_g sc_g (sum(u x) - 32 bsum16_g)

Code tiers (selected from the CPU features at import; GOINFER_CPU_TIER=generic|avx2|vnni forces one):
  generic  plain LLVM vector IR, no target intrinsics: any CPU numba runs on (the fallback)
  avx2     vpmaddubsw + vpmaddwd (u8 x s8 pairs -> i16 -> i32), as llama.cpp's AVX2 path
  vnni     vpdpbusd (AVX-VNNI or AVX512-VNNI+VL) for the 32-weight block types; K-quants as avx2
The tier reaches the compiled code as the *type* of a token argument (int8/int16/int32), so each tier is its own
specialization and its own cache entry. The code never emits an instruction the host lacks: a forced tier the
CPU cannot run is refused in Python (LLVM would abort the process).

Codegen (../shared/research/kernels.md, sections 2-3): the per-row dot products are small LLVM-IR intrinsics
with explicit vector ops and the block loop in IR, because numba loops over 32-byte blocks are unrolled, then
scalarized (8-9 GB/s). Rows are spread over threads by a prange over row chunks; each row is read from memory
once per call and reused from L1 for every one of the M activation vectors (compute grows with M; decoding a
block once for several vectors is left for batched decode). Each row loop prefetches PREFETCH_BYTES ahead.
Measured (Zen 3, AVX2, 2 threads, quiet box, DRAM read ~34 GB/s): one SmolLM2 token's 211 matvecs 4.4 ms
(22 GB/s; exact f32 path 13.3 ms), Gemma-3-270M's 9.3 ms (26 GB/s; f32 path 20.9 ms).

Public API (Python; each is one compiled call after argument checks):
  prepare(ws) -> Prepared                  check matrices that share one input once (q|k|v, gate|up)
  quantize(x, types or Prepared) -> QInput activations for every block family the matrices need
  matvec(ws or Prepared, qin, out=None) -> (M, sum rows)  x @ W_i.T for all of them, one parallel call
  integer_dots(w, qin) -> int32            the per-block integer dot products (tests)
  legacy_x_order(K), available_tiers(), TIER, tier_token(tier)
  dequantized_input(qin, type) -> f32     the activations as the kernels see them (oracles)
njit-callable (for the compiled decode step, engine/models/decode_step.py): quantize_legacy_into,
quantize_k_into, rows_into (one matrix's row range, dispatched on its type code) and matvec_into (a tuple of
weight arrays, parallel over rows), the tier token as their last argument.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Sequence

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# (importing cpu also sets numba's threading-layer preference: omp before tbb and workqueue)
from engine.kernels.cpu import _half_bits_to_f32, _u32_bits_to_f32
from engine.kernels.quant_types import GGMLType, QTensor, row_bytes, type_name

_F32, _F16, _BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = (int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0),
                                     int(GGMLType.Q5_1), int(GGMLType.Q8_0))
_Q4_K, _Q5_K, _Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q5_K), int(GGMLType.Q6_K)

LEGACY_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0})
K_TYPES = frozenset({GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
QK = 32  # weights per legacy block
QK_K = 256  # weights per K super-block
KB_SUMS = 24  # int16 sums per K super-block in xbk: 8 over 32 weights, then 16 over 16
# Software prefetch distance along each weight row stream (about DRAM latency x one core's read rate). The
# hardware prefetcher alone left compute and DRAM reads serialized: on the Zen 3 dev box prefetching every line
# of each group took a SmolLM2 token's matvecs from 10.0 to 7.9 ms and Gemma's from 80 to 36 ms (1 thread, same
# sitting; 1 KB and 2 KB ahead measured alike, 4 KB slightly worse).
PREFETCH_BYTES = 1024

# =========================================================================================================
# Tiers
# =========================================================================================================

TIERS = ("generic", "avx2", "vnni")
_TOKENS = {"generic": np.int8(0), "avx2": np.int16(0), "vnni": np.int32(0)}
_TIER_OF_BITS = {8: "generic", 16: "avx2", 32: "vnni"}


def _target_features() -> set[str]:
    """The CPU features numba compiles for: NUMBA_CPU_FEATURES when set (portable caches), else the host's."""
    forced = numba.config.CPU_FEATURES
    if forced is not None:
        return {f[1:] for f in forced.split(",") if f.startswith("+")}
    return {k for k, v in llvm_binding.get_host_cpu_features().items() if v}


@functools.cache
def available_tiers() -> tuple[str, ...]:
    """The tiers the compilation target (normally this CPU) can run, best last."""
    f = _target_features()
    have = f.__contains__
    tiers = ["generic"]
    if have("avx2"):
        tiers.append("avx2")
        if have("avxvnni") or (have("avx512vnni") and have("avx512vl")):
            tiers.append("vnni")
    return tuple(tiers)


def _default_tier() -> str:
    forced = os.environ.get("GOINFER_CPU_TIER", "").strip().lower()
    if forced in ("", "auto"):
        return available_tiers()[-1]
    return _check_tier(forced)


def _check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"unknown CPU kernel tier {tier!r}; choose from {', '.join(TIERS)}")
    if tier not in available_tiers():
        raise ValueError(f"this CPU cannot run the {tier!r} kernels (it can run: {', '.join(available_tiers())})")
    return tier


try:
    TIER = _default_tier()  # the tier used when none is given
    _TIER_ERROR = None
except ValueError as exc:  # a bad GOINFER_CPU_TIER: reported when the kernels are used, not at import
    TIER, _TIER_ERROR = available_tiers()[-1], exc


def tier_token(tier: str | None = None):
    """The value to pass as `tier` to the njit entry points: its numba type selects the code tier."""
    if tier is None and _TIER_ERROR is not None:
        raise ValueError(f"GOINFER_CPU_TIER: {_TIER_ERROR}")
    return _TOKENS[_check_tier(tier) if tier is not None else TIER]


# =========================================================================================================
# LLVM IR helpers
# =========================================================================================================

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_FLT, _HALF = ir.FloatType(), ir.HalfType()
_V = ir.VectorType


class _E:
    """IR emission helpers for one intrinsic call. Pointers are i8* with byte offsets (i64 or int)."""

    def __init__(self, context, builder, tier: str):
        self.c, self.b, self.tier = context, builder, tier

    # --- addressing and constants ---
    def base(self, aryty, ary) -> ir.Value:
        data = self.c.make_array(aryty)(self.c, self.b, ary).data
        return self.b.bitcast(data, _I8.as_pointer())

    def i64(self, v) -> ir.Value:
        return v if isinstance(v, ir.Value) else ir.Constant(_I64, v)

    def add(self, a, c) -> ir.Value:
        if not isinstance(c, ir.Value) and c == 0:
            return self.i64(a)
        return self.b.add(self.i64(a), self.i64(c))

    def mul(self, a, c) -> ir.Value:
        return self.b.mul(self.i64(a), self.i64(c))

    def ld(self, p, off, ty, align=1) -> ir.Value:
        at = self.b.gep(p, [self.i64(off)], source_etype=_I8)
        return self.b.load(self.b.bitcast(at, ty.as_pointer()), typ=ty, align=align)

    def st(self, p, off, v) -> None:
        at = self.b.gep(p, [self.i64(off)], source_etype=_I8)
        self.b.store(v, self.b.bitcast(at, v.type.as_pointer()), align=1)

    def vc(self, ty, vals) -> ir.Constant:
        return ir.Constant(_V(ty, len(vals)), list(vals))

    def splat_c(self, ty, val, n) -> ir.Constant:
        return ir.Constant(_V(ty, n), [val] * n)

    def shuf(self, a, c, idx) -> ir.Value:
        return self.b.shuffle_vector(a, a if c is None else c, self.vc(_I32, idx))

    def splat(self, x, n) -> ir.Value:
        v = self.b.insert_element(ir.Constant(_V(x.type, n), None), x, ir.Constant(_I32, 0))
        return self.shuf(v, None, [0] * n)

    def gather(self, p, offs, ty) -> ir.Value:
        """<len(offs) x ty> of scalars loaded at byte offsets offs (i64 values)."""
        v = ir.Constant(_V(ty, len(offs)), None)
        for j, o in enumerate(offs):
            v = self.b.insert_element(v, self.ld(p, o, ty), ir.Constant(_I32, j))
        return v

    def halves(self, v) -> ir.Value:
        """<n x i16> holding IEEE halves -> <n x float>, exact."""
        n = v.type.count
        return self.b.fpext(self.b.bitcast(v, _V(_HALF, n)), _V(_FLT, n))

    def call(self, name, ret, args) -> ir.Value:
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return self.b.call(cgutils.get_or_insert_function(self.b.module, fnty, name), args)

    def hsum_i(self, v) -> ir.Value:
        return self.call(f"llvm.vector.reduce.add.v{v.type.count}i32", _I32, [v])

    def hsum_f(self, v) -> ir.Value:
        """Sum of the lanes as a halving tree (llvm.vector.reduce.fadd without reassoc is a serial chain)."""
        n = v.type.count
        while n > 1:
            n //= 2
            v = self.b.fadd(self.shuf(v, None, range(n)), self.shuf(v, None, range(n, 2 * n)))
        return self.b.extract_element(v, ir.Constant(_I32, 0))

    # --- integer dot primitives (tier-specific) ---
    def madd_u8s8(self, u, x) -> ir.Value:
        """<2n x i8> unsigned u, signed x -> <n x i16>: u[2i] x[2i] + u[2i+1] x[2i+1] (callers keep it < 2^15)."""
        n2 = u.type.count
        if self.tier != "generic" and n2 == 32:
            return self.call("llvm.x86.avx2.pmadd.ub.sw", _V(_I16, 16), [u, x])
        b = self.b
        p = b.mul(b.zext(u, _V(_I16, n2)), b.sext(x, _V(_I16, n2)))
        return b.add(self.shuf(p, None, range(0, n2, 2)), self.shuf(p, None, range(1, n2, 2)))

    def madd_i16(self, a, c) -> ir.Value:
        """<2n x i16> a, c -> <n x i32>: a[2i] c[2i] + a[2i+1] c[2i+1]."""
        n2 = a.type.count
        if self.tier != "generic" and n2 in (8, 16):
            name = "llvm.x86.avx2.pmadd.wd" if n2 == 16 else "llvm.x86.sse2.pmadd.wd"
            return self.call(name, _V(_I32, n2 // 2), [a, c])
        b = self.b
        p = b.mul(b.sext(a, _V(_I32, n2)), b.sext(c, _V(_I32, n2)))
        return b.add(self.shuf(p, None, range(0, n2, 2)), self.shuf(p, None, range(1, n2, 2)))

    def dot4(self, acc, u, x) -> ir.Value:
        """acc <8 x i32> + the sums of 4 consecutive u8 x s8 products per lane (32 bytes each)."""
        if self.tier == "vnni":
            v8 = _V(_I32, 8)
            return self.call("llvm.x86.avx512.vpdpbusd.256", v8, [acc, self.b.bitcast(u, v8), self.b.bitcast(x, v8)])
        s = self.madd_i16(self.madd_u8s8(u, x), self.splat_c(_I16, 1, 16))
        return s if acc is None else self.b.add(acc, s)

    def dot4_small(self, u1, x1, u2, x2) -> ir.Value:
        """dot4 of two (u, x) pairs whose u8 x s8 pair sums stay below 2^14 (u <= 63): adds in i16."""
        if self.tier == "vnni":
            return self.dot4(self.dot4(ir.Constant(_V(_I32, 8), None), u1, x1), u2, x2)
        p = self.b.add(self.madd_u8s8(u1, x1), self.madd_u8s8(u2, x2))
        return self.madd_i16(p, self.splat_c(_I16, 1, 16))

    def abs_sign(self, w, x):
        """Signed w, x -> (|w| as u8, x * sign(w)): u8 x s8 products then equal w x (w = -128 included)."""
        if self.tier != "generic":
            v = _V(_I8, 32)
            return (self.call("llvm.x86.avx2.psign.b", v, [w, w]), self.call("llvm.x86.avx2.psign.b", v, [x, w]))
        b, zero = self.b, ir.Constant(w.type, None)
        neg = b.icmp_signed("<", w, zero)
        return b.select(neg, b.sub(zero, w), w), b.select(neg, b.sub(zero, x), x)

    # --- misc ---
    def nib_lo(self, v) -> ir.Value:
        return self.b.and_(v, self.splat_c(_I8, 15, v.type.count))

    def nib_hi(self, v) -> ir.Value:
        return self.b.lshr(v, self.splat_c(_I8, 4, v.type.count))

    def bits_to_16(self, h, sel) -> ir.Value:
        """<32 x i8>: 16 where bit (lane % 8) of byte h[sel[lane]] is set, else 0 (a Q5 fifth bit)."""
        rep = self.shuf(h, None, sel)
        m = self.b.and_(rep, self.vc(_I8, [1 << (j % 8) for j in range(32)]))
        nz = self.b.icmp_unsigned("!=", m, ir.Constant(m.type, None))
        return self.b.shl(self.b.zext(nz, _V(_I8, 32)), self.splat_c(_I8, 4, 32))

    def fvar(self, n):
        """A zeroed <n x float> accumulator (an alloca that LLVM keeps in a register)."""
        return cgutils.alloca_once_value(self.b, ir.Constant(_V(_FLT, n), [0.0] * n))

    def facc(self, var, v) -> None:
        self.b.store(self.b.fadd(self.b.load(var), v), var)

    def fmacc(self, var, a, c) -> None:
        """var += a * c, fused where the target can (llvm.fmuladd)."""
        n = a.type.count
        self.b.store(self.call(f"llvm.fmuladd.v{n}f32", a.type, [a, c, self.b.load(var)]), var)

    def fperm8(self, v, idx) -> ir.Value:
        """<8 x float> lanes idx of v: one vpermps on AVX2 (LLVM's own lowering takes two shuffles)."""
        if self.tier != "generic" and v.type.count == 8:
            return self.call("llvm.x86.avx2.permps", v.type, [v, self.vc(_I32, idx)])
        return self.shuf(v, None, idx)

    def prefetch(self, p, off) -> None:
        """Ask for the cache line at p + off (read, keep in all levels)."""
        at = self.b.gep(p, [self.i64(off)], source_etype=_I8)
        i32 = lambda v: ir.Constant(_I32, v)  # noqa: E731
        self.call("llvm.prefetch.p0", ir.VoidType(), [at, i32(0), i32(3), i32(1)])

    def loop(self, count):
        return cgutils.for_range(self.b, self.i64(count))


def _tier_of(tok) -> str | None:
    return _TIER_OF_BITS.get(tok.bitwidth) if isinstance(tok, types.Integer) and tok.signed else None


def _is_arr(a, dtype) -> bool:
    return isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"


# =========================================================================================================
# Legacy 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
# =========================================================================================================

# code -> (block bytes, qs offset, qh offset or None, has min, factor on sum(d or m * xsum))
_LEGACY = {
    _Q4_0: (18, 2, None, False, -8.0),
    _Q4_1: (20, 4, None, True, 1.0),
    _Q5_0: (22, 6, 2, False, -16.0),
    _Q5_1: (24, 8, 4, True, 1.0),
    _Q8_0: (34, 2, None, False, 0.0),
}
_LO_SEL = [0] * 8 + [1] * 8 + [4] * 8 + [5] * 8  # fifth-bit bytes of a pair: low halves of A, then of B
_HI_SEL = [2] * 8 + [3] * 8 + [6] * 8 + [7] * 8


def _pair_isum(e: _E, code, wp, o, xp, xo) -> ir.Value:
    """Blocks A (at byte o) and B (next) against a pair-interleaved activation pair at xo:
    <8 x i32>, lanes 0-3 sum to A's integer dot, lanes 4-7 to B's."""
    bb, qs, qh, _, _ = _LEGACY[code]
    b = e.b
    xlo, xhi = e.ld(xp, xo, _V(_I8, 32)), e.ld(xp, e.add(xo, 32), _V(_I8, 32))
    if code == _Q8_0:
        wa, wb = e.ld(wp, e.add(o, qs), _V(_I8, 32)), e.ld(wp, e.add(o, bb + qs), _V(_I8, 32))
        lo = e.shuf(wa, wb, list(range(16)) + list(range(32, 48)))
        hi = e.shuf(wa, wb, list(range(16, 32)) + list(range(48, 64)))
        (u1, s1), (u2, s2) = e.abs_sign(lo, xlo), e.abs_sign(hi, xhi)
        # |q x| pair sums reach 2 * 128 * 127: no room to add two of them in i16
        return e.dot4(e.dot4(ir.Constant(_V(_I32, 8), None) if e.tier == "vnni" else None, u1, s1), u2, s2)
    v = e.shuf(e.ld(wp, e.add(o, qs), _V(_I8, 16)), e.ld(wp, e.add(o, bb + qs), _V(_I8, 16)), range(32))
    lo, hi = e.nib_lo(v), e.nib_hi(v)
    if qh is not None:
        h = e.shuf(e.ld(wp, e.add(o, qh), _V(_I8, 4)), e.ld(wp, e.add(o, bb + qh), _V(_I8, 4)), range(8))
        lo, hi = b.or_(lo, e.bits_to_16(h, _LO_SEL)), b.or_(hi, e.bits_to_16(h, _HI_SEL))
    return e.dot4_small(lo, xlo, hi, xhi)


def _single_isum(e: _E, code, wp, o, xp, xo) -> ir.Value:
    """One block at byte o against natural-order activations at xo: <8 x i32> summing to its integer dot."""
    _, qs, qh, _, _ = _LEGACY[code]
    x = e.ld(xp, xo, _V(_I8, 32))
    if code == _Q8_0:
        u, s = e.abs_sign(e.ld(wp, e.add(o, qs), _V(_I8, 32)), x)
        return e.dot4(ir.Constant(_V(_I32, 8), None) if e.tier == "vnni" else None, u, s)
    q = e.ld(wp, e.add(o, qs), _V(_I8, 16))
    v = e.shuf(e.nib_lo(q), e.nib_hi(q), range(32))
    if qh is not None:
        v = e.b.or_(v, e.bits_to_16(e.ld(wp, e.add(o, qh), _V(_I8, 4)), [j // 8 for j in range(32)]))
    return e.dot4(ir.Constant(_V(_I32, 8), None) if e.tier == "vnni" else None, v, x)


def _group_scales(e: _E, code, wp, o, sp, i, g) -> ir.Value:
    """<2g x float> [d_j dx_j, (m_j or d_j) xsum_j] for the g blocks from block i (byte o); sp = xs8 row."""
    bb, _, _, has_min, _ = _LEGACY[code]
    offs = [e.add(o, bb * j) for j in range(g)]
    if has_min:  # f16 d and f16 m are adjacent: one 32-bit load per block
        dm = e.halves(e.b.bitcast(e.gather(wp, offs, _I32), _V(_I16, 2 * g)))
    else:
        d = e.halves(e.gather(wp, offs, _I16))
        dm = e.shuf(d, None, [j // 2 for j in range(2 * g)])
    xs = e.ld(sp, e.mul(i, 8), _V(_FLT, 2 * g), align=4)
    return e.b.fmul(dm, xs)


def _legacy_rowdot_r(code, R):
    """Intrinsic (raw, roff, nb, xq, xoff, xs, soff, out, ooff, tier) -> None: R consecutive rows of nb blocks
    from byte roff of raw against activation vector xq[xoff:], xs[soff:] (flat offsets), into out[ooff:ooff+R].
    R = 2 shares the activation loads and the loop between two rows (rows of 18-20 blocks are short enough
    for the per-row overhead to show: -12 % for Q4_1 576 columns); Q5 types run out of registers with it."""
    _, _, _, _, factor = _LEGACY[code]
    bb = _LEGACY[code][0]

    def impl(typingctx, raw, roff, nb, xq, xoff, xs, soff, out, ooff, tier):
        t = _tier_of(tier)
        if not (_is_arr(raw, types.uint8) and _is_arr(xq, types.int8) and _is_arr(xs, types.float32)
                and _is_arr(out, types.float32) and t):
            return None
        sig = types.none(raw, types.intp, types.intp, xq, types.intp, xs, types.intp, out, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = _E(context, builder, t)
            b = builder
            at = signature.args
            r, ro, n, x, xo, s, so, o_, oo, _ = args
            rb = e.mul(n, bb)
            w0 = b.gep(e.base(at[0], r), [ro], source_etype=_I8)
            wps = [b.gep(w0, [e.mul(rb, j)], source_etype=_I8) for j in range(R)]
            xp = b.gep(e.base(at[3], x), [xo], source_etype=_I8)
            sp = b.gep(e.base(at[5], s), [e.mul(so, 4)], source_etype=_I8)
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
                        e.fmacc(acc, b.sitofp(isum, _V(_FLT, 8)), e.fperm8(sc, [4 * p] * 4 + [4 * p + 2] * 4))
            rem = b.sub(n, e.mul(ng, 4))
            with b.if_then(b.icmp_signed(">=", rem, e.i64(2))):  # one more pair
                i = e.mul(ng, 4)
                o = e.mul(i, bb)
                for wp, (acc0, acc1, corr) in zip(wps, accs):
                    sc = _group_scales(e, code, wp, o, sp, i, 2)
                    if factor:
                        e.facc(corr, e.shuf(sc, ir.Constant(sc.type, None), range(8)))
                    isum = _pair_isum(e, code, wp, o, xp, e.mul(i, 32))
                    e.fmacc(acc0, b.sitofp(isum, _V(_FLT, 8)), e.shuf(sc, None, [0] * 4 + [2] * 4))
            with b.if_then(b.icmp_signed("==", b.and_(rem, e.i64(1)), e.i64(1))):  # a last, unpaired block
                i = b.sub(n, e.i64(1))
                o = e.mul(i, bb)
                for wp, (acc0, acc1, corr) in zip(wps, accs):
                    sc = _group_scales(e, code, wp, o, sp, i, 1)
                    if factor:
                        e.facc(corr, e.shuf(sc, ir.Constant(sc.type, None), [0, 1] + [2] * 6))
                    isum = _single_isum(e, code, wp, o, xp, e.mul(i, 32))
                    e.fmacc(acc0, b.sitofp(isum, _V(_FLT, 8)), e.shuf(sc, None, [0] * 8))
            op = b.gep(e.base(at[7], o_), [e.mul(oo, 4)], source_etype=_I8)
            for j, (acc0, acc1, corr) in enumerate(accs):
                tot = b.fadd(b.load(acc0), b.load(acc1))
                if factor:
                    tot = e.call("llvm.fmuladd.v8f32", tot.type, [b.load(corr), e.vc(_FLT, [0.0, factor] * 4), tot])
                e.st(op, 4 * j, e.hsum_f(tot))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_rowdot{R}_{type_name(code).lower()}"
    return intrinsic(impl)


def _legacy_idots(code):
    """Intrinsic (raw, roff, nb, xq, xoff, out, ooff, tier) -> None: the nb per-block integer dots of one row
    into out[ooff:] (int32), from the same IR as the row kernels (tests check them exactly)."""
    bb = _LEGACY[code][0]

    def impl(typingctx, raw, roff, nb, xq, xoff, out, ooff, tier):
        t = _tier_of(tier)
        if not (_is_arr(raw, types.uint8) and _is_arr(xq, types.int8) and _is_arr(out, types.int32) and t):
            return None
        sig = types.none(raw, types.intp, types.intp, xq, types.intp, out, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = _E(context, builder, t)
            b = builder
            at = signature.args
            r, ro, n, x, xo, out_, oo, _ = args
            wp = b.gep(e.base(at[0], r), [ro], source_etype=_I8)
            xp = b.gep(e.base(at[3], x), [xo], source_etype=_I8)
            op = b.gep(e.base(at[5], out_), [e.mul(oo, 4)], source_etype=_I8)
            with e.loop(b.sdiv(n, e.i64(2))) as lp:
                i = e.mul(lp.index, 2)
                isum = _pair_isum(e, code, wp, e.mul(i, bb), xp, e.mul(i, 32))
                e.st(op, e.mul(i, 4), e.hsum_i(e.shuf(isum, None, [0, 1, 2, 3])))
                e.st(op, e.mul(e.add(i, 1), 4), e.hsum_i(e.shuf(isum, None, [4, 5, 6, 7])))
            with b.if_then(b.icmp_signed("==", b.and_(n, e.i64(1)), e.i64(1))):
                i = b.sub(n, e.i64(1))
                e.st(op, e.mul(i, 4), e.hsum_i(_single_isum(e, code, wp, e.mul(i, bb), xp, e.mul(i, 32))))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_idots_{type_name(code).lower()}"
    return intrinsic(impl)


# =========================================================================================================
# K-quant super-blocks (Q4_K, Q5_K, Q6_K) against Q8_K-style activations
# =========================================================================================================

_KBB = {_Q4_K: 144, _Q5_K: 176, _Q6_K: 210}


def _k4_scales(e: _E, wp, o) -> ir.Value:
    """Q4_K/Q5_K packed 6-bit scales at o+4 -> <16 x i16> [sc0..sc7, m0..m7] (reference.k_scale_min)."""
    b = e.b
    b0, b1, b2 = (e.ld(wp, e.add(o, 4 + 4 * j), _I32) for j in range(3))
    c = lambda v: ir.Constant(_I32, v)  # noqa: E731
    sc_lo, m_lo = b.and_(b0, c(0x3F3F3F3F)), b.and_(b1, c(0x3F3F3F3F))
    sc_hi = b.or_(b.and_(b2, c(0x0F0F0F0F)), b.and_(b.lshr(b0, c(2)), c(0x30303030)))
    m_hi = b.or_(b.and_(b.lshr(b2, c(4)), c(0x0F0F0F0F)), b.and_(b.lshr(b1, c(2)), c(0x30303030)))
    v = ir.Constant(_V(_I32, 4), None)
    for j, w in enumerate((sc_lo, sc_hi, m_lo, m_hi)):
        v = b.insert_element(v, w, ir.Constant(_I32, j))
    return b.zext(b.bitcast(v, _V(_I8, 16)), _V(_I16, 16))


def _k_isums(e: _E, code, wp, o, xp, xo, bp, bo):
    """One super-block at byte o against Q8_K activations at xo (sums at byte bo of bp):
    (<8 x i32> summing to the scaled integer dot, <4 x i32> summing to the min term, or None)."""
    b = e.b
    xs = [e.ld(xp, e.add(xo, 32 * j), _V(_I8, 32)) for j in range(8)]
    if code == _Q6_K:
        sc = b.sext(e.ld(wp, e.add(o, 192), _V(_I8, 16)), _V(_I16, 16))
        bs16 = e.ld(bp, e.add(bo, 16), _V(_I16, 16))  # the 16 sums over 16 weights
        isum = b.mul(e.madd_i16(sc, bs16), e.splat_c(_I32, -32, 8))  # the -32 offset of every weight
        for h in range(2):
            ql0, ql1 = e.ld(wp, e.add(o, 64 * h), _V(_I8, 32)), e.ld(wp, e.add(o, 64 * h + 32), _V(_I8, 32))
            qh = e.ld(wp, e.add(o, 128 + 32 * h), _V(_I8, 32))
            three = e.splat_c(_I8, 3, 32)
            for t, (ql, lo_nib) in enumerate(((ql0, True), (ql1, True), (ql0, False), (ql1, False))):
                low = e.nib_lo(ql) if lo_nib else e.nib_hi(ql)
                high = b.and_(b.lshr(qh, e.splat_c(_I8, 2 * t, 32)), three) if t else b.and_(qh, three)
                q = b.or_(low, b.shl(high, e.splat_c(_I8, 4, 32)))
                g = 8 * h + 2 * t  # scales of weights 0-15 and 16-31 of this 32
                p = e.madd_u8s8(q, xs[4 * h + t])
                isum = b.add(isum, e.madd_i16(p, e.shuf(sc, None, [g] * 8 + [g + 1] * 8)))
        return isum, None
    scm = _k4_scales(e, wp, o)
    mins = e.madd_i16(e.shuf(scm, None, range(8, 16)), e.ld(bp, bo, _V(_I16, 8)))  # m_s * bsum32_s
    qs = 16 if code == _Q4_K else 48
    qh = e.ld(wp, e.add(o, 16), _V(_I8, 32)) if code == _Q5_K else None
    isum = None
    for c in range(4):  # 64-weight chunk c: low nibbles = sub-block 2c, high nibbles = 2c + 1
        q = e.ld(wp, e.add(o, qs + 32 * c), _V(_I8, 32))
        for s, v in ((2 * c, e.nib_lo(q)), (2 * c + 1, e.nib_hi(q))):
            if qh is not None:  # the fifth bit of weight l of sub-block s is bit s of qh[l]
                bit = b.and_(b.lshr(qh, e.splat_c(_I8, s, 32)), e.splat_c(_I8, 1, 32))
                v = b.or_(v, b.shl(bit, e.splat_c(_I8, 4, 32)))
            part = e.madd_i16(e.madd_u8s8(v, xs[s]), e.shuf(scm, None, [s] * 16))
            isum = part if isum is None else b.add(isum, part)
    return isum, mins


def _k_rowdot(code):
    """Intrinsic (raw, roff, nsb, xq, xoff, xd, doff, xb, boff, tier) -> float32 for one row of nsb super-blocks
    (doff: f32 element offset into xd; boff: int16 element offset into xb)."""
    bb = _KBB[code]

    def impl(typingctx, raw, roff, nsb, xq, xoff, xd, doff, xb, boff, tier):
        t = _tier_of(tier)
        if not (_is_arr(raw, types.uint8) and _is_arr(xq, types.int8) and _is_arr(xd, types.float32)
                and _is_arr(xb, types.int16) and t):
            return None
        sig = types.float32(raw, types.intp, types.intp, xq, types.intp, xd, types.intp, xb, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = _E(context, builder, t)
            b = builder
            at = signature.args
            r, ro, n, x, xo, d, do, xb_, bo, _ = args
            wp = b.gep(e.base(at[0], r), [ro], source_etype=_I8)
            xp = b.gep(e.base(at[3], x), [xo], source_etype=_I8)
            dp = b.gep(e.base(at[5], d), [e.mul(do, 4)], source_etype=_I8)
            bp = b.gep(e.base(at[7], xb_), [e.mul(bo, 2)], source_etype=_I8)
            acc, accm = e.fvar(8), e.fvar(4)
            with e.loop(n) as lp:
                i = lp.index
                o = e.mul(i, bb)
                for line in range(0, bb, 64):
                    e.prefetch(wp, e.add(o, PREFETCH_BYTES + line))
                isum, mins = _k_isums(e, code, wp, o, xp, e.mul(i, QK_K), bp, e.mul(i, 2 * KB_SUMS))
                dx = e.ld(dp, e.mul(i, 4), _FLT, align=4)
                if code == _Q6_K:
                    dd = b.fmul(e.halves(e.ld(wp, e.add(o, 208), _V(_I16, 1))), e.splat(dx, 1))
                    e.fmacc(acc, b.sitofp(isum, _V(_FLT, 8)), e.shuf(dd, None, [0] * 8))
                else:  # f16 d, f16 dmin at o
                    dd = b.fmul(e.halves(e.ld(wp, o, _V(_I16, 2))), e.splat(dx, 2))
                    e.fmacc(acc, b.sitofp(isum, _V(_FLT, 8)), e.shuf(dd, None, [0] * 8))
                    e.fmacc(accm, b.sitofp(mins, _V(_FLT, 4)), e.shuf(dd, None, [1] * 4))
            res = e.hsum_f(b.load(acc))
            if code != _Q6_K:
                res = b.fsub(res, e.hsum_f(b.load(accm)))
            return res

        return sig, codegen

    impl.__name__ = f"_rowdot_{type_name(code).lower()}"
    return intrinsic(impl)


def _k_idots(code):
    """Intrinsic (raw, roff, nsb, xq, xoff, xb, boff, out, ooff, tier) -> None: per super-block the integer
    dot (sum of scale * quant dot) and the integer min term into out[ooff + 2 i], out[ooff + 2 i + 1]."""
    bb = _KBB[code]

    def impl(typingctx, raw, roff, nsb, xq, xoff, xb, boff, out, ooff, tier):
        t = _tier_of(tier)
        if not (_is_arr(raw, types.uint8) and _is_arr(xq, types.int8) and _is_arr(xb, types.int16)
                and _is_arr(out, types.int32) and t):
            return None
        sig = types.none(raw, types.intp, types.intp, xq, types.intp, xb, types.intp, out, types.intp, tier)

        def codegen(context, builder, signature, args):
            e = _E(context, builder, t)
            b = builder
            at = signature.args
            r, ro, n, x, xo, xb_, bo, out_, oo, _ = args
            wp = b.gep(e.base(at[0], r), [ro], source_etype=_I8)
            xp = b.gep(e.base(at[3], x), [xo], source_etype=_I8)
            bp = b.gep(e.base(at[5], xb_), [e.mul(bo, 2)], source_etype=_I8)
            op = b.gep(e.base(at[7], out_), [e.mul(oo, 4)], source_etype=_I8)
            with e.loop(n) as lp:
                i = lp.index
                isum, mins = _k_isums(e, code, wp, e.mul(i, bb), xp, e.mul(i, QK_K), bp, e.mul(i, 2 * KB_SUMS))
                e.st(op, e.mul(i, 8), e.hsum_i(isum))
                e.st(op, e.add(e.mul(i, 8), 4), ir.Constant(_I32, 0) if mins is None else e.hsum_i(mins))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_idots_{type_name(code).lower()}"
    return intrinsic(impl)


_rd_q4_0, _rd_q4_1, _rd_q5_0, _rd_q5_1, _rd_q8_0 = (_legacy_rowdot_r(c, 1) for c in (_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0))
_rd2_q4_0, _rd2_q4_1, _rd2_q8_0 = (_legacy_rowdot_r(c, 2) for c in (_Q4_0, _Q4_1, _Q8_0))
_rd_q4_k, _rd_q5_k, _rd_q6_k = (_k_rowdot(c) for c in (_Q4_K, _Q5_K, _Q6_K))
_id_q4_0, _id_q4_1, _id_q5_0, _id_q5_1, _id_q8_0 = (_legacy_idots(c) for c in (_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0))
_id_q4_k, _id_q5_k, _id_q6_k = (_k_idots(c) for c in (_Q4_K, _Q5_K, _Q6_K))


# =========================================================================================================
# Activation quantization (numba; exact f32 arithmetic, so the numpy reference matches bit for bit)
# =========================================================================================================

# Each block is one IR intrinsic with explicit vector ops (a numba loop over 32 floats would be scalarized).
# Plain IEEE ops, no fast-math flags: amax / 127, 1 / d, x * inv and rint round exactly as the numpy reference.
# (NaN inputs give unspecified quants: maxnum skips NaNs where numpy's max propagates them.)


def _quant_vec(e: _E, v, inv) -> ir.Value:
    """<n x float> -> <n x i32>: rint(v * inv)."""
    n = v.type.count
    r = e.call(f"llvm.rint.v{n}f32", v.type, [e.b.fmul(v, e.splat(inv, n))])
    return e.b.fptosi(r, _V(_I32, n))


def _scale_of(e: _E, amax):
    """d = amax / 127 and inv = 1 / d (0 when d is 0)."""
    b = e.b
    d = b.fdiv(amax, ir.Constant(_FLT, 127.0))
    inv = b.select(b.fcmp_ordered(">", d, ir.Constant(_FLT, 0.0)), b.fdiv(ir.Constant(_FLT, 1.0), d),
                   ir.Constant(_FLT, 0.0))
    return d, inv


def _absmax(e: _E, vs) -> ir.Value:
    n = vs[0].type.count
    m = e.call(f"llvm.fabs.v{n}f32", vs[0].type, [vs[0]])
    for v in vs[1:]:
        m = e.call(f"llvm.maxnum.v{n}f32", m.type, [m, e.call(f"llvm.fabs.v{n}f32", v.type, [v])])
    return e.call(f"llvm.vector.reduce.fmax.v{n}f32", _FLT, [m])


@intrinsic
def _quant32(typingctx, x, xo, xq, lo, hi, xs, so):
    """x[xo:xo+32] (flat f32 offset) -> int8 q of weights 0-15 at xq[lo:], 16-31 at xq[hi:]; xs[so] = d,
    xs[so + 1] = d * sum(q)."""
    if not (_is_arr(x, types.float32) and _is_arr(xq, types.int8) and _is_arr(xs, types.float32)):
        return None
    sig = types.none(x, types.intp, xq, types.intp, types.intp, xs, types.intp)

    def codegen(context, builder, signature, args):
        e = _E(context, builder, "generic")
        b = builder
        at = signature.args
        x_, xo_, xq_, lo_, hi_, xs_, so_ = args
        v = e.ld(e.base(at[0], x_), e.mul(xo_, 4), _V(_FLT, 32), align=4)
        d, inv = _scale_of(e, _absmax(e, [v]))
        qi = _quant_vec(e, v, inv)
        q8 = b.trunc(qi, _V(_I8, 32))
        qp = e.base(at[2], xq_)
        e.st(qp, lo_, e.shuf(q8, None, range(16)))
        e.st(qp, hi_, e.shuf(q8, None, range(16, 32)))
        sp = e.base(at[5], xs_)
        e.st(sp, e.mul(so_, 4), d)
        e.st(sp, e.mul(e.add(so_, 1), 4), b.fmul(d, b.sitofp(e.hsum_i(qi), _FLT)))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _quant256(typingctx, x, xo, xq, qo, xd, do, xb, bo):
    """x[xo:xo+256] -> int8 q at xq[qo:], d at xd[do], at xb[bo:] (int16) 8 sums over 32 then 16 over 16."""
    if not (_is_arr(x, types.float32) and _is_arr(xq, types.int8) and _is_arr(xd, types.float32)
            and _is_arr(xb, types.int16)):
        return None
    sig = types.none(x, types.intp, xq, types.intp, xd, types.intp, xb, types.intp)

    def codegen(context, builder, signature, args):
        e = _E(context, builder, "generic")
        b = builder
        at = signature.args
        x_, xo_, xq_, qo_, xd_, do_, xb_, bo_ = args
        xp = b.gep(e.base(at[0], x_), [e.mul(xo_, 4)], source_etype=_I8)
        vs = [e.ld(xp, 128 * c, _V(_FLT, 32), align=4) for c in range(8)]
        d, inv = _scale_of(e, _absmax(e, vs))
        qp = b.gep(e.base(at[2], xq_), [qo_], source_etype=_I8)
        bp = b.gep(e.base(at[6], xb_), [e.mul(bo_, 2)], source_etype=_I8)
        for c, v in enumerate(vs):
            qi = _quant_vec(e, v, inv)
            e.st(qp, 32 * c, b.trunc(qi, _V(_I8, 32)))
            s0, s1 = e.hsum_i(e.shuf(qi, None, range(16))), e.hsum_i(e.shuf(qi, None, range(16, 32)))
            e.st(bp, 2 * c, b.trunc(b.add(s0, s1), _I16))
            e.st(bp, 2 * (8 + 2 * c), b.trunc(s0, _I16))
            e.st(bp, 2 * (9 + 2 * c), b.trunc(s1, _I16))
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
            _quant32(x, m * K + blk * 32, xq, lo, hi, xs, m * 2 * nb + 2 * blk)


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


# =========================================================================================================
# Row drivers: rows [r0, r1) of one matrix against all M activation vectors, into out[:, c0 + r]
# =========================================================================================================


# One function per type, not a factory: numba keys a closure's cache entry on its pickled cells, and an
# intrinsic pickles with a per-process id, so closures would never hit the cache.


@njit(cache=True)
def _rows_q4_0(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
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
def _rows_q4_1(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
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
def _rows_q5_0(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    for r in range(r0, r1):
        for m in range(M):  # the row stays in L1 across the M vectors
            _rd_q5_0(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)


@njit(cache=True)
def _rows_q5_1(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
    K, ns = xq.shape[1], xs.shape[1]
    M, R = out.shape
    for r in range(r0, r1):
        for m in range(M):  # the row stays in L1 across the M vectors
            _rd_q5_1(raw, base + r * rb, K // 32, xq, m * K, xs, m * ns, out, m * R + c0 + r, tier)


@njit(cache=True)
def _rows_q8_0(raw, base, rb, r0, r1, xq, xs, out, c0, tier):
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
def _rows_q4_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    K = xq.shape[1]
    nsb = K // 256
    for r in range(r0, r1):
        for m in range(out.shape[0]):
            out[m, c0 + r] = _rd_q4_k(raw, base + r * rb, nsb, xq, m * K, xd, m * nsb, xb, m * nsb * 24, tier)


@njit(cache=True)
def _rows_q5_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    K = xq.shape[1]
    nsb = K // 256
    for r in range(r0, r1):
        for m in range(out.shape[0]):
            out[m, c0 + r] = _rd_q5_k(raw, base + r * rb, nsb, xq, m * K, xd, m * nsb, xb, m * nsb * 24, tier)


@njit(cache=True)
def _rows_q6_k(raw, base, rb, r0, r1, xq, xd, xb, out, c0, tier):
    K = xq.shape[1]
    nsb = K // 256
    for r in range(r0, r1):
        for m in range(out.shape[0]):
            out[m, c0 + r] = _rd_q6_k(raw, base + r * rb, nsb, xq, m * K, xd, m * nsb, xb, m * nsb * 24, tier)


# --- float weights: plain f32 dot products (fastmath so the reduction vectorizes) ---


@njit(cache=True, fastmath=True)
def _rows_f32(raw, base, rb, r0, r1, x, out, c0):
    K = x.shape[1]
    flat = raw.reshape(-1)
    for r in range(r0, r1):
        w = flat[base + r * rb : base + (r + 1) * rb].view(np.float32)
        for m in range(out.shape[0]):
            acc = np.float32(0.0)
            for c in range(K):
                acc += w[c] * x[m, c]
            out[m, c0 + r] = acc


@njit(cache=True, fastmath=True)
def _rows_f16(raw, base, rb, r0, r1, x, out, c0):
    K = x.shape[1]
    flat = raw.reshape(-1)
    for r in range(r0, r1):
        h = flat[base + r * rb : base + (r + 1) * rb].view(np.uint16)
        for m in range(out.shape[0]):
            acc = np.float32(0.0)
            for c in range(K):
                acc += _half_bits_to_f32(h[c]) * x[m, c]
            out[m, c0 + r] = acc


@njit(cache=True, fastmath=True)
def _rows_bf16(raw, base, rb, r0, r1, x, out, c0):
    K = x.shape[1]
    flat = raw.reshape(-1)
    for r in range(r0, r1):
        h = flat[base + r * rb : base + (r + 1) * rb].view(np.uint16)
        for m in range(out.shape[0]):
            acc = np.float32(0.0)
            for c in range(K):  # bf16 = the high half of an f32
                acc += _u32_bits_to_f32(np.uint32(h[c]) << np.uint32(16)) * x[m, c]
            out[m, c0 + r] = acc


@njit(cache=True)
def rows_into(code, raw, base, rb, r0, r1, xq8, xs8, xqk, xdk, xbk, x, out, c0, tier):
    """Rows [r0, r1) of one matrix whose row r starts at byte base + r * rb of raw (a matrix, base 0, or a
    whole-file buffer), into out[:, c0 + r]; dispatched on its type code (once per chunk: negligible)."""
    if code == _Q4_0:
        _rows_q4_0(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == _Q4_1:
        _rows_q4_1(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == _Q5_0:
        _rows_q5_0(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == _Q5_1:
        _rows_q5_1(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == _Q8_0:
        _rows_q8_0(raw, base, rb, r0, r1, xq8, xs8, out, c0, tier)
    elif code == _Q4_K:
        _rows_q4_k(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == _Q5_K:
        _rows_q5_k(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == _Q6_K:
        _rows_q6_k(raw, base, rb, r0, r1, xqk, xdk, xbk, out, c0, tier)
    elif code == _F16:
        _rows_f16(raw, base, rb, r0, r1, x, out, c0)
    elif code == _BF16:
        _rows_bf16(raw, base, rb, r0, r1, x, out, c0)
    else:  # _F32; the Python wrappers reject every other code
        _rows_f32(raw, base, rb, r0, r1, x, out, c0)


@njit(parallel=True, cache=True)
def matvec_into(raws, codes, starts, xq8, xs8, xqk, xdk, xbk, x, out, n_chunks, tier):
    """out[:, starts[i]:starts[i+1]] = x @ W_i.T for the matrices raws[i] (a tuple of (rows_i, row_bytes_i)
    uint8 arrays with type codes[i]), all sharing one input: its legacy (xq8, xs8) and K (xqk, xdk, xbk)
    quantizations and its f32 values x (M, K). Arrays a matrix's types do not need may be empty.
    The rows of all matrices are split into n_chunks equal ranges, run in parallel."""
    total = starts[len(raws)]
    for ch in prange(n_chunks):
        lo, hi = ch * total // n_chunks, (ch + 1) * total // n_chunks
        for i in range(len(raws)):
            a, z = max(lo, starts[i]), min(hi, starts[i + 1])
            if a < z:
                # Flat, as the decode step's file buffer, and offsets typed int64 (a literal 0 would be a type
                # of its own): both share one compiled specialization of every row kernel (each one more cost
                # ~5-10 s of the first run's compile).
                rows_into(codes[i], raws[i].reshape(-1), np.int64(0), raws[i].shape[1], a - starts[i], z - starts[i],
                          xq8, xs8, xqk, xdk, xbk, x, out, np.int64(starts[i]), tier)


@njit(cache=True)
def _integer_dots(code, raw, xq8, xqk, xbk, out, tier):
    # out (M, rows, n) int32: n = K/32 block dots (legacy) or 2 per super-block (K types)
    rb = raw.shape[1]
    for r in range(raw.shape[0]):
        for m in range(out.shape[0]):
            oo = (m * out.shape[1] + r) * out.shape[2]
            if code == _Q4_0:
                _id_q4_0(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == _Q4_1:
                _id_q4_1(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == _Q5_0:
                _id_q5_0(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == _Q5_1:
                _id_q5_1(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            elif code == _Q8_0:
                _id_q8_0(raw, r * rb, xq8.shape[1] // 32, xq8, m * xq8.shape[1], out, oo, tier)
            else:
                nsb = xqk.shape[1] // 256
                bo = m * nsb * 24
                if code == _Q4_K:
                    _id_q4_k(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, bo, out, oo, tier)
                elif code == _Q5_K:
                    _id_q5_k(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, bo, out, oo, tier)
                else:
                    _id_q6_k(raw, r * rb, nsb, xqk, m * xqk.shape[1], xbk, bo, out, oo, tier)


@njit(cache=True)
def _matvec3(w0, t0, w1, t1, w2, t2, xq8, xs8, xqk, xdk, xbk, x, out, n_chunks, tier):
    # Up to three matrices as plain array arguments: numba unboxes arrays on its fast C path, while a tuple
    # of arrays is typed in Python (several us per call). Unused slots have 0 rows.
    s1 = w0.shape[0]
    s2 = s1 + w1.shape[0]
    matvec_into((w0, w1, w2), (t0, t1, t2), (0, s1, s2, s2 + w2.shape[0]), xq8, xs8, xqk, xdk, xbk, x, out,
                n_chunks, tier)


# =========================================================================================================
# Public API
# =========================================================================================================

_LEGACY_CODES = frozenset(int(t) for t in LEGACY_TYPES)
_K_CODES = frozenset(int(t) for t in K_TYPES)
_CODES = frozenset(int(t) for t in GGMLType)
_NONE_I8, _NONE_F32, _NONE_I16 = np.empty((0, 0), np.int8), np.empty((0, 0), np.float32), np.empty((0, 0, 0), np.int16)
_NO_WEIGHT = np.empty((0, 1), np.uint8)
_NO_WEIGHT.flags.writeable = False


def _readonly(raw: np.ndarray) -> np.ndarray:
    """Weights go to the kernels as read-only views (mmapped GGUF data is): one compiled specialization."""
    if raw.flags.writeable:
        raw = raw.view()
        raw.flags.writeable = False
    return raw


class QInput(NamedTuple):
    """One input (M, K) in every form the matrices reading it need; unused forms are empty arrays."""

    x: np.ndarray  # (M, K) f32
    xq8: np.ndarray  # (M, K) int8, pair-interleaved (legacy blocks)
    xs8: np.ndarray  # (M, 2 * K/32) f32 [dx, dx * sum(q)] per block
    xqk: np.ndarray  # (M, K) int8 (K super-blocks)
    xdk: np.ndarray  # (M, K/256) f32
    xbk: np.ndarray  # (M, K/256, 24) int16

    @property
    def shape(self) -> tuple[int, int]:
        return self.x.shape


class Prepared(NamedTuple):
    """Matrices sharing one input, checked once (prepare()); reuse it on every call to skip the checks."""

    raws: tuple  # (rows_i, row_bytes_i) uint8 C arrays
    codes: tuple  # GGML type ids
    cols: int
    rows: int  # total
    legacy: bool  # some matrix needs the legacy activation blocks
    kquant: bool  # some matrix needs the K super-block activations


def prepare(ws: Sequence) -> Prepared:
    """Check matrices (QTensors or (raw, type) pairs) that read the same input: same cols, supported types."""
    raws, codes, cols = [], [], None
    for w in ws:
        raw, code, name = (w.raw, int(w.ggml_type), w.name) if isinstance(w, QTensor) else (w[0], int(w[1]), "weight")
        if code not in _CODES:
            raise NotImplementedError(f"{name}: no CPU kernel for {type_name(code)}")
        t = GGMLType(code)
        block = QK_K if t in K_TYPES else QK if t in LEGACY_TYPES else 1
        n = raw.shape[1] * block // row_bytes(t, block) if raw.ndim == 2 else -1
        if cols is None:
            cols = n
        if (raw.dtype != np.uint8 or raw.ndim != 2 or n != cols or row_bytes(t, n) != raw.shape[1]
                or not raw.flags.c_contiguous):
            raise ValueError(f"{name}: raw {raw.dtype}{raw.shape} is not C-contiguous rows of {cols} {t.name} weights")
        raws.append(_readonly(raw))
        codes.append(code)
    if not raws:
        raise ValueError("no matrices given")
    return Prepared(tuple(raws), tuple(codes), cols, sum(r.shape[0] for r in raws),
                    any(c in _LEGACY_CODES for c in codes), any(c in _K_CODES for c in codes))


def quantize(x: np.ndarray, ggml_types: Sequence[GGMLType | int] | Prepared = tuple(LEGACY_TYPES)) -> QInput:
    """Quantize x (M, K) (or (K,)) once for matrices of the given types (or a Prepared group); default: the
    legacy block types."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"x must be (M, K) float32, got shape {x.shape}")
    M, K = x.shape
    if isinstance(ggml_types, Prepared):
        legacy, kquant = ggml_types.legacy, ggml_types.kquant
    else:
        codes = {int(t) for t in ggml_types}
        legacy, kquant = not codes.isdisjoint(_LEGACY_CODES), not codes.isdisjoint(_K_CODES)
    xq8, xs8, xqk, xdk, xbk = _NONE_I8, _NONE_F32, _NONE_I8, _NONE_F32, _NONE_I16
    if legacy:
        if K % QK:
            raise ValueError(f"K = {K} is not a multiple of {QK}")
        xq8, xs8 = np.empty((M, K), np.int8), np.empty((M, 2 * (K // QK)), np.float32)
        quantize_legacy_into(x, xq8, xs8, 0, K)
    if kquant:
        if K % QK_K:
            raise ValueError(f"K = {K} is not a multiple of {QK_K}")
        xqk, xdk = np.empty((M, K), np.int8), np.empty((M, K // QK_K), np.float32)
        xbk = np.empty((M, K // QK_K, KB_SUMS), np.int16)
        quantize_k_into(x, xqk, xdk, xbk, 0, K)
    return QInput(x, xq8, xs8, xqk, xdk, xbk)


def _check_input(p: Prepared, qin: QInput) -> None:
    M, K = qin.x.shape
    if K != p.cols:
        raise ValueError(f"input has {K} columns, the weights {p.cols}")
    if (p.legacy and qin.xq8.shape != (M, K)) or (p.kquant and qin.xqk.shape != (M, K)):
        kinds = [GGMLType(c).name for c in p.codes]
        raise ValueError(f"the input was not quantized for {', '.join(kinds)} (quantize(x, types) must list them)")


def matvec(ws: Sequence | Prepared, qin: QInput, out: np.ndarray | None = None, tier: str | None = None,
           n_chunks: int | None = None) -> np.ndarray:
    """x @ W_i.T for every matrix in ws (QTensors, (raw, type) pairs or a Prepared group), concatenated:
    (M, sum of rows) f32. All matrices read the same quantized input and run in one parallel call."""
    p = ws if isinstance(ws, Prepared) else prepare(ws)
    _check_input(p, qin)
    M = qin.x.shape[0]
    if out is None:
        out = np.empty((M, p.rows), np.float32)
    elif out.dtype != np.float32 or out.shape != (M, p.rows) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {(M, p.rows)}, got {out.dtype}{out.shape}")
    if p.rows == 0 or M == 0:
        return out
    if n_chunks is None:  # a few chunks per thread (static schedule); the launched pool size is a cheap bound
        n_chunks = max(1, min(p.rows, 4 * numba.config.NUMBA_NUM_THREADS))
    tok = tier_token(tier)
    if len(p.raws) <= 3:
        w = p.raws + (_NO_WEIGHT,) * (3 - len(p.raws))
        c = p.codes + (_F32,) * (3 - len(p.codes))
        _matvec3(w[0], c[0], w[1], c[1], w[2], c[2], qin.xq8, qin.xs8, qin.xqk, qin.xdk, qin.xbk, qin.x, out,
                 n_chunks, tok)
    else:
        starts = np.cumsum((0,) + tuple(r.shape[0] for r in p.raws)).astype(np.int64)
        matvec_into(p.raws, np.array(p.codes, np.int64), starts, qin.xq8, qin.xs8, qin.xqk, qin.xdk, qin.xbk,
                    qin.x, out, n_chunks, tok)
    return out


def dequantized_input(qin: QInput, ggml_type: GGMLType | int) -> np.ndarray:
    """The activations the kernels compute with for weights of ggml_type, as f32 (M, K): the int8 values times
    their block scales (x itself for float weights). Oracles (tests, the self-test) multiply these in float64."""
    M, K = qin.shape
    t = GGMLType(int(ggml_type))
    if t in LEGACY_TYPES:
        q = np.empty_like(qin.xq8)
        q[:, legacy_x_order(K)] = qin.xq8
        return (q.reshape(M, -1, QK) * qin.xs8.reshape(M, -1, 2)[..., :1]).reshape(M, K)
    if t in K_TYPES:
        return (qin.xqk.reshape(M, -1, QK_K) * qin.xdk[..., None]).reshape(M, K)
    return qin.x


def integer_dots(w, qin: QInput, tier: str | None = None) -> np.ndarray:
    """The kernels' integer dot products of every row against every input vector (tests, debugging):
    legacy types (M, rows, K/32) = sum(u * x) per block, u the stored unsigned quant (signed q for Q8_0);
    K types (M, rows, K/256, 2) = [sum_s scale_s * sum(u * x), sum_s min_s * bsum_s] (Q6_K: offset included,
    second entry 0)."""
    p = prepare([w])
    _check_input(p, qin)
    raw, code = p.raws[0], p.codes[0]
    M, K = qin.shape
    t = GGMLType(code)
    if t in FLOAT_TYPES:
        raise ValueError(f"{t.name} weights have no integer dot product")
    n = K // QK if t in LEGACY_TYPES else 2 * (K // QK_K)
    out = np.zeros((M, raw.shape[0], n), np.int32)
    _integer_dots(code, raw, qin.xq8, qin.xqk, qin.xbk, out, tier_token(tier))
    return out.reshape(M, raw.shape[0], K // QK) if t in LEGACY_TYPES else out.reshape(M, raw.shape[0], -1, 2)
