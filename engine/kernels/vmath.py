"""Vectorizable math for compiled glue code: exp over a whole array.

numba turns np.exp on a float32 into a call to the C library's expf per element, and LLVM cannot vectorize a
loop around an opaque call. A decode step calls exp ~200k times per token (softmax over every cached position of
every head, SiLU/GELU over the MLP width), a visible share of a token's time at long contexts. This exp is plain
arithmetic LLVM vectorizes, several times faster per element than expf (docs/benchmarks.md, "Measurements behind
the code", vmath exp): Cody-Waite range reduction x = k ln2 + r, a degree-6 polynomial for e^r (Cephes expf
coefficients), and 2^k built from its bits. Max relative error 3e-7 over [-87, 88]; inputs are clamped to that
range (e^-87.3 ~ 1e-38 stands in for 0, which softmax and SiLU cannot tell apart).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels import kernel_cache

kernel_cache.configure()  # numba's cache directory, set before the decorators below run (as the CPU package does)

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so k * _LN2_HI is exact for |k| < 2^9
_LN2_LO = np.float32(-2.12194440e-4)
_LO, _HI = np.float32(-87.3), np.float32(88.3)  # 2^k stays a normal float
_BLOCK = 4096  # elements per block of a vocabulary-wide pass (its scratch stays in L1)


@njit(cache=True, fastmath=True)
def exp_inplace(x, scratch):
    """x[:] = exp(x) for a contiguous float32 array x; scratch: int32 array at least as long."""
    n = x.shape[0]
    for i in range(n):
        v = min(max(x[i], _LO), _HI)
        k = np.floor(v * _LOG2E + np.float32(0.5))
        r = v - k * _LN2_HI - k * _LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[i] = (p * r * r + r) + np.float32(1.0)
        scratch[i] = (np.int32(k) + np.int32(127)) << np.int32(23)  # the bits of 2^k
    two_k = scratch[:n].view(np.float32)
    for i in range(n):
        x[i] *= two_k[i]


@njit(cache=True, fastmath=True)
def logsumexp(x):
    """log(sum(exp(x))) of a contiguous float32 array (a row of logits): exp in f32, the sum in f64, in chunks
    that stay in L1 (numpy was slow on a 262k vocabulary: docs/benchmarks.md, "Measurements behind the code",
    vmath logsumexp)."""
    m = np.max(x)
    return np.float64(m) + np.log(sum_exp(x, m))


@njit(cache=True, fastmath=True)
def sum_exp(x, m):
    """sum(exp(x - m)) of a contiguous float32 array, m its maximum (so no term overflows): exp in f32, each
    L1-sized block summed in f32 (vector lanes), the blocks in f64. Full blocks go through the whole C buffer
    (a slice of it would compile to strided code, which was slower: docs/benchmarks.md, "Measurements behind the
    code", vmath sum_exp)."""
    n = x.shape[0]
    buf = np.empty(_BLOCK, np.float32)
    scratch = np.empty(_BLOCK, np.int32)
    total = 0.0
    full = n // _BLOCK * _BLOCK
    for c0 in range(0, full, _BLOCK):
        total += _block_sum_exp(x, c0, m, buf, scratch)
    if full < n:
        total += _block_sum_exp(x, full, m, buf[: n - full], scratch)
    return total


@njit(cache=True, fastmath=True)
def _block_sum_exp(x, c0, m, b, scratch):
    for i in range(b.shape[0]):
        b[i] = x[c0 + i] - m
    exp_inplace(b, scratch)
    part = np.float32(0.0)
    for i in range(b.shape[0]):
        part += b[i]
    return np.float64(part)


@njit(cache=True, fastmath={"reassoc", "nsz", "contract"})  # not "ninf": -inf logits (masks) are data here
def softmax_draw(x, inv_temp, u):
    """The index i drawn from softmax(x * inv_temp) by the inverse CDF at u in [0, 1): the first i whose
    cumulative probability exceeds u (as numpy's Generator.choice draws). Weights in f32 through the exp above,
    sums in f64; a weight whose exponent is below exp's clamped range (-inf logits: masked or banned tokens) is
    exactly 0, so such a token is never drawn. One compiled pass over a 262k vocabulary instead of numpy's
    f64 softmax, cumsum and checks, which cost milliseconds per token on Gemma-3 (docs/benchmarks.md,
    "Measurements behind the code", vmath softmax_draw); the draw then scans one block's weights."""
    n = x.shape[0]
    m = x[0]
    for i in range(1, n):
        m = max(m, x[i])
    w = np.empty(n, np.float32)
    scratch = np.empty(_BLOCK, np.int32)
    n_blocks = (n + _BLOCK - 1) // _BLOCK
    block_sum = np.empty(n_blocks, np.float64)
    total = 0.0
    for blk in range(n_blocks):
        c0 = blk * _BLOCK
        c = min(_BLOCK, n - c0)
        b = w[c0 : c0 + c]
        for i in range(c):
            b[i] = (x[c0 + i] - m) * inv_temp
        exp_inplace(b, scratch)
        part = 0.0
        for i in range(c):
            if (x[c0 + i] - m) * inv_temp < _LO:
                b[i] = 0.0
            part += b[i]
        block_sum[blk] = part
        total += part
    target = u * total
    acc = 0.0
    blk = 0
    while blk < n_blocks - 1 and acc + block_sum[blk] <= target:  # whole blocks before the draw
        acc += block_sum[blk]
        blk += 1
    last = -1
    for i in range(blk * _BLOCK, n):
        if w[i] > 0:
            acc += w[i]
            last = i
            if acc > target:
                return i
    if last < 0:  # rounding put the draw past the last weighted token of its block's tail
        for i in range(blk * _BLOCK - 1, -1, -1):
            if w[i] > 0:
                return i
    return last


@njit(cache=True)
def top_k_indices(x, k):
    """Indices of the k largest entries of x (in no particular order; among equal values the lower index wins),
    for k <= len(x): one pass with a min-heap of the k best so far (most entries only meet its root)."""
    hv = np.empty(k, np.float32)
    hi = np.empty(k, np.int64)
    for i in range(k):  # the first k, heapified
        hv[i], hi[i] = x[i], i
    for start in range(k // 2 - 1, -1, -1):
        _sift_down(hv, hi, start, k)
    for i in range(k, x.shape[0]):
        if x[i] > hv[0]:  # beats the weakest kept (a tie keeps the earlier index)
            hv[0], hi[0] = x[i], i
            _sift_down(hv, hi, 0, k)
    return hi


@njit(cache=True, inline="always")
def _worse(hv, hi, a, b):
    """Entry a ranks below entry b: smaller value, or equal value and higher index."""
    return hv[a] < hv[b] or (hv[a] == hv[b] and hi[a] > hi[b])


@njit(cache=True)
def _sift_down(hv, hi, j, k):
    while True:
        c = 2 * j + 1
        if c >= k:
            return
        if c + 1 < k and _worse(hv, hi, c + 1, c):
            c += 1
        if not _worse(hv, hi, c, j):
            return
        hv[j], hv[c] = hv[c], hv[j]
        hi[j], hi[c] = hi[c], hi[j]
        j = c
