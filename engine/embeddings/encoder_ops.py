"""The encoder's elementwise work between its BLAS matrix products, compiled and split over rows: exact-form GELU,
residual + LayerNorm in one pass, the masked attention softmax, and q|k|v's bias and split into heads. Measured on
a 130 x 40-token batch of all-MiniLM-L6-v2 (2 cores): numpy's passes took 0.68 s (GELU via math.erf, an opaque
libm call per element), 0.17 s (LayerNorm) and 0.14 s (softmax) of 2.6 s; these are plain arithmetic LLVM
vectorizes.

The kernels run on plain threads (kernels/cpu/plain_threads.py), not numba parallel regions: between sgemm calls
numba's OpenMP workers and OpenBLAS's threads spin against each other on a machine with as many threads as cores.
Measured on the 2-core VM, one 9-token query: 206-208 ms with parallel regions, 9-10 ms with one numba thread.
Small inputs run on the calling thread alone (a helper's hand-off costs more than it saves).

GELU's erf is Abramowitz & Stegun 7.1.28, erf(z) = 1 - (1 + a1 z + ... + a6 z^6)^-16 for z >= 0 (absolute error
<= 3e-7, below float32's own rounding of the result): a polynomial, four squarings and one division, no exp.
"""

from __future__ import annotations

import numba
import numpy as np

from engine.kernels.cpu import plain_threads
from engine.kernels.cpu.threads import get_threads
from engine.kernels.cpu.vmath import exp_inplace

__all__ = ["gelu_inplace", "residual_layer_norm", "masked_softmax_inplace", "merge_heads", "split_heads"]

_A = (np.float32(0.0705230784), np.float32(0.0422820123), np.float32(0.0092705272), np.float32(0.0001520143),
      np.float32(0.0002765672), np.float32(0.0000430638))
_FAST = {"reassoc", "contract", "nsz", "arcp"}  # not ninf/nnan: masks carry -inf-like values


_SPLIT_MIN = 64 * 384  # elements of work below which one thread does it all


def _run(kernel, args: tuple, jobs: int, elements: int) -> None:
    """kernel(*args, n, ch) for ch in 0..n-1 over `jobs` independent units (rows, heads)."""
    n = min(get_threads(), jobs) if elements >= _SPLIT_MIN else 1
    plain_threads.split(kernel, args + (max(n, 1),), max(n, 1))


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _chunk_nb(jobs, n, ch):
    return jobs * ch // n, jobs * (ch + 1) // n


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _gelu(x, bias, n, ch):
    a1, a2, a3, a4, a5, a6 = _A
    r0, r1 = _chunk_nb(x.shape[0], n, ch)
    for r in range(r0, r1):
        row = x[r]
        for i in range(row.shape[0]):
            v = row[i] + bias[i]
            z = min(abs(v) * np.float32(0.70710678118654752), np.float32(6.0))  # erf(6) = 1 - 2e-17
            p = np.float32(1.0) + z * (a1 + z * (a2 + z * (a3 + z * (a4 + z * (a5 + z * a6)))))
            p2 = p * p
            p4 = p2 * p2
            p8 = p4 * p4
            erf = np.float32(1.0) - np.float32(1.0) / (p8 * p8)
            row[i] = np.float32(0.5) * v * (np.float32(1.0) + (erf if v >= 0 else -erf))


def gelu_inplace(x: np.ndarray, bias: np.ndarray) -> None:
    """x (rows, cols) float32, C-contiguous: x = GELU(x + bias) = 0.5 v (1 + erf(v / sqrt 2)), in place."""
    _run(_gelu, (x, bias), x.shape[0], x.size)


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _layer_norm(h, bias, residual, weight, beta, eps, out, n_, ch):
    rows, n = h.shape
    r0, r1 = _chunk_nb(rows, n_, ch)
    for r in range(r0, r1):
        total = np.float32(0.0)
        for i in range(n):
            v = h[r, i] + bias[i] + residual[r, i]
            out[r, i] = v
            total += v
        mean = total / np.float32(n)
        var = np.float32(0.0)
        for i in range(n):
            d = out[r, i] - mean
            var += d * d
        inv = np.float32(1.0) / np.sqrt(var / np.float32(n) + np.float32(eps))
        for i in range(n):
            out[r, i] = (out[r, i] - mean) * inv * weight[i] + beta[i]


