"""Compiled row kernels shared by the prompt ops (ops.py) and the decode step: RMSNorm rows,
RoPE, gated activations, masked softmax.

In numpy these cost as much as the GEMMs of a prompt (SmolLM2, 512 tokens: SiLU, attention softmax and mask,
and norms together about as long as the sgemms): each is several full passes over (T, n) temporaries,
and numpy's f32 exp is slow on the large negative inputs SiLU and softmax feed it. Here each is one pass,
with the vectorized exp of vmath.py. Serial on purpose: these run between BLAS calls, whose worker threads
keep spinning for a while after each sgemm, and a parallel region there waits on them (a 512-token SmolLM2
prompt was clearly faster with serial glue than with parallel). Figures: docs/benchmarks.md, "Measurements
behind the code", row ops. Arithmetic stays f32 as in ops.py (norm sums in f64); results agree with float64
numpy to float rounding (tests/test_glue.py).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from engine.kernels import vmath

_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


@njit(cache=True, fastmath={"reassoc", "nsz"})  # reassoc: the f64 sum of squares vectorizes (order only)
def rms_norm_into(src, s0, n, w, eps, dst, d0):
    """dst[d0:d0+n] = src[s0:s0+n] * rsqrt(mean(src^2) + eps) * w (1-D arrays, flat offsets; sum in f64)."""
    acc = 0.0
    for i in range(n):
        v = np.float64(src[s0 + i])
        acc += v * v
    r = np.float32(1.0) / np.sqrt(np.float32(acc / n) + np.float32(eps))
    for i in range(n):
        dst[d0 + i] = (src[s0 + i] * r) * w[i]


@njit(cache=True)
def rms_norm_rows(x, w, eps):
    """Each row of x (M, n) normed and scaled by w (n,): a new (M, n) array."""
    M, n = x.shape
    out = np.empty((M, n), np.float32)
    for m in range(M):
        rms_norm_into(x[m], 0, n, w, eps, out[m], 0)
    return out


@njit(cache=True)
def rope_into(v, o, cos, sin, neox):
    """Rotate the head v[o:o+D] in place by the angles of cos/sin (rope_dim/2,): pairs (i, i + rope_dim/2)
    (neox) or (2i, 2i+1) (interleaved); dims past rope_dim pass through. Plain f32, as numpy computes it."""
    half = cos.shape[0]
    for i in range(half):
        c, s = cos[i], sin[i]
        if neox:
            ia, ib = o + i, o + half + i
        else:
            ia, ib = o + 2 * i, o + 2 * i + 1
        a, b = v[ia], v[ib]
        v[ia] = a * c - b * s
        v[ib] = b * c + a * s


@njit(cache=True)
def rope_tables_at(inv_freq, pos, rope_scale, attn_factor):
    """cos, sin (n_layer, M, rope_dim/2) f32 for each layer's frequencies at each sequence's position (angles in
    f64, as ops.rope_tables, both times attn_factor): the decode step's, once per step, not per head."""
    L, half = inv_freq.shape
    M = pos.shape[0]
    cos, sin = np.empty((L, M, half), np.float32), np.empty((L, M, half), np.float32)
    for layer in range(L):
        for m in range(M):
            p = np.float64(pos[m]) / rope_scale
            for i in range(half):
                ang = p * inv_freq[layer, i]
                cos[layer, m, i] = math.cos(ang) * attn_factor
                sin[layer, m, i] = math.sin(ang) * attn_factor
    return cos, sin


@njit(cache=True)
def rope_rows(x, cos, sin, neox):
    """x (T, heads, D) C-contiguous, in place: row t rotated by cos[t], sin[t] (T, rope_dim/2)."""
    T, nh, D = x.shape
    for t in range(T):
        row = x[t].reshape(-1)
        for h in range(nh):
            rope_into(row, h * D, cos[t], sin[t], neox)


