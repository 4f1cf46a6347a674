"""The LLVM-IR toolkit and the CPU code tiers of the integer kernels (legacy.py, kquant.py, quantize.py, driven by
int8.py), also used by the packed layout (packed.py) and attention (attention.py).

Codegen (docs/design-log.md, "The CPU kernel measurements", 1): the per-row dot products are small LLVM-IR intrinsics
with explicit vector ops and the block loop in IR, because numba loops over 32-byte blocks are unrolled, then
scalarized (far below memory bandwidth; docs/benchmarks.md, "Measurements behind the code", IR intrinsics).
Emitter holds the IR emission helpers of one intrinsic's codegen (addressing, vector constants and shuffles, the
tier-specific integer dot primitives); tier_of and is_arr check its argument types.

Code tiers (selected from the CPU features at import; GOINFER_CPU_TIER=generic|avx2|vnni forces one):
  generic  plain LLVM vector IR, no target intrinsics: any CPU numba runs on (the fallback)
  avx2     vpmaddubsw + vpmaddwd (u8 x s8 pairs -> i16 -> i32), as llama.cpp's AVX2 path
  vnni     vpdpbusd (AVX-VNNI or AVX512-VNNI+VL) for the 32-weight block types; K-quants as avx2
The tier reaches the compiled code as the *type* of a token argument (int8/int16/int32), so each tier is its own
specialization and its own cache entry. The code never emits an instruction the host lacks: a forced tier the
CPU cannot run is refused in Python (LLVM would abort the process).

Also here, shared by the kernel modules: the GGML type codes as plain ints (numba compiles a global int as a
constant) and PREFETCH_BYTES, the software prefetch distance of the row kernels.
"""

from __future__ import annotations

import functools
import os

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils

from engine.kernels.quant_types import GGMLType

F32_CODE, F16_CODE, BF16_CODE = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
Q4_0_CODE, Q4_1_CODE, Q5_0_CODE, Q5_1_CODE, Q8_0_CODE = (int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0),
                                                         int(GGMLType.Q5_1), int(GGMLType.Q8_0))
Q4_K_CODE, Q5_K_CODE, Q6_K_CODE = int(GGMLType.Q4_K), int(GGMLType.Q5_K), int(GGMLType.Q6_K)
MXFP4_CODE = int(GGMLType.MXFP4)
Q2_K_CODE, Q3_K_CODE, IQ4_NL_CODE, IQ4_XS_CODE, TQ1_0_CODE, TQ2_0_CODE = (
    int(GGMLType.Q2_K), int(GGMLType.Q3_K), int(GGMLType.IQ4_NL), int(GGMLType.IQ4_XS), int(GGMLType.TQ1_0),
    int(GGMLType.TQ2_0))
# Software prefetch distance along each weight row stream (about DRAM latency x one core's read rate). The
# hardware prefetcher alone left compute and DRAM reads serialized: on the Zen 3 dev box prefetching every line
# of each group made a token's matvecs faster, SmolLM2's somewhat and Gemma's about twice as fast; 1 KB and 2 KB
# ahead measured alike, 4 KB slightly worse (docs/benchmarks.md, "Measurements behind the code", prefetch distance).
PREFETCH_BYTES = 1024

# =========================================================================================================
# Tiers
# =========================================================================================================

TIERS = ("generic", "avx2", "vnni")
_TOKENS = {"generic": np.int8(0), "avx2": np.int16(0), "vnni": np.int32(0)}
_TIER_OF_BITS = {8: "generic", 16: "avx2", 32: "vnni"}


def target_features() -> set[str]:
    """The CPU features numba compiles for: NUMBA_CPU_FEATURES when set (portable caches), else the host's."""
    forced = numba.config.CPU_FEATURES
    if forced is not None:
        return {f[1:] for f in forced.split(",") if f.startswith("+")}
    return {k for k, v in llvm_binding.get_host_cpu_features().items() if v}


@functools.cache
def available_tiers() -> tuple[str, ...]:
    """The tiers the compilation target (normally this CPU) can run, best last."""
    f = target_features()
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

I8, I16, I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
FLT, _HALF = ir.FloatType(), ir.HalfType()
V = ir.VectorType


