"""The CPU kernels of recurrent layers (a hybrid's gated DeltaNet, models/deltanet.py): the short causal
convolution over a sequence's inputs and the gated delta rule, both carrying state from one call to the next.

The delta rule is sequential in the tokens, so a prompt runs it token by token (per value head in parallel):
its cost is 3 passes over a (head_k_dim, head_v_dim) state per token and head — small beside the layer's
matrices (Qwen3.5: 128 x 128 per head). Shapes: T tokens, C channels, K the kernel width, Hk key heads, Hv
value heads, Dk/Dv their head dims.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


def causal_conv(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution of x (T, C) with weight (C, K), continuing from state (K-1, C): the K-1
    inputs before x (zeros at a sequence's start). Returns (T, C); state becomes the last K-1 inputs."""
    T, K = x.shape[0], weight.shape[1]
    xx = np.concatenate([state, x.astype(np.float32, copy=False)])  # (T + K - 1, C): input t + K - 1 is x[t]
    out = xx[0:T] * weight[:, 0]
    for i in range(1, K):
        out += xx[i : i + T] * weight[:, i]
    state[:] = xx[T:]
    return out


@njit(cache=True)
def delta_token(q, k, v, g, beta, S, out, mem, delta):
    """One token of one value head: S (Dk, Dv) = exp(g) S; S += k (beta (v - S^T k))^T; out (Dv,) = S^T q.
    mem, delta: (Dv,) scratch. Shared by prompts (delta_rule) and the compiled decode step."""
    Dk, Dv = S.shape
    decay = np.float32(math.exp(g))
    for c in range(Dv):
        mem[c] = 0.0
    for a in range(Dk):  # decay the state and read what it holds for this key
        ka = k[a]
        for c in range(Dv):
            s = S[a, c] * decay
            S[a, c] = s
            mem[c] += s * ka
    for c in range(Dv):
        delta[c] = (v[c] - mem[c]) * beta
        out[c] = 0.0
    for a in range(Dk):  # write the correction, then read the query out of the new state
        ka, qa = k[a], q[a]
        for c in range(Dv):
            s = S[a, c] + ka * delta[c]
            S[a, c] = s
            out[c] += s * qa


@njit(parallel=True, cache=True)
def _delta_rule(q, k, v, g, beta, state, out):
    T, Hk = q.shape[0], q.shape[1]
    Hv, Dv = v.shape[1], v.shape[2]
    for h in prange(Hv):
        mem = np.empty(Dv, np.float32)
        delta = np.empty(Dv, np.float32)
        for t in range(T):  # value head h reads key head h % Hk (GGUF's head order)
            delta_token(q[t, h % Hk], k[t, h % Hk], v[t, h], g[t, h], beta[t, h], state[h], out[t, h], mem, delta)


def delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
               state: np.ndarray) -> np.ndarray:
    """The gated delta rule over T tokens: per token and value head h (key head h % Hk), S = exp(g) S;
    S += k (beta (v - S^T k))^T; out = S^T q. q, k (T, Hk, Dk) (normalized, q scaled), v (T, Hv, Dv), g, beta
    (T, Hv), state (Hv, Dk, Dv) f32, updated in place. Returns (T, Hv, Dv)."""
    f32 = [np.ascontiguousarray(a, np.float32) for a in (q, k, v, g, beta)]
    out = np.empty(v.shape, np.float32)
    _delta_rule(*f32, state, out)
    return out
