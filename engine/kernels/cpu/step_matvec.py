"""The compiled decode step's matrix work (decode_step.py runs it): an input quantized in the forms its matrices
read (legacy blocks pair-interleaved or natural order, K super-blocks), and a matvec phase: the rows of matrices
side by side, in row ranges claimed by whichever thread of the step's parallel region is free (atomics.py).
Weights are mats rows [OFFSET, ROWS, ROW_BYTES, TYPE, PACKED] (step_roles.py) into the model's one buffer and the
buffer of packed copies (packed.py). Quantization buffers come whole (quant_buffers) or flat, viewed at a
layer's own width (flat_quant, quant_view: C-contiguous views, no new kernel specializations).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.kernels.cpu import atomics, int8, packed, quantize
from engine.kernels.cpu.step_roles import OFFSET, PACKED, ROW_BYTES, ROWS, TYPE

# (the low-bit types too: a step variant runs them, step_variants.py; comparisons only, no kernels compiled)
LEGACY_CODES = tuple(sorted(int(t) for t in int8.LEGACY_TYPES | int8.LOWBIT_LEGACY))
K_CODES = tuple(sorted(int(t) for t in int8.K_TYPES | int8.LOWBIT_K))


@njit(cache=True)
def needs(mats):
    """Which activation quantizations the matrices of one group read: (legacy blocks in the pair-interleaved
    order, legacy blocks in natural order (packed matrices), K super-blocks)."""
    legacy = natural = kq = False
    for i in range(mats.shape[0]):
        c = mats[i, TYPE]
        is_legacy = False
        for t in LEGACY_CODES:
            is_legacy |= c == t
        for t in K_CODES:
            kq |= c == t
        if is_legacy and mats[i, PACKED] >= 0:
            natural = True
            legacy |= mats[i, ROWS] % packed.ROWS != 0  # rows past the last group stay in GGUF order
        else:
            legacy |= is_legacy
    return legacy, natural, kq


@njit(cache=True)
def chunk(buf, pbuf, mats, xq8, xqn, xs8, xqk, xdk, xbk, x, out, lo, hi, tier):
    """Rows [lo, hi) of the matrices side by side. A packed matrix's group of 8 rows belongs to the chunk that
    holds its first row (so chunks may split groups and each group still runs once)."""
    start = np.int64(0)  # not a literal 0: rows_into would compile a variant of its own for it
    for i in range(mats.shape[0]):
        rows = mats[i, ROWS]
        a, z = max(lo, start) - start, min(hi, start + rows) - start
        if a < z:
            code, rb = mats[i, TYPE], mats[i, ROW_BYTES]
            done = a
            if mats[i, PACKED] >= 0:
                n8 = rows // packed.ROWS * packed.ROWS
                g0, g1 = -(-a // packed.ROWS), min(-(-z // packed.ROWS), n8 // packed.ROWS)
                if g1 > g0:
                    packed.groups_into(code, pbuf, mats[i, PACKED], xqn.shape[1] // 32, g0, g1, xqn, xs8, out, start,
                                       tier)
                done = max(a, n8)
            if done < z:
                int8.rows_into(code, buf, mats[i, OFFSET], rb, done, z, xq8, xs8, xqk, xdk, xbk, x, out, start, tier)
        start += rows


@njit(cache=True)
def quant_buffers(M, K):
    """Buffers for an input (M, K) quantized as each kind of matrix reads it: (legacy blocks, pair-interleaved;
    natural order; their block scales, either order; K super-blocks: values, scales, block sums)."""
    return (np.empty((M, K), np.int8), np.empty((M, K), np.int8), np.empty((M, 2 * (K // 32)), np.float32),
            np.empty((M, K), np.int8), np.empty((M, K // 256), np.float32), np.empty((M, K // 256, 24), np.int16))


@njit(cache=True)
def flat_quant(n):
    """_quant_buffers' arrays flat, for views of any (M, K) with M K <= n (_quant_view)."""
    return (np.empty(n, np.int8), np.empty(n, np.int8), np.empty(2 * (n // 32) + 2, np.float32), np.empty(n, np.int8),
            np.empty(n // 256 + 1, np.float32), np.empty(24 * (n // 256 + 1), np.int16))


@njit(cache=True)
def quant_view(f, M, K):
    """(M, K) quantization buffers over flat ones (a layer's own width; C-contiguous views)."""
    nb, nk = 2 * (K // 32), K // 256
    return (f[0][: M * K].reshape((M, K)), f[1][: M * K].reshape((M, K)), f[2][: M * nb].reshape((M, nb)),
            f[3][: M * K].reshape((M, K)), f[4][: M * nk].reshape((M, nk)), f[5][: M * nk * 24].reshape((M, nk, 24)))


@njit(cache=True)
def quantize_input(mats, x, qb, c0, c1):
    """Columns [c0, c1) of x (M, K) quantized into qb (_quant_buffers) in each form the matrices mats read
    (c0, c1 multiples of 256, or 0 and K)."""
    legacy, natural, kq = needs(mats)
    xq8, xqn, xs8, xqk, xdk, xbk = qb
    if natural:
        packed.quantize_natural_into(x, xqn, xs8, c0, c1)
    if legacy:
        quantize.quantize_legacy_into(x, xq8, xs8, c0, c1)
    if kq:
        quantize.quantize_k_into(x, xqk, xdk, xbk, c0, c1)


@njit(cache=True)
def matvec_phase(ctr, phase, buf, pbuf, mats, qb, x, out, n_chunks, tier):
    """out (M, sum of rows) = x @ W_i.T for the matrices mats side by side (x already quantized into qb), in
    n_chunks row ranges claimed by whichever thread is free. Returns the next phase once all are done."""
    xq8, xqn, xs8, xqk, xdk, xbk = qb
    total = out.shape[1]
    while True:
        ch = atomics.claim(ctr, phase)
        if ch >= n_chunks:
            break
        chunk(buf, pbuf, mats, xq8, xqn, xs8, xqk, xdk, xbk, x, out, ch * total // n_chunks,
               (ch + 1) * total // n_chunks, tier)
        atomics.finish(ctr, phase)
    return atomics.next_phase(ctr, phase, n_chunks)