class Emitter:
    """IR emission helpers for one intrinsic call. Pointers are i8* with byte offsets (i64 or int)."""

    def __init__(self, context, builder, tier: str):
        self.c, self.b, self.tier = context, builder, tier

    # --- addressing and constants ---
    def base(self, aryty, ary) -> ir.Value:
        data = self.c.make_array(aryty)(self.c, self.b, ary).data
        return self.b.bitcast(data, I8.as_pointer())

    def i64(self, v) -> ir.Value:
        return v if isinstance(v, ir.Value) else ir.Constant(_I64, v)

    def add(self, a, c) -> ir.Value:
        if not isinstance(c, ir.Value) and c == 0:
            return self.i64(a)
        return self.b.add(self.i64(a), self.i64(c))

    def mul(self, a, c) -> ir.Value:
        return self.b.mul(self.i64(a), self.i64(c))

    def ld(self, p, off, ty, align=1) -> ir.Value:
        at = self.b.gep(p, [self.i64(off)], source_etype=I8)
        return self.b.load(self.b.bitcast(at, ty.as_pointer()), typ=ty, align=align)

    def st(self, p, off, v) -> None:
        at = self.b.gep(p, [self.i64(off)], source_etype=I8)
        self.b.store(v, self.b.bitcast(at, v.type.as_pointer()), align=1)

    def vc(self, ty, vals) -> ir.Constant:
        return ir.Constant(V(ty, len(vals)), list(vals))

    def splat_c(self, ty, val, n) -> ir.Constant:
        return ir.Constant(V(ty, n), [val] * n)

    def shuf(self, a, c, idx) -> ir.Value:
        return self.b.shuffle_vector(a, a if c is None else c, self.vc(I32, idx))

    def splat(self, x, n) -> ir.Value:
        v = self.b.insert_element(ir.Constant(V(x.type, n), None), x, ir.Constant(I32, 0))
        return self.shuf(v, None, [0] * n)

    def gather(self, p, offs, ty) -> ir.Value:
        """<len(offs) x ty> of scalars loaded at byte offsets offs (i64 values)."""
        v = ir.Constant(V(ty, len(offs)), None)
        for j, o in enumerate(offs):
            v = self.b.insert_element(v, self.ld(p, o, ty), ir.Constant(I32, j))
        return v

    def halves(self, v) -> ir.Value:
        """<n x i16> holding IEEE halves -> <n x float>, exact."""
        n = v.type.count
        return self.b.fpext(self.b.bitcast(v, V(_HALF, n)), V(FLT, n))

    def call(self, name, ret, args) -> ir.Value:
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return self.b.call(cgutils.get_or_insert_function(self.b.module, fnty, name), args)

    def hsum_i(self, v) -> ir.Value:
        return self.call(f"llvm.vector.reduce.add.v{v.type.count}i32", I32, [v])

    def hsum_f(self, v) -> ir.Value:
        """Sum of the lanes as a halving tree (llvm.vector.reduce.fadd without reassoc is a serial chain)."""
        n = v.type.count
        while n > 1:
            n //= 2
            v = self.b.fadd(self.shuf(v, None, range(n)), self.shuf(v, None, range(n, 2 * n)))
        return self.b.extract_element(v, ir.Constant(I32, 0))

    # --- integer dot primitives (tier-specific) ---
    def madd_u8s8(self, u, x) -> ir.Value:
        """<2n x i8> unsigned u, signed x -> <n x i16>: u[2i] x[2i] + u[2i+1] x[2i+1] (callers keep it < 2^15)."""
        n2 = u.type.count
        if self.tier != "generic" and n2 == 32:
            return self.call("llvm.x86.avx2.pmadd.ub.sw", V(I16, 16), [u, x])
        b = self.b
        p = b.mul(b.zext(u, V(I16, n2)), b.sext(x, V(I16, n2)))
        return b.add(self.shuf(p, None, range(0, n2, 2)), self.shuf(p, None, range(1, n2, 2)))

    def madd_i16(self, a, c) -> ir.Value:
        """<2n x i16> a, c -> <n x i32>: a[2i] c[2i] + a[2i+1] c[2i+1]."""
        n2 = a.type.count
        if self.tier != "generic" and n2 in (8, 16):
            name = "llvm.x86.avx2.pmadd.wd" if n2 == 16 else "llvm.x86.sse2.pmadd.wd"
            return self.call(name, V(I32, n2 // 2), [a, c])
        b = self.b
        p = b.mul(b.sext(a, V(I32, n2)), b.sext(c, V(I32, n2)))
        return b.add(self.shuf(p, None, range(0, n2, 2)), self.shuf(p, None, range(1, n2, 2)))

    def dot4(self, acc, u, x) -> ir.Value:
        """acc <8 x i32> + the sums of 4 consecutive u8 x s8 products per lane (32 bytes each)."""
        if self.tier == "vnni":
            v8 = V(I32, 8)
            return self.call("llvm.x86.avx512.vpdpbusd.256", v8, [acc, self.b.bitcast(u, v8), self.b.bitcast(x, v8)])
        s = self.madd_i16(self.madd_u8s8(u, x), self.splat_c(I16, 1, 16))
        return s if acc is None else self.b.add(acc, s)

    def dot4_small(self, u1, x1, u2, x2) -> ir.Value:
        """dot4 of two (u, x) pairs whose u8 x s8 pair sums stay below 2^14 (u <= 63): adds in i16."""
        if self.tier == "vnni":
            return self.dot4(self.dot4(ir.Constant(V(I32, 8), None), u1, x1), u2, x2)
        p = self.b.add(self.madd_u8s8(u1, x1), self.madd_u8s8(u2, x2))
        return self.madd_i16(p, self.splat_c(I16, 1, 16))

    def abs_sign(self, w, x):
        """Signed w, x -> (|w| as u8, x * sign(w)): u8 x s8 products then equal w x (w = -128 included)."""
        if self.tier != "generic":
            v = V(I8, 32)
            return (self.call("llvm.x86.avx2.psign.b", v, [w, w]), self.call("llvm.x86.avx2.psign.b", v, [x, w]))
        b, zero = self.b, ir.Constant(w.type, None)
        neg = b.icmp_signed("<", w, zero)
        return b.select(neg, b.sub(zero, w), w), b.select(neg, b.sub(zero, x), x)

    # --- misc ---
    def nib_lo(self, v) -> ir.Value:
        return self.b.and_(v, self.splat_c(I8, 15, v.type.count))

    def nib_hi(self, v) -> ir.Value:
        return self.b.lshr(v, self.splat_c(I8, 4, v.type.count))

    def lut16(self, idx, table) -> ir.Value:
        """<32 x i8> indices 0..15 -> table[idx] lane-wise (table: 16 ints in i8 range): one vpshufb on AVX2
        (the table in both 128-bit halves). Generic IR has no variable lookup: a tree of selects on the index
        bits there, 15 selects and 4 bit tests (a compare-select per entry took twice as long)."""
        if self.tier != "generic":
            return self.call("llvm.x86.avx2.pshuf.b", idx.type, [self.vc(I8, list(table) * 2), idx])
        level = [self.splat_c(I8, val, 32) for val in table]
        for bit in range(4):  # pick between neighbours by bit 0, then pairs of those by bit 1, ...
            on = self.b.icmp_unsigned("!=", self.b.and_(idx, self.splat_c(I8, 1 << bit, 32)),
                                      ir.Constant(idx.type, None))
            level = [self.b.select(on, level[k + 1], level[k]) for k in range(0, len(level), 2)]
        return level[0]

    def bits_to_16(self, h, sel) -> ir.Value:
        """<32 x i8>: 16 where bit (lane % 8) of byte h[sel[lane]] is set, else 0 (a Q5 fifth bit)."""
        rep = self.shuf(h, None, sel)
        m = self.b.and_(rep, self.vc(I8, [1 << (j % 8) for j in range(32)]))
        nz = self.b.icmp_unsigned("!=", m, ir.Constant(m.type, None))
        return self.b.shl(self.b.zext(nz, V(I8, 32)), self.splat_c(I8, 4, 32))

    def fvar(self, n):
        """A zeroed <n x float> accumulator (an alloca that LLVM keeps in a register)."""
        return cgutils.alloca_once_value(self.b, ir.Constant(V(FLT, n), [0.0] * n))

    def facc(self, var, v) -> None:
        self.b.store(self.b.fadd(self.b.load(var), v), var)

    def fmacc(self, var, a, c) -> None:
        """var += a * c, fused where the target can (llvm.fmuladd)."""
        n = a.type.count
        self.b.store(self.call(f"llvm.fmuladd.v{n}f32", a.type, [a, c, self.b.load(var)]), var)

    def fperm8(self, v, idx) -> ir.Value:
        """<8 x float> lanes idx of v: one vpermps on AVX2 (LLVM's own lowering takes two shuffles)."""
        if self.tier != "generic" and v.type.count == 8:
            return self.call("llvm.x86.avx2.permps", v.type, [v, self.vc(I32, idx)])
        return self.shuf(v, None, idx)

    def prefetch(self, p, off) -> None:
        """Ask for the cache line at p + off (read, keep in all levels)."""
        at = self.b.gep(p, [self.i64(off)], source_etype=I8)
        i32 = lambda v: ir.Constant(I32, v)  # noqa: E731
        self.call("llvm.prefetch.p0", ir.VoidType(), [at, i32(0), i32(3), i32(1)])

    def loop(self, count):
        return cgutils.for_range(self.b, self.i64(count))


def tier_of(tok) -> str | None:
    return _TIER_OF_BITS.get(tok.bitwidth) if isinstance(tok, types.Integer) and tok.signed else None


def is_arr(a, dtype) -> bool:
    return isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C"
