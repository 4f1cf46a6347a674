"""Decode attention over the KV cache: one query per head against every cached key, for the compiled decode step.

The two products of attention at one token are written as LLVM-IR kernels (as legacy.py's matvec rows), each
serving all the query heads that share one kv head (grouped-query attention) in one pass over the cache:

  scores   s[g, j] = scale * q_g . k_j       keys in tiles of 16 positions, each tile D rows of 16 (one
                                             contiguous block): the group's accumulators in registers, each
                                             key row loaded once for every head of the group
  values   o[g, :] = sum_j p[g, j] v_j       values in rows of D: tiles of 16 head dims, the same sharing

Numba loops here were load-bound and re-read the cache once per query head; these kernels read each cache line
once per group. Keys were first stored transposed (D rows of all positions): a tile then read 16 positions from
each of D rows a capacity apart, D streams for the prefetchers; in tiles of D x 16 the scores read one
contiguous stream, and attention got faster on SmolLM2 and Gemma-3 (docs/benchmarks.md, "Measurements behind the
code", attention key tiles). The cache holds f32 (the exact path) or IEEE halves stored as uint16 (the fast path,
as llama.cpp's default f16 cache: half the bytes a token's attention streams from memory); halves widen to f32 in
registers (vcvtph2ps). Groups of more than four heads run four at a time (registers).

Plain LLVM vector IR (fmuladd, fpext, masked loads and stores): no target intrinsics, so no CPU tier.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from engine.kernels import vmath
from engine.kernels.cpu.ir import FLT, I8, I16, I32, Emitter, V

TILE = 16  # positions (scores) or head dims (values) per tile: two 8-float vectors per head
MAX_GROUP = 4  # query heads per kernel call: 4 x 2 accumulators + 2 loads fit the 16 AVX registers
PREFETCH = 512  # bytes ahead along the keys' stream (cold scores, 512 / 1024 / 4096: 0.74 / 0.76 / 0.80 of the
# transposed layout's time)


# =========================================================================================================
# f32 <-> half bits (the fast path's cache stores halves as uint16: numba has no float16 arrays)
# =========================================================================================================


@intrinsic
def half_bits(typingctx, x):
    """float32 -> the IEEE half nearest to it (round to nearest even, as vcvtps2ph and numpy) as uint16."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        v = args[0] if x.bitwidth == 32 else builder.fptrunc(args[0], FLT)
        return builder.bitcast(builder.fptrunc(v, ir.HalfType()), I16)

    return types.uint16(x), codegen


@intrinsic
def half_value(typingctx, bits):
    """uint16 holding IEEE half bits -> float32 (exact)."""
    if not (isinstance(bits, types.Integer) and bits.bitwidth == 16):
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), FLT)

    return types.float32(bits), codegen


def kv_value(x, like):
    """x (f32) as an element of the cache array `like` stores (f32, or half bits in uint16)."""


@overload(kv_value)
def _kv_value(x, like):
    if like.dtype == types.uint16:
        return lambda x, like: half_bits(np.float32(x))
    return lambda x, like: np.float32(x)


def kv_float(x):
    """An element of a cache array (f32, or half bits in uint16) as f32."""


@overload(kv_float)
def _kv_float(x):
    if x == types.uint16:
        return lambda x: half_value(x)
    return lambda x: np.float32(x)


@njit(cache=True)
def store_keys(src, kc, layer, start):
    """Keys src (T, Hkv, D) f32 into a cache's key array kc (n_layer, Hkv, tiles, D, TILE) at positions
    start .. start + T - 1 of a layer (rounded to halves where the cache holds them)."""
    T, Hkv, D = src.shape
    for t in range(T):
        tile, lane = (start + t) // TILE, (start + t) % TILE
        for h in range(Hkv):
            for d in range(D):
                kc[layer, h, tile, d, lane] = kv_value(src[t, h, d], kc)


