"""Top-p and min-p over a whole vocabulary without sorting it: the candidate set found, and a token drawn from it, in
a few compiled passes.

The candidates top-p keeps are the fewest most likely tokens whose probabilities sum to top_p; a sampler that sorts
the vocabulary for them pays a sort of 152k-262k logits per token, and when the distribution is flat (a long
creative reply, a random-weight model) the nucleus holds most of the vocabulary, so growing a partial selection
until it covers top_p costs about as much as the whole forward pass did (docs/benchmarks.md, session 30, Sampling).
Here the logits are bucketed by value instead: 4096 equal-width buckets from the largest logit down to the smallest
within 64 of it (the rest share the last), each holding its tokens' probability mass; a scan from the top bucket
finds the one where the cumulative mass reaches top_p, and only that bucket's tokens are sorted to find the exact
last one. The kept set is then
"every token ranked at or above the cut" (rank: larger logit first, the lower id first among equal logits, as the
sorted candidates were), so it is two numbers, never a list. The draw walks the kept tokens' weights at the
temperature the same way: bucket masses to the bucket where the inverse CDF lands, that bucket's tokens sorted.

Probabilities are f64, numpy's exps of (logit - max) (a flat nucleus sums ~10^5 terms; f32 weights would move its
cut by a token now and then against the f64 sort tests/test_generate.py compares with).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from engine.kernels import kernel_cache

kernel_cache.configure()

_BUCKETS = 4096
_RANGE = 64.0  # logits more than this below the largest all go to the last bucket (e^-64 ~ 1.6e-28)


def nucleus_cut(x: np.ndarray, top_p: float, min_p: float) -> tuple[float, float, int]:
    """The last token (in rank order) that top-p (top_p < 1 to apply it) and then min-p (min_p > 0: a probability at
    least min_p times the largest) keep of softmax(x) (x: f32 logits): returns (max logit, the cut's logit, the cut's
    id). Every token ranked at or above the cut is kept: x[i] > cut_value, or x[i] == cut_value and i <= cut_id."""
    m = float(np.max(x))
    if not m > -np.inf:  # (no token can be kept: NaN or every logit masked)
        return m, np.float32(np.inf), -1
    return _cut(x, _weights(x, m, 1.0), m, top_p, min_p)


def draw_above(x: np.ndarray, m: float, cut_value, cut_id: int, inv_temp: float, u: float) -> tuple[int, float]:
    """A token drawn from the tokens ranked at or above the cut, weighted exp((x - m) inv_temp), by the inverse CDF at
    u in [0, 1) in rank order (the first whose cumulative weight exceeds u times the total, as numpy's
    Generator.choice draws from sorted candidates). Returns (token, the kept tokens' total weight)."""
    return _draw(x, _weights(x, m, inv_temp), m, cut_value, cut_id, u)


def _weights(x: np.ndarray, m: float, inv_temp: float) -> np.ndarray:
    """exp((x - m) inv_temp) in f64 (numpy's vectorized exp: several times numba's scalar math.exp); -inf -> 0."""
    d = x.astype(np.float64)
    d -= m
    if inv_temp != 1.0:
        d *= inv_temp
    return np.exp(d, out=d)


@njit(cache=True)
def _cut(x, e, m, top_p, min_p):
    n = x.shape[0]
    lo = _range_floor(x, m)
    floor = -np.inf  # min-p: p_i >= min_p p_max  <=>  x_i - m >= ln(min_p)
    if min_p > 0:
        floor = math.log(min_p)
    scale = _BUCKETS / (m - lo) if m > lo else 0.0
    mass = np.zeros(_BUCKETS, np.float64)
    total = 0.0
    for i in range(n):
        d = np.float64(x[i]) - m
        if d > -np.inf:  # (the row's -inf and NaN logits weigh nothing and are never kept)
            total += e[i]
            if d >= floor:
                mass[_bucket(d, scale)] += e[i]
    if top_p >= 1.0:
        target = np.inf  # no top-p cut: min-p alone (its floor bounds the buckets)
    else:
        target = top_p * total
    b, acc, last = _scan(mass, target, False)
    if b == _BUCKETS:  # min-p ends the set, or rounding left top_p * total unreached: the last kept bucket's last token
        members = _sorted_members(x, m, scale, last, floor)
        return m, x[members[-1]], members[-1]
    members = _sorted_members(x, m, scale, b, floor)
    for j in range(members.shape[0]):
        i = members[j]
        acc += e[i]
        if acc >= target:
            return m, x[i], i
    return m, x[members[-1]], members[-1]


@njit(cache=True)
def _draw(x, w, m, cut_value, cut_id, u):
    n = x.shape[0]
    lo = np.float64(cut_value) - m
    scale = _BUCKETS / min(-lo, _RANGE) if lo < 0 else 0.0  # (a kept token further down: the last bucket)
    mass = np.zeros(_BUCKETS, np.float64)
    total = 0.0
    for i in range(n):
        if x[i] > cut_value or (x[i] == cut_value and i <= cut_id):
            total += w[i]
            mass[_bucket(np.float64(x[i]) - m, scale)] += w[i]
    target = u * total
    b, acc, last = _scan(mass, target, True)
    if b == _BUCKETS:  # rounding put the draw past the last kept token
        return _sorted_members_above(x, m, scale, last, cut_value, cut_id)[-1], total
    members = _sorted_members_above(x, m, scale, b, cut_value, cut_id)
    for j in range(members.shape[0]):
        i = members[j]
        acc += w[i]
        if acc > target:
            return i, total
    return members[-1], total


@njit(cache=True)
def _scan(mass, target, strict):
    """The first bucket whose cumulative mass reaches target (strict: exceeds it), the mass before it, and the last
    bucket with any mass (the first is _BUCKETS where none reaches it)."""
    acc = 0.0
    last = 0
    for b in range(_BUCKETS):
        if mass[b] > 0:
            last = b
            if acc + mass[b] > target or (not strict and acc + mass[b] >= target):
                return b, acc, last
            acc += mass[b]
    return _BUCKETS, acc, last


@njit(cache=True, inline="always")
def _bucket(d, scale):
    """The bucket of a logit d below the maximum (d <= 0): 0 at the top, in equal widths down to the range's end."""
    return min(_BUCKETS - 1, int(-d * scale))


@njit(cache=True)
def _range_floor(x, m):
    """The smallest logit within _RANGE of the largest m (as f64): where the buckets end. Logits further down (a
    logit_bias ban at -100 or -1e9) weigh under e^-64 each and share the last bucket, so they do not stretch the
    buckets until every other token falls into the first."""
    lo = m
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        if v < lo and v >= m - _RANGE:
            lo = v
    return lo


@njit(cache=True)
def _sorted_members(x, m, scale, b, floor):
    """Bucket b's tokens (at or above the min-p floor) in rank order."""
    count = 0
    for i in range(x.shape[0]):
        d = np.float64(x[i]) - m
        if d >= floor and d > -np.inf and _bucket(d, scale) == b:
            count += 1
    ids = np.empty(count, np.int64)
    count = 0
    for i in range(x.shape[0]):
        d = np.float64(x[i]) - m
        if d >= floor and d > -np.inf and _bucket(d, scale) == b:
            ids[count] = i
            count += 1
    return _rank_order(x, ids)


@njit(cache=True)
def _sorted_members_above(x, m, scale, b, cut_value, cut_id):
    """Bucket b's tokens ranked at or above the cut, in rank order."""
    count = 0
    for i in range(x.shape[0]):
        if (x[i] > cut_value or (x[i] == cut_value and i <= cut_id)) and _bucket(np.float64(x[i]) - m, scale) == b:
            count += 1
    ids = np.empty(count, np.int64)
    count = 0
    for i in range(x.shape[0]):
        if (x[i] > cut_value or (x[i] == cut_value and i <= cut_id)) and _bucket(np.float64(x[i]) - m, scale) == b:
            ids[count] = i
            count += 1
    return _rank_order(x, ids)


@njit(cache=True)
def _rank_order(x, ids):
    """ids (ascending) sorted by descending logit; a stable sort keeps equal logits in ascending id."""
    keys = np.empty(ids.shape[0], np.float32)
    for j in range(ids.shape[0]):
        keys[j] = -x[ids[j]]
    return ids[np.argsort(keys, kind="mergesort")]
