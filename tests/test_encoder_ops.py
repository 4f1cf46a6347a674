"""The encoder's compiled kernels (engine/kernels/cpu/encoder_ops.py) against float64 numpy: attention over
unpadded sequences, for head widths that are a multiple of the decode kernels' 16-wide tile and one that is not
(padded with zeros), and the exact-form GELU. The whole encoder is checked against the reference vectors in test_embeddings.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.kernels.cpu.encoder_ops import attention, gelu_inplace


def _reference_attention(qkv, bias, lengths, heads, scale):
    x = (qkv + bias).astype(np.float64)
    w = x.shape[1] // 3
    d = w // heads
    out, start = np.empty((x.shape[0], w)), 0
    for n in lengths:
        rows = x[start:start + n]
        for h in range(heads):
            q, k, v = (rows[:, part * w + h * d: part * w + (h + 1) * d] for part in range(3))
            s = q @ k.T * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[start:start + n, h * d:(h + 1) * d] = (p / p.sum(axis=1, keepdims=True)) @ v
        start += n
    return out


@pytest.mark.parametrize("head_width", [24, 32, 64])
def test_attention_matches_float64_per_sequence(head_width):
    rng = np.random.default_rng(head_width)
    heads = 3
    lengths = np.array([1, 5, 16, 17, 40, 33], np.int64)  # one token, partial and whole 16-position tiles
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    qkv = rng.standard_normal((int(lengths.sum()), 3 * heads * head_width)).astype(np.float32)
    bias = rng.standard_normal(3 * heads * head_width).astype(np.float32)
    scale = 1 / math.sqrt(head_width)
    ours = attention(qkv, bias, starts, lengths, heads, scale)
    assert np.allclose(ours, _reference_attention(qkv, bias, lengths, heads, scale), rtol=1e-5, atol=1e-5)


def test_a_sequence_never_attends_to_its_neighbours():
    rng = np.random.default_rng(1)
    lengths = np.array([7, 9], np.int64)
    qkv = rng.standard_normal((16, 3 * 2 * 32)).astype(np.float32)
    bias = np.zeros(3 * 2 * 32, np.float32)
    both = attention(qkv, bias, np.array([0, 7], np.int64), lengths, 2, 0.2)
    alone = attention(qkv[:7].copy(), bias, np.array([0], np.int64), lengths[:1], 2, 0.2)
    assert np.array_equal(both[:7], alone)


def test_gelu_is_the_erf_form():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((200, 130)) * 4).astype(np.float32)  # past the split threshold: both threads
    bias = rng.standard_normal(130).astype(np.float32)
    v = (x + bias).astype(np.float64)
    exact = 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))
    gelu_inplace(x, bias)
    assert np.abs(x - exact).max() < 2e-6 * max(1.0, np.abs(exact).max())
