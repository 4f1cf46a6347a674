"""The encoder's work between its BLAS matrix products, compiled: exact-form GELU, residual + LayerNorm in one
pass, and self-attention (q|k|v's bias, scores, softmax, the weighted values) read in place from the q|k|v matmul's
rows. On a batch of all-MiniLM-L6-v2, numpy's passes (GELU via math.erf, an opaque libm call per element, then
LayerNorm and softmax) took a large share of the encoder's time; these are plain arithmetic LLVM vectorizes
(docs/benchmarks.md, "Measurements behind the code", encoder ops, for this paragraph's figures and the two below).

Kernels with a division in a loop compile with error_model="numpy": numba's default (Python's) checks every
division for a zero divisor, and that branch kept LLVM from vectorizing GELU (several times slower an element).

The kernels run on plain threads (kernels/cpu/plain_threads.py), not numba parallel regions: between sgemm calls
numba's OpenMP workers and OpenBLAS's threads spin against each other on a machine with as many threads as cores.
On the 2-core VM a short query ran about twenty times slower with parallel regions than with one numba thread.
Small inputs run on the calling thread alone (a helper's hand-off costs more than it saves).

GELU's erf is Abramowitz & Stegun 7.1.28, erf(z) = 1 - (1 + a1 z + ... + a6 z^6)^-16 for z >= 0 (absolute error
<= 3e-7, below float32's own rounding of the result): a polynomial, four squarings and one division, no exp.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from engine.errors import UnsupportedModel
from engine.kernels.cpu import matmul, plain_threads
from engine.kernels.cpu.attention import TILE, scores, weighted_values
from engine.kernels.threads import get_threads
from engine.kernels.quant_types import GGMLType, QTensor
from engine.kernels.vmath import exp_inplace

__all__ = ["Q8Matrix", "attention", "gelu_inplace", "residual_layer_norm"]

_A = (np.float32(0.0705230784), np.float32(0.0422820123), np.float32(0.0092705272), np.float32(0.0001520143),
      np.float32(0.0002765672), np.float32(0.0000430638))
_FAST = {"reassoc", "contract", "nsz", "arcp"}  # not ninf/nnan: a NaN input stays visible downstream


_SPLIT_MIN = 64 * 384  # elements of work below which one thread does it all


def _run(kernel, args: tuple, jobs: int, elements: int) -> None:
    """kernel(*args, n, ch) for ch in 0..n-1 over `jobs` independent units (rows, heads)."""
    n = min(get_threads(), jobs) if elements >= _SPLIT_MIN else 1
    plain_threads.split(kernel, args + (max(n, 1),), max(n, 1))


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _chunk_nb(jobs, n, ch):
    return jobs * ch // n, jobs * (ch + 1) // n


@numba.njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
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
                        beta: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """LayerNorm(h + bias + residual) * weight + beta, row by row: (rows, n) float32 in, out (a new array if None;
    it may be h itself: each element of h is read before its place in out is written) returned."""
    out = np.empty(h.shape, np.float32) if out is None else out
    _run(_layer_norm, (h, bias, residual, weight, beta, np.float32(eps), out), h.shape[0], h.size)
    return out


@numba.njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def _softmax_rows(p, n, scratch):
    """p[:n * n] (n rows of n scores, contiguous) -> each row's softmax, in place: one exp pass over the block."""
    for t in range(n):
        top = np.float32(-3.4e38)
        for k in range(t * n, t * n + n):
            top = max(top, p[k])
        for k in range(t * n, t * n + n):
            p[k] -= top
    exp_inplace(p[: n * n], scratch)
    for t in range(n):
        total = np.float32(0.0)
        for k in range(t * n, t * n + n):
            total += p[k]
        inv = np.float32(1.0) / total
        for k in range(t * n, t * n + n):
            p[k] *= inv


