"""The gated DeltaNet layer of the Qwen3.5 hybrids: linear attention with a recurrent state per sequence.

Per token: q|k|v = attn_qkv x, through a short causal convolution (`ssm_conv1d`, carried across calls in the
cache's "conv" state) and SiLU; q and k L2-normalized per head, q scaled by 1/sqrt(head_k_dim); a decay
g = ssm_a * softplus(ssm_alpha x + ssm_dt.bias) (ssm_a holds -exp(A_log)) and a write strength
beta = sigmoid(ssm_beta x) per value head; the delta rule updates each value head's (head_k_dim, head_v_dim)
state (the cache's "ssm" state) and reads the query out of it; the output is RMS-normed per head (`ssm_norm`),
gated by SiLU(attn_gate x) and projected by `ssm_out`. Value head h reads key head h % k_heads.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.backend import Backend, KVCache
from engine.models.config import ModelConfig
from engine.models.weights import Weights

TENSORS = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_conv1d", "ssm_dt.bias", "ssm_a", "ssm_norm",
           "ssm_out")


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def _l2_normalized(x: np.ndarray, eps: float) -> np.ndarray:
    """x (..., D) / its L2 norm (at least eps), as llama.cpp's l2_norm."""
    norm = np.sqrt(np.einsum("...d,...d->...", x, x, dtype=np.float32))[..., None]
    return x / np.maximum(norm, np.float32(eps))


def mix(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, blk: str, row: int, cache: KVCache) -> np.ndarray:
    """The layer's output (T, n_embd) for normed h (T, n_embd); row: this layer's row of the cache's states."""
    s = cfg.deltanet
    T, Hk, Hv, Dk, Dv = len(h), s.k_heads, s.v_heads, s.head_k_dim, s.head_v_dim
    qkv, z, alpha, b = be.matmul_many(h, [w.tensor(blk + n)
                                          for n in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta")])
    conv_w = w.vector(blk + "ssm_conv1d").reshape(s.conv_channels, s.conv_kernel)
    x = _silu(be.causal_conv(qkv, conv_w, cache.state["conv"][row]))
    q = _l2_normalized(x[:, : Hk * Dk].reshape(T, Hk, Dk), cfg.rms_eps) * np.float32(Dk ** -0.5)
    k = _l2_normalized(x[:, Hk * Dk : 2 * Hk * Dk].reshape(T, Hk, Dk), cfg.rms_eps)
    v = x[:, 2 * Hk * Dk :].reshape(T, Hv, Dv)
    g = w.parameter(blk + "ssm_a") * np.logaddexp(np.float32(0), alpha + w.bias(blk + "ssm_dt"))  # softplus
    beta = np.float32(1) / (np.float32(1) + np.exp(-b))
    o = be.delta_rule(q, k, v, g, beta, cache.state["ssm"][row])  # (T, Hv, Dv)
    o = be.rms_norm(o, w.vector(blk + "ssm_norm"), cfg.rms_eps) * _silu(z.reshape(T, Hv, Dv))
    return be.matmul(o.reshape(T, Hv * Dv), w.tensor(blk + "ssm_out"))