@njit(cache=True, fastmath=True, error_model="numpy")
def act_mul_row(gate, up, out, t, scratch, gelu):
    # Both are a * sigmoid(z): SiLU with z = a, GELU's tanh form with z = 2 c (a + 0.044715 a^3), since
    # 0.5 (1 + tanh(y)) = sigmoid(2y). One exp each, and no cancellation where tanh(y) nears -1.
    # error_model="numpy": numba's default checks each division for a zero divisor, a branch that kept LLVM
    # from vectorizing the last loop.
    F = gate.shape[0]
    for i in range(F):
        a = gate[i]
        t[i] = np.float32(-2.0) * _GELU_C * (a + np.float32(0.044715) * a * a * a) if gelu else -a
    vmath.exp_inplace(t, scratch)
    for i in range(F):
        out[i] = gate[i] / (np.float32(1.0) + t[i]) * up[i]


@njit(cache=True)
def _act_mul_rows(gate, up, out, r0, r1, gelu):
    F = gate.shape[1]
    t, scratch = np.empty(F, np.float32), np.empty(F, np.int32)
    for m in range(r0, r1):
        act_mul_row(gate[m], up[m], out[m], t, scratch, gelu)


@njit(cache=True)
def act_mul(gate, up, gelu):
    """act(gate) * up for (M, F) arrays (any strides): SiLU, or GELU in its tanh form. A new (M, F) array."""
    M, F = gate.shape
    out = np.empty((M, F), np.float32)
    _act_mul_rows(gate, up, out, 0, M, gelu)
    return out


@njit(cache=True)
def act_mul_halves(gu, gelu):
    """act(gu[:, :F]) * gu[:, F:] for gu (M, 2F) C-contiguous (gate and up side by side, as one matmul gives
    them): each row's halves are contiguous, so the loops vectorize (act_mul on the two column slices gets
    strided rows, several times slower: docs/benchmarks.md, "Measurements behind the code", act_mul_halves)."""
    M, F2 = gu.shape
    F = F2 // 2
    out = np.empty((M, F), np.float32)
    t, scratch = np.empty(F, np.float32), np.empty(F, np.int32)
    for m in range(M):
        row = gu[m]
        act_mul_row(row[:F], row[F:], out[m], t, scratch, gelu)
    return out


@njit(cache=True, fastmath=True)
def _softmax_row(row, lo, hi, scratch, sink):
    """row[lo:hi] = softmax(row[lo:hi]) with one more logit `sink` in the denominator (an attention sink: -inf
    for none); everything else 0 (masked)."""
    n = row.shape[0]
    mx = max(row[lo], sink)
    for j in range(lo + 1, hi):
        mx = max(mx, row[j])
    seg = row[lo:hi]
    for j in range(hi - lo):
        seg[j] -= mx
    vmath.exp_inplace(seg, scratch)
    total = np.float32(math.exp(sink - mx)) if sink > -np.inf else np.float32(0.0)
    for j in range(hi - lo):
        total += seg[j]
    inv = np.float32(1.0) / total
    for j in range(hi - lo):
        seg[j] *= inv
    for j in range(lo):
        row[j] = 0.0
    for j in range(hi, n):
        row[j] = 0.0


@njit(cache=True)
def _softmax_rows(s, r0, r1, q_pos0, k_pos0, window, sinks):
    T, L = s.shape[1], s.shape[2]
    scratch = np.empty(L, np.int32)
    for r in range(r0, r1):
        b, t = r // T, r % T
        qpos = q_pos0 + t
        hi = min(L, qpos - k_pos0 + 1)  # keys at or before the query
        lo = max(0, qpos - window + 1 - k_pos0) if window > 0 else 0
        _softmax_row(s[b, t], lo, hi, scratch, sinks[b])


@njit(cache=True)
def causal_softmax(s, q_pos0, k_pos0, window, sinks):
    """In place over scores s (B, T, L) (C order): row (b, t) is the query at position q_pos0 + t against keys
    at positions k_pos0.. ; it keeps keys at or before it (and, with window > 0, fewer than window back),
    softmaxed with sinks[b] (B,) in the denominator (-inf: none), and zeroes the rest."""
    _softmax_rows(s, 0, s.shape[0] * s.shape[1], q_pos0, k_pos0, window, sinks)
