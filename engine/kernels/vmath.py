"""Vectorizable math for compiled glue code: exp over a whole array.

numba turns np.exp on a float32 into a call to the C library's expf per element (~4-17 ns each here), and
LLVM cannot vectorize a loop around an opaque call. A decode step calls exp ~200k times per token (softmax
over every cached position of every head, SiLU/GELU over the MLP width), which measured 2-3 ms per token at
a 500-token context. This exp is plain arithmetic LLVM vectorizes (~1 ns per element): Cody-Waite range
reduction x = k ln2 + r, a degree-6 polynomial for e^r (Cephes expf coefficients), and 2^k built from its
bits. Max relative error 3e-7 over [-87, 88]; inputs are clamped to that range (e^-87.3 ~ 1e-38 stands in
for 0, which softmax and SiLU cannot tell apart).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so k * _LN2_HI is exact for |k| < 2^9
_LN2_LO = np.float32(-2.12194440e-4)
_LO, _HI = np.float32(-87.3), np.float32(88.3)  # 2^k stays a normal float


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
    that stay in L1 (a 262k vocabulary in numpy took ~1 ms per token)."""
    n = x.shape[0]
    m = x[0]
    for i in range(1, n):
        m = max(m, x[i])
    buf = np.empty(4096, np.float32)
    scratch = np.empty(4096, np.int32)
    total = 0.0
    for c0 in range(0, n, 4096):
        c = min(4096, n - c0)
        b = buf[:c]
        for i in range(c):
            b[i] = x[c0 + i] - m
        exp_inplace(b, scratch)
        part = np.float32(0.0)  # each chunk summed in f32 (vector lanes), the chunks in f64
        for i in range(c):
            part += b[i]
        total += np.float64(part)
    return np.float64(m) + np.log(total)
