"""The decode attention kernels (engine/kernels/cpu/attention.py) and the f16 KV cache against numpy.

Scores and weighted values are checked for every group size a kernel call takes (1-4) and larger groups (run
four heads at a time), position counts on and off the 16-wide tiles (the masked tail), f32 and half storage;
the f32 <-> half conversions bit for bit against numpy's, edge values included; the cache's f16 storage round
trip; and the whole decode attention (flash-decoding split, sliding window, batch) against ops.attention.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels.cpu.kv_cache import KVCache
from engine.kernels.cpu import attention as A
from engine.kernels.cpu import ops

RNG = np.random.default_rng(7)


def _stored(a: np.ndarray, dtype: str):
    """(what the kernel reads, the f32 values it stands for)."""
    if dtype == "f32":
        return a, a
    h = a.astype(np.float16)
    return h.view(np.uint16), h.astype(np.float32)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("group,D,n", [(1, 64, 1), (2, 64, 15), (3, 64, 16), (4, 256, 17), (3, 128, 40),
                                       (5, 64, 33), (9, 64, 300), (8, 96, 7)])
def test_scores_equal_numpy(dtype, group, D, n):
    tiles = n // A.TILE + 2  # a tile before the keys (the kernel starts at k0) and room past n
    keys, want_k = _stored(RNG.standard_normal((D, tiles * A.TILE)).astype(np.float32), dtype)
    tiled = np.ascontiguousarray(keys.reshape(D, tiles, A.TILE).transpose(1, 0, 2))  # (tiles, D, 16)
    want_k = want_k[:, A.TILE :]
    q = RNG.standard_normal(3 + group * D).astype(np.float32)
    s = np.full(2 + group * (n + 1), 123.0, np.float32)  # row stride n + 1: untouched gaps show stray writes
    A.scores(group, tiled.reshape(-1), D * A.TILE, q, 3, D, n, np.float32(0.125), s, 2, n + 1, tiled.reshape(-1), 0)
    got = s[2:].reshape(group, n + 1)
    want = 0.125 * (q[3:].reshape(group, D).astype(np.float64) @ want_k[:, :n].astype(np.float64))
    np.testing.assert_allclose(got[:, :n], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert (got[:, n] == 123.0).all() and (s[:2] == 123.0).all()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("group,D,n", [(1, 64, 1), (2, 64, 15), (3, 64, 16), (4, 256, 17), (6, 128, 200),
                                       (9, 16, 3)])
def test_weighted_values_equal_numpy(dtype, group, D, n):
    vals, want_v = _stored(RNG.standard_normal((n + 2, D)).astype(np.float32), dtype)
    p = RNG.random(group * n + 4).astype(np.float32)
    out = np.full(1 + group * D + 1, 7.0, np.float32)
    A.weighted_values(group, vals.reshape(-1), D, D, n, p, 4, n, out, 1)  # values from row 1, weights from 4
    want = p[4:].reshape(group, n).astype(np.float64) @ want_v[1 : n + 1].astype(np.float64)
    np.testing.assert_allclose(out[1:-1].reshape(group, D), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert out[0] == out[-1] == 7.0


def test_half_conversions_equal_numpy_bit_for_bit():
    edge = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e9, -1e9, 6e-8, 3e-8, 1e-10, 6.1e-5, np.inf, -np.inf,
                     2049.0, 2051.0, 0.33333334], np.float32)  # overflow, subnormals, ties to even
    x = np.concatenate([edge, RNG.standard_normal(1000).astype(np.float32) * 100])
    h = np.empty(x.size, np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    A.to_halves(x, 0, 0, h, 0, 0, 1, x.size)
    np.testing.assert_array_equal(h, want)
    back = np.empty(x.size, np.float32)
    A.from_halves(h, 0, 0, back, 0, 0, 1, x.size)
    np.testing.assert_array_equal(back, h.view(np.float16).astype(np.float32))
    nan = np.empty(1, np.uint16)
    A.to_halves(np.array([np.nan], np.float32), 0, 0, nan, 0, 0, 1, 1)
    assert np.isnan(nan.view(np.float16)[0])


def test_an_f16_cache_stores_what_numpy_rounds_and_grows_keeping_it():
    c16, c32 = KVCache(2, 3, 16, 400, "f16"), KVCache(2, 3, 16, 400, "f32")
    for k in (RNG.standard_normal((t, 3, 16)).astype(np.float32) for t in (5, 290)):  # the second one grows it
        for c in (c16, c32):
            c.reserve(len(k))
            for layer in range(2):
                c.write(layer, k, -k)
            c.advance(len(k))
    for layer in range(2):
        want = c32.keys(layer).astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(c16.keys(layer), want)
        np.testing.assert_array_equal(c16.values(layer), -want)
    assert c16.nbytes() * 2 == c32.nbytes()
    with pytest.raises(ValueError, match="dtype"):
        KVCache(1, 1, 16, 8, "bf16")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("H,Hkv,D,window", [(9, 3, 64, 0), (4, 1, 256, 40), (4, 4, 32, 0), (8, 2, 16, 7)])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_decode_attention_equals_the_prompt_path(dtype, H, Hkv, D, window, softcap):
    """attend() (flash-decoding split over key ranges, any batch) equals ops.attention for the last position."""
    L, layer, lengths = 2, 1, [1, 70, 129]
    caches, qs, want = [], [], []
    for n in lengths:
        c = KVCache(L, Hkv, D, 200, dtype)
        c.reserve(n)
        k, v = (RNG.standard_normal((n, Hkv, D)).astype(np.float32) for _ in range(2))
        for i in range(L):
            keys, values = c.write(i, k, v)
        c.advance(n)
        q = RNG.standard_normal((1, H, D)).astype(np.float32)
        want.append(ops.attention(q, keys, values, n - 1, 0.1, window, softcap)[0].reshape(-1))
        caches.append(c)
        qs.append(np.concatenate([q.reshape(-1), np.zeros(2 * Hkv * D, np.float32)]))
    qkv, pos = np.stack(qs), np.array([n - 1 for n in lengths], np.int64)
    for n_split in (1, 3, 8):
        out = np.empty((len(lengths), H * D), np.float32)
        A.attend(qkv, tuple(c.k for c in caches), tuple(c.v for c in caches), layer, pos, H, Hkv, D, window,
                 np.float32(0.1), np.float32(softcap), out, n_split)
        np.testing.assert_allclose(out, np.stack(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pos0,window", [(0, 0), (0, 100), (200, 0), (200, 150)])
def test_prompt_attention_in_query_blocks_equals_one_block(monkeypatch, pos0, window):
    """ops.attention splits a long chunk into causal query blocks (each sees no key past its last query)."""
    T, H, Hkv, D = 300, 4, 2, 32
    q = RNG.standard_normal((T, H, D)).astype(np.float32)
    k, v = (RNG.standard_normal((pos0 + T, Hkv, D)).astype(np.float32) for _ in range(2))
    blocked = ops.attention(q, k, v, pos0, 0.2, window)
    monkeypatch.setattr(ops, "ATTN_BLOCK", 10**6)
    whole = ops.attention(q, k, v, pos0, 0.2, window)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-6)