def residual_layer_norm(h: np.ndarray, bias: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                        beta: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm(h + bias + residual) * weight + beta, row by row: (rows, n) float32 in, a new array out."""
    out = np.empty(h.shape, np.float32)
    _run(_layer_norm, (h, bias, residual, weight, beta, np.float32(eps), out), h.shape[0], h.size)
    return out


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _softmax(scores, lengths, scale, n_, ch):
    b, heads, t, _ = scores.shape
    j0, j1 = _chunk_nb(b * heads, n_, ch)
    scratch = np.empty(t, np.int32)
    for job in range(j0, j1):
        s, h = job // heads, job % heads
        n = lengths[s]
        for q in range(t):
            row = scores[s, h, q]
            top = np.float32(-3.4e38)
            for k in range(n):
                row[k] *= scale
                top = max(top, row[k])
            for k in range(n):
                row[k] -= top
            exp_inplace(row[:n], scratch)
            total = np.float32(0.0)
            for k in range(n):
                total += row[k]
            inv = np.float32(1.0) / total
            for k in range(n):
                row[k] *= inv
            for k in range(n, t):
                row[k] = np.float32(0.0)


def masked_softmax_inplace(scores: np.ndarray, lengths: np.ndarray, scale: float) -> None:
    """scores (batch, heads, t, t) float32, C-contiguous: each row softmax(scale * row) over the first lengths[b]
    keys of its sequence; padded keys get 0 (as the additive mask of f32's smallest value gives)."""
    _run(_softmax, (scores, lengths, np.float32(scale)), scores.shape[0] * scores.shape[1], scores.size)


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _split(qkv, bias, starts, lengths, q, k, v, n_, ch):
    b, heads, t, d = q.shape
    j0, j1 = _chunk_nb(b * t, n_, ch)
    w = heads * d
    for job in range(j0, j1):
        s, p = job // t, job % t
        if p >= lengths[s]:  # a padded position: zeros, so padded queries stay finite (their rows are dropped)
            for h in range(heads):
                for i in range(d):
                    q[s, h, p, i] = np.float32(0.0)
                    k[s, h, i, p] = np.float32(0.0)
                    v[s, h, p, i] = np.float32(0.0)
            continue
        row = qkv[starts[s] + p]
        for h in range(heads):
            for i in range(d):
                c = h * d + i
                q[s, h, p, i] = row[c] + bias[c]
                k[s, h, i, p] = row[w + c] + bias[w + c]
                v[s, h, p, i] = row[2 * w + c] + bias[2 * w + c]


def split_heads(qkv: np.ndarray, bias: np.ndarray, starts: np.ndarray, lengths: np.ndarray, heads: int):
    """qkv (tokens, 3 hidden) without its bias, the batch's sequences one after another (sequence s from row
    starts[s], lengths[s] rows) -> q (b, heads, t, d), k (b, heads, d, t), v (b, heads, t, d) with t the longest
    sequence, each C-contiguous with the bias added and zeros past each sequence's end: the layouts attention's
    batched matmuls read."""
    b, t, d = len(lengths), int(lengths.max()), qkv.shape[1] // (3 * heads)
    q, v = np.empty((b, heads, t, d), np.float32), np.empty((b, heads, t, d), np.float32)
    k = np.empty((b, heads, d, t), np.float32)
    _run(_split, (qkv, bias, starts, lengths, q, k, v), b * t, q.size * 3)
    return q, k, v


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _merge(attended, starts, lengths, out, n_, ch):
    b, heads, t, d = attended.shape
    j0, j1 = _chunk_nb(b, n_, ch)
    for s in range(j0, j1):
        for p in range(lengths[s]):
            row = out[starts[s] + p]
            for h in range(heads):
                for i in range(d):
                    row[h * d + i] = attended[s, h, p, i]


def merge_heads(attended: np.ndarray, starts: np.ndarray, lengths: np.ndarray, tokens: int) -> np.ndarray:
    """split_heads' inverse for attention's output: (b, heads, t, d) -> (tokens, hidden), padded rows dropped."""
    b, heads, t, d = attended.shape
    out = np.empty((tokens, heads * d), np.float32)
    _run(_merge, (attended, starts, lengths, out), b, attended.size)
    return out