@numba.njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def _attention(qkv, bias, starts, lengths, heads, scale, out, n_, ch):
    """attention()'s jobs ch, ch + n_, ... on the decode step's register-blocked products (kernels/cpu/attention.py):
    a sequence's queries of one head are that kernel's group of query heads, its keys the cache's tiles of TILE
    positions (each a row of TILE per head dim), its values rows of the head width padded to a multiple of TILE
    (zeros: they add nothing to the scores and their outputs are dropped). The copies in and out index with unsigned
    integers: with signed ones numba adds a wraparound select per element in these short loops, which made the
    layer measurably slower (docs/benchmarks.md, "Measurements behind the code", encoder attention indices)."""
    b, w, longest = lengths.shape[0], qkv.shape[1] // 3, lengths.max()
    d = w // heads
    dp = (d + TILE - 1) // TILE * TILE
    keys = np.zeros((longest + TILE - 1) // TILE * dp * TILE, np.float32)
    values = np.zeros(longest * dp, np.float32)
    queries = np.zeros(longest * dp, np.float32)
    weights = np.empty(longest * longest, np.float32)  # scores, then softmax: n rows of n for a sequence of n
    attended = np.empty(longest * dp, np.float32)
    scratch = np.empty(longest * longest, np.int32)
    for job in range(ch, b * heads, n_):  # round robin: a batch sorted by length would give one chunk the long ones
        s, h = job // heads, job % heads
        n, r0, c = lengths[s], starts[s], h * d
        # Unsigned indices: numba wraps a negative signed index around, a select per element (slower copies).
        cq, ck, cv = np.uint64(c), np.uint64(w + c), np.uint64(2 * w + c)
        for t in range(n):
            r, o = np.uint64(r0 + t), np.uint64(t * dp)
            at = np.uint64(t // TILE * dp * TILE + t % TILE)
            for i in range(np.uint64(d)):
                queries[o + i] = qkv[r, cq + i] + bias[cq + i]
            for i in range(np.uint64(d)):
                values[o + i] = qkv[r, cv + i] + bias[cv + i]
            for i in range(np.uint64(d)):
                keys[at + i * np.uint64(TILE)] = qkv[r, ck + i] + bias[ck + i]
        scores(n, keys, 0, queries, 0, dp, n, scale, weights, 0, n, values, 0)
        _softmax_rows(weights, n, scratch)
        weighted_values(n, values, 0, dp, n, weights, 0, n, attended, 0)
        for t in range(n):
            r, o = np.uint64(r0 + t), np.uint64(t * dp)
            for i in range(np.uint64(d)):
                out[r, cq + i] = attended[o + i]


def attention(qkv: np.ndarray, bias: np.ndarray, starts: np.ndarray, lengths: np.ndarray, heads: int,
              scale: float, out: np.ndarray | None = None) -> np.ndarray:
    """Self-attention of each sequence over its own tokens (no causal mask, no padding): qkv (tokens, 3 hidden)
    without its bias, the batch's sequences one after another (sequence s from row starts[s], lengths[s] rows) ->
    (tokens, hidden), each head's softmax(scale q k^T) v in its columns. One job per (sequence, head) reads its
    rows of qkv in place: no split into head-major arrays, no padded scores. out: where to write (a new array if
    None)."""
    tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    out = np.empty((tokens, hidden), np.float32) if out is None else out
    _run(_attention, (qkv, bias, starts, lengths, heads, np.float32(scale), out), len(lengths) * heads, qkv.size)
    return out


@functools.cache
def _q8_kernels():
    """The fast path's int8 kernels, one instance for every encoder matrix."""
    return matmul.kernels_for("cpu-q8")


class Q8Matrix:
    """W (out, in) as Q8_0 blocks (int8 per 32 columns with an f16 scale, as llama.cpp's Q8_0; a quarter of f32's
    bytes). A few rows (a short query alone) run the generation fast path's integer matvec over the blocks in
    place, int8 activations included; a batch dequantizes W into a scratch for one sgemm: on these CPUs an int8
    GEMM does not beat sgemm at batch sizes (docs/design-log.md, "The CPU kernel measurements", 2), so q8 saves
    memory, not time, on batches."""

    def __init__(self, w: np.ndarray):
        import gguf


        rows, cols = w.shape
        if cols % 32:
            raise UnsupportedModel(f"--embed-quant q8: a matrix of {cols} columns is not a whole number of "
                                   "32-wide Q8_0 blocks; use f32")
        raw = gguf.quants.quantize(np.ascontiguousarray(w, np.float32), gguf.GGMLQuantizationType.Q8_0)
        self.q = QTensor("q8", GGMLType.Q8_0, (rows, cols), raw.reshape(rows, -1))
        self.kernels = _q8_kernels()

    def apply(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if x.shape[0] <= matmul.Q8_MATVEC_MAX_T:
            out[...] = self.kernels.matmul(np.ascontiguousarray(x), self.q)
            return out
        return np.matmul(x, self.kernels.dequantize(self.q).T, out=out)
