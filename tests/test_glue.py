"""The compiled row kernels (engine/kernels/cpu/rowops.py, vmath.py) against plain numpy formulas in float64."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import vmath
from engine.kernels.cpu import rowops


def test_exp_is_within_a_few_ulp_and_clamps():
    x = np.concatenate([np.linspace(-87, 88, 200001, dtype=np.float32), np.float32([0.0, -1e-8, 1e-8])])
    got = x.copy()
    vmath.exp_inplace(got, np.empty(x.size, np.int32))
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 5e-7
    far = np.float32([-1000.0, -100.0, 100.0, 1000.0])
    vmath.exp_inplace(far, np.empty(4, np.int32))
    assert np.all(np.isfinite(far)) and far[0] < 1e-37 and far[1] < 1e-37 and far[2] > 1e38


def test_rms_norm_rows():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 3, (7, 576)).astype(np.float32)
    w = rng.normal(1, 0.1, 576).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(rowops.rms_norm_rows(x, w, 1e-5), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("rows", [1, 40])
def test_gated_activations(gelu, rows):
    rng = np.random.default_rng(1)
    gu = rng.normal(0, 4, (rows, 2 * 300)).astype(np.float32)
    gu[0, :4] = [-120.0, 120.0, -30.0, 0.0]  # saturating inputs
    gate, up = gu[:, :300], gu[:, 300:]  # strided views, as the decode step passes them
    g = gate.astype(np.float64)
    act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) if gelu else g / (1 + np.exp(-g))
    np.testing.assert_allclose(rowops.act_mul(gate, up, gelu), act * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("T,L,pos0,first,window", [(5, 12, 7, 0, 0), (64, 64, 0, 0, 0), (40, 100, 60, 0, 0),
                                                   (40, 70, 60, 30, 32), (3, 9, 6, 0, 4)])
def test_causal_softmax(T, L, pos0, first, window, sinks):
    # scores of queries at pos0..pos0+T-1 against keys at first..first+L-1; with sinks, one more logit per head
    # in the denominator (gpt-oss), which takes probability from the keys and gives it to no value
    rng = np.random.default_rng(2)
    s = rng.normal(0, 5, (3, T, L)).astype(np.float32)
    sink = np.array([3.0, -2.0, 12.0], np.float32) if sinks else np.full(3, -np.inf, np.float32)
    qpos = np.arange(pos0, pos0 + T)[:, None]
    kpos = np.arange(first, first + L)[None, :]
    allowed = (kpos <= qpos) & (((qpos - kpos) < window) if window else True)
    z = np.where(allowed, s.astype(np.float64), -np.inf)
    z = np.concatenate([z, np.broadcast_to(sink[:, None, None].astype(np.float64), (3, T, 1))], axis=-1)
    want = np.exp(z - z.max(axis=-1, keepdims=True))
    want = (want / want.sum(axis=-1, keepdims=True))[..., :L]
    got = s.copy()
    rowops.causal_softmax(got, pos0, first, window, sink)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    assert np.all(got[:, ~allowed] == 0)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_rotates_pairs_and_passes_the_rest_through(neox):
    rng = np.random.default_rng(4)
    T, nh, D, half = 5, 3, 16, 6  # rope_dim 12 < D: the last 4 dims pass through
    x = rng.normal(size=(T, nh, D)).astype(np.float32)
    ang = rng.uniform(0, 6, (T, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    want = x.copy()
    ia = np.arange(half) if neox else np.arange(0, 2 * half, 2)
    ib = ia + half if neox else ia + 1
    a, b = x[..., ia], x[..., ib]
    want[..., ia] = a * cos[:, None] - b * sin[:, None]
    want[..., ib] = b * cos[:, None] + a * sin[:, None]
    got = x.copy()
    rowops.rope_rows(got, cos, sin, neox)
    np.testing.assert_array_equal(got, want)  # the same f32 operations: bit for bit