@njit(cache=True)
def load_keys(kc, layer, out):
    """out (n, Hkv, D) f32 = the keys of positions 0 .. n - 1 of a layer of a cache's key array kc."""
    n, Hkv, D = out.shape
    for j in range(n):
        for h in range(Hkv):
            for d in range(D):
                out[j, h, d] = kv_float(kc[layer, h, j // TILE, d, j % TILE])


@njit(cache=True)
def to_halves(src, s0, ss, dst, d0, ds, rows, n):
    """Rows of n f32 at src[s0 + r ss:] rounded to halves into dst[d0 + r ds:] (flat C arrays, f32 -> uint16):
    contiguous runs, so the loop compiles to vector conversions (strided numba arrays stay scalar)."""
    for r in range(rows):
        a, b = src[s0 + r * ss : s0 + r * ss + n], dst[d0 + r * ds : d0 + r * ds + n]  # slices: no wraparound
        for i in range(n):  # checks on the indices, so the loop vectorizes
            b[i] = half_bits(a[i])


@njit(cache=True)
def from_halves(src, s0, ss, dst, d0, ds, rows, n):
    """The reverse (uint16 half bits -> f32), exact."""
    for r in range(rows):
        a, b = src[s0 + r * ss : s0 + r * ss + n], dst[d0 + r * ds : d0 + r * ds + n]
        for i in range(n):
            b[i] = half_value(a[i])


# =========================================================================================================
# The two kernels, for a group of G <= MAX_GROUP query heads
# =========================================================================================================


def _cache_loader(e: Emitter, arr_ty):
    """(pointer, byte offset, mask or None) -> <8 x float> from a cache array of f32 or half bits, and the bytes
    per element."""
    if arr_ty.dtype == types.uint16:
        def load(p, off, mask=None):
            if mask is None:
                return e.halves(e.ld(p, off, V(I16, 8)))
            at = e.b.gep(p, [e.i64(off)], source_etype=I8)
            v = e.call("llvm.masked.load.v8i16.p0", V(I16, 8), [at, ir.Constant(I32, 2), mask,
                                                                  ir.Constant(V(I16, 8), None)])
            return e.halves(v)
        return load, 2

    def load(p, off, mask=None):
        if mask is None:
            return e.ld(p, off, V(FLT, 8))
        at = e.b.gep(p, [e.i64(off)], source_etype=I8)
        return e.call("llvm.masked.load.v8f32.p0", V(FLT, 8), [at, ir.Constant(I32, 4), mask,
                                                                 ir.Constant(V(FLT, 8), None)])
    return load, 4


def _cache_ok(a) -> bool:
    return isinstance(a, types.Array) and a.layout == "C" and a.dtype in (types.float32, types.uint16)


def _f32_ok(a) -> bool:
    return isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32


def _lane_mask(e: Emitter, j0, n):
    """<8 x i1>: lane l is j0 + l < n."""
    lanes = e.b.add(e.splat(e.i64(j0), 8), e.vc(ir.IntType(64), range(8)))
    return e.b.icmp_signed("<", lanes, e.splat(e.i64(n), 8))


def _scores_kernel(G: int):
    """Intrinsic (kf, k0, q, q0, D, n, scale, s, s0, ss, vf, v0) -> None: for the G heads whose queries lie
    at q[q0 + g D:][:D], s[s0 + g ss + j] = scale * sum_d q[g, d] K[k0 + (j // 16 D + d) 16 + j % 16] for j < n
    (keys in tiles of 16 positions from k0, each D rows of 16; f32 or half bits). Meanwhile it prefetches the
    values the weighted sum will read next (rows of D from v0 of vf, the cache's storage): a decode step's keys
    and values come from DRAM (the weights streamed through the caches since the last token), and fetched
    alongside the scores' arithmetic they no longer stall the values pass."""

    def impl(typingctx, kf, k0, q, q0, D, n, scale, s, s0, ss, vf, v0):
        if not (_cache_ok(kf) and _f32_ok(q) and _f32_ok(s) and _cache_ok(vf)):
            return None
        ip = types.intp
        sig = types.none(kf, ip, q, ip, ip, ip, types.float32, s, ip, ip, vf, ip)

        def codegen(context, builder, signature, args):
            e, b = Emitter(context, builder, "generic"), builder
            at = signature.args
            kf_, k0_, q_, q0_, D_, n_, scale_, s_, s0_, ss_, vf_, v0_ = args
            load, es = _cache_loader(e, at[0])
            kp = b.gep(e.base(at[0], kf_), [e.mul(k0_, es)], source_etype=I8)
            vp = b.gep(e.base(at[10], vf_), [e.mul(v0_, es)], source_etype=I8)
            tile_bytes = e.mul(e.mul(D_, TILE), es)  # of keys, and of values, per tile of positions
            qp = b.gep(e.base(at[2], q_), [e.mul(q0_, 4)], source_etype=I8)
            sp = b.gep(e.base(at[7], s_), [e.mul(s0_, 4)], source_etype=I8)
            scv = e.splat(scale_, 8)
            accs = [[e.fvar(8) for _ in range(2)] for _ in range(G)]
            qoffs = [e.mul(D_, 4 * g) for g in range(G)]  # byte offset of each head's query
            zero = ir.Constant(V(FLT, 8), [0.0] * 8)

            def tile(j0, width, mask):
                """Scores of positions j0.. (width 16, or 8 under mask) for every head of the group."""
                for pair in accs:
                    for a in pair[: width // 8]:
                        b.store(zero, a)
                tstart = e.mul(b.sdiv(j0, e.i64(TILE)), tile_bytes)
                lane = e.mul(b.srem(j0, e.i64(TILE)), es)
                with e.loop(D_) as lp:
                    off = e.add(e.add(tstart, e.mul(lp.index, TILE * es)), lane)
                    e.prefetch(kp, e.add(off, PREFETCH))
                    e.prefetch(vp, e.add(tstart, e.mul(lp.index, TILE * es)))  # this tile's values, D x 32 bytes
                    ks = [load(kp, off, mask)] if width == 8 else [load(kp, off), load(kp, e.add(off, 8 * es))]
                    for g, pair in enumerate(accs):
                        qv = e.splat(e.ld(qp, e.add(e.mul(lp.index, 4), qoffs[g]), FLT), 8)
                        for a, kv in zip(pair, ks):
                            e.fmacc(a, qv, kv)
                for g, pair in enumerate(accs):
                    base = e.mul(e.add(e.mul(ss_, g), j0), 4)
                    for t, a in enumerate(pair[: width // 8]):
                        v = b.fmul(b.load(a), scv)
                        if mask is None:
                            e.st(sp, e.add(base, 32 * t), v)
                        else:
                            at_ = b.gep(sp, [base], source_etype=I8)
                            e.call("llvm.masked.store.v8f32.p0", ir.VoidType(), [v, at_, ir.Constant(I32, 4), mask])

            n16 = b.sdiv(n_, e.i64(TILE))
            with e.loop(n16) as lp:
                tile(e.mul(lp.index, TILE), 16, None)
            rest = b.sub(n_, e.mul(n16, TILE))
            with e.loop(b.sdiv(b.add(rest, e.i64(7)), e.i64(8))) as lp:  # the last 1-15 positions, masked
                j0 = b.add(e.mul(n16, TILE), e.mul(lp.index, 8))
                tile(j0, 8, _lane_mask(e, j0, n_))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_scores{G}"
    return intrinsic(impl)


def _values_kernel(G: int):
    """Intrinsic (vf, v0, D, n, p, p0, ps, out, o0) -> None: for the G heads whose weights lie at
    p[p0 + g ps:][:n], out[o0 + g D + d] = sum_j p[g, j] V[v0 + j D + d] (values in rows of D, f32 or half bits;
    D a multiple of TILE)."""

    def impl(typingctx, vf, v0, D, n, p, p0, ps, out, o0):
        if not (_cache_ok(vf) and _f32_ok(p) and _f32_ok(out)):
            return None
        ip = types.intp
        sig = types.none(vf, ip, ip, ip, p, ip, ip, out, ip)

        def codegen(context, builder, signature, args):
            e, b = Emitter(context, builder, "generic"), builder
            at = signature.args
            vf_, v0_, D_, n_, p_, p0_, ps_, out_, o0_ = args
            load, es = _cache_loader(e, at[0])
            vp = b.gep(e.base(at[0], vf_), [e.mul(v0_, es)], source_etype=I8)
            pp = b.gep(e.base(at[4], p_), [e.mul(p0_, 4)], source_etype=I8)
            op = b.gep(e.base(at[7], out_), [e.mul(o0_, 4)], source_etype=I8)
            row = e.mul(D_, es)
            accs = [[e.fvar(8) for _ in range(2)] for _ in range(G)]
            zero = ir.Constant(V(FLT, 8), [0.0] * 8)
            with e.loop(b.sdiv(D_, e.i64(TILE))) as dt:
                d0 = e.mul(dt.index, TILE)
                for pair in accs:
                    for a in pair:
                        b.store(zero, a)
                with e.loop(n_) as lp:
                    off = e.add(e.mul(lp.index, row), e.mul(d0, es))
                    vs = [load(vp, off), load(vp, e.add(off, 8 * es))]
                    for g, pair in enumerate(accs):
                        pv = e.splat(e.ld(pp, e.mul(e.add(e.mul(ps_, g), lp.index), 4), FLT), 8)
                        for a, vv in zip(pair, vs):
                            e.fmacc(a, pv, vv)
                for g, pair in enumerate(accs):
                    base = e.mul(e.add(e.mul(D_, g), d0), 4)
                    for t, a in enumerate(pair):
                        e.st(op, e.add(base, 32 * t), b.load(a))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_values{G}"
    return intrinsic(impl)


_s1, _s2, _s3, _s4 = (_scores_kernel(g) for g in (1, 2, 3, 4))
_v1, _v2, _v3, _v4 = (_values_kernel(g) for g in (1, 2, 3, 4))


@njit(cache=True)
def scores(group, kf, k0, q, q0, D, n, scale, s, s0, ss, vf, v0):
    """s[s0 + g ss + j] = scale * q_g . k_j for the group's heads g (queries at q[q0 + g D:]), j < n, the keys in
    tiles of 16 positions from k0 of kf (each D rows of 16); prefetches the n values at v0 of vf (rows of D)
    that the weighted sum reads next."""
    g0 = 0
    while g0 < group:
        gs = min(MAX_GROUP, group - g0)
        qo, so = q0 + g0 * D, s0 + g0 * ss
        if gs == 4:
            _s4(kf, k0, q, qo, D, n, scale, s, so, ss, vf, v0)
        elif gs == 3:
            _s3(kf, k0, q, qo, D, n, scale, s, so, ss, vf, v0)
        elif gs == 2:
            _s2(kf, k0, q, qo, D, n, scale, s, so, ss, vf, v0)
        else:
            _s1(kf, k0, q, qo, D, n, scale, s, so, ss, vf, v0)
        g0 += gs


@njit(cache=True)
def weighted_values(group, vf, v0, D, n, p, p0, ps, out, o0):
    """out[o0 + g D + d] = sum_j p[p0 + g ps + j] v_j[d] for the group's heads g, j < n."""
    g0 = 0
    while g0 < group:
        gs = min(MAX_GROUP, group - g0)
        po, oo = p0 + g0 * ps, o0 + g0 * D
        if gs == 4:
            _v4(vf, v0, D, n, p, po, ps, out, oo)
        elif gs == 3:
            _v3(vf, v0, D, n, p, po, ps, out, oo)
        elif gs == 2:
            _v2(vf, v0, D, n, p, po, ps, out, oo)
        else:
            _v1(vf, v0, D, n, p, po, ps, out, oo)
        g0 += gs


# =========================================================================================================
# Attention of one new token per sequence (the decode step's)
# =========================================================================================================


@njit(cache=True, fastmath=True)
def _part(q, q0, group, D, kf, k0, vf, v0, lead, n, scale, softcap, s, acc, iscratch, mx, total):
    """The group's query heads (q[q0:]) over n cached positions (keys in tiles from k0 of kf, the first `lead`
    positions of its first tile before the range; values at v0 of vf, the range's first):
    acc (group, D) = sum_j exp(s_j - max) v_j, mx/total (group,) the max and the sum of exp per head;
    s (group, lead + n) and iscratch (n,) are scratch. softcap > 0: scores capped to softcap tanh(s / softcap)."""
    sf = s.reshape(-1)
    w = lead + n  # scores from the tile's start: the lead ones are computed and ignored
    scores(group, kf, k0, q, q0, D, w, scale, sf, 0, w, vf, v0 - lead * D)
    for g in range(group):
        row = s[g, lead:]
        if softcap > 0:  # Gemma 2
            for j in range(n):
                row[j] = softcap * np.tanh(row[j] / softcap)
        m = row[0]
        for j in range(1, n):
            m = max(m, row[j])
        for j in range(n):
            row[j] -= m
        vmath.exp_inplace(row, iscratch)
        t = np.float32(0.0)
        for j in range(n):
            t += row[j]
        mx[g], total[g] = m, t
    weighted_values(group, vf, v0, D, n, sf, lead, w, acc.reshape(-1), 0)


@njit(cache=True)
def task(t, qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, softcap, splits, part_max, part_sum, part_acc):
    """Work item t of attend: one sequence, one kv head (its group of query heads), one of the splits[m] key
    ranges of sequence m (cut at whole key tiles; part_* have room for the most, a task past them is idle)."""
    n_split = part_max.shape[2]
    m, kvh, sp = t // (Hkv * n_split), (t // n_split) % Hkv, t % n_split
    if sp >= splits[m]:
        return
    kc, vc = kcs[m], vcs[m]
    group = H // Hkv
    p = pos[m]
    first = max(0, p - window + 1) if window > 0 else 0
    base = first // TILE * TILE
    n_tiles = (p + 1 - base + TILE - 1) // TILE
    t0, t1 = sp * n_tiles // splits[m], (sp + 1) * n_tiles // splits[m]
    j0, j1 = max(first, base + t0 * TILE), min(p + 1, base + t1 * TILE)  # positions [j0, j1)
    if j0 >= j1:
        return  # more ranges than tiles: part_sum stays 0 and the merge skips it
    tiles, cap = kc.shape[2], vc.shape[2]
    k0 = (((layer * Hkv + kvh) * tiles) + j0 // TILE) * D * TILE
    v0 = ((layer * Hkv + kvh) * cap + j0) * D
    lead, n = j0 % TILE, j1 - j0
    acc = np.empty((group, D), np.float32)
    gmax, gsum = np.empty(group, np.float32), np.empty(group, np.float32)
    _part(qkv[m], kvh * group * D, group, D, kc.reshape(-1), k0, vc.reshape(-1), v0, lead, n, scale, softcap,
          np.empty((group, lead + n), np.float32), acc, np.empty(n, np.int32), gmax, gsum)
    for g in range(group):
        h = kvh * group + g
        part_max[m, h, sp] = gmax[g]
        part_sum[m, h, sp] = gsum[g]
        for d in range(D):
            part_acc[m, h, sp, d] = acc[g, d]


@njit(parallel=True, cache=True)
def _tasks(n_tasks, qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, softcap, splits, part_max, part_sum,
           part_acc):
    # Nothing but the loop: an array expression in a parallel=True body becomes a parallel region of its own,
    # launched once per iteration, at a cost per layer ("attention task loop" in docs/benchmarks.md's measurements).
    for t in prange(n_tasks):
        task(t, qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, softcap, splits, part_max, part_sum, part_acc)


@njit(cache=True)
def attend(qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, softcap, out, n_split):
    """Causal (sliding-window when window > 0) GQA attention of each sequence's one query per head over its
    cache: qkv (M, (H + 2 Hkv) D) holds the roped queries; kcs/vcs each sequence's cache arrays (keys
    (n_layer, Hkv, tiles, D, 16), values (n_layer, Hkv, capacity, D)); out (M, H D). Work is split over
    (sequence, kv head, key range) so both threads stay busy whatever the head count (SmolLM2 has 3 kv heads,
    Gemma 1): each range gives a partial softmax (max, sum, weighted values), merged exactly as in flash-decoding."""
    M = qkv.shape[0]
    part_max = np.empty((M, H, n_split), np.float32)
    part_sum = np.zeros((M, H, n_split), np.float32)
    part_acc = np.empty((M, H, n_split, D), np.float32)
    _tasks(M * Hkv * n_split, qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, softcap,
           np.full(M, n_split, np.int64), part_max, part_sum, part_acc)
    merge(part_max, part_sum, part_acc, np.full(H, -np.inf, np.float32), out)


@njit(cache=True)
def merge(part_max, part_sum, part_acc, sinks, out):
    """out (M, H D) from the tasks' partial softmaxes (part_* (M, H, n_split[, D]); a range with part_sum 0 is
    empty), exactly as one softmax over all positions: ranges reweighted by exp(their max - the max); a head's
    sink logit (sinks (H,), -inf: none) joins the denominator."""
    M, H, n_split, D = part_acc.shape
    for m in range(M):
        for h in range(H):
            mx = sinks[h]
            for sp in range(n_split):
                if part_sum[m, h, sp] > 0:
                    mx = max(mx, part_max[m, h, sp])
            total = np.float32(np.exp(sinks[h] - mx)) if sinks[h] > -np.inf else np.float32(0.0)
            o = out[m, h * D : (h + 1) * D]
            o[:] = 0.0
            for sp in range(n_split):
                if part_sum[m, h, sp] > 0:
                    w = np.float32(np.exp(part_max[m, h, sp] - mx))
                    total += w * part_sum[m, h, sp]
                    for d in range(D):
                        o[d] += w * part_acc[m, h, sp, d]
            for d in range(D):
                o[d] /= total


@njit(cache=True)
def n_split(Hkv, length, threads):
    """Key ranges per kv head of a sequence of `length` keys: about two tasks per thread, at least 64 keys each.
    Never a function of the batch: another cut rounds differently, and a reply must not depend on its neighbours."""
    return max(1, min(-(-2 * threads // Hkv), length // 64))
