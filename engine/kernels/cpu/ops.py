"""The CPU backend's forward-pass ops in f32: norms, RoPE, attention, gated activations.

numpy where it is fast (the RoPE tables, the attention GEMMs), the compiled row kernels of rowops.py where numpy
makes several passes over big temporaries (norms, RoPE, gated activations, the causal softmax). Both the exact
path and the prompts of the fast path run these.

Shapes are written next to arrays: T = tokens in this chunk, L = cached keys, H = query heads,
Hkv = key/value heads, D = head dim.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.backend import PROMPT_TILE
from engine.kernels.cpu import rowops


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (..., n) * rsqrt(mean(x^2) + eps) * weight (n,)."""
    n = x.shape[-1]
    rows = np.ascontiguousarray(x.reshape(-1, n), dtype=np.float32)
    return rowops.rms_norm_rows(rows, np.ascontiguousarray(weight, dtype=np.float32), eps).reshape(x.shape)


ACTIVATIONS = {"silu": False, "gelu_tanh": True}  # name -> the compiled kernels' gelu flag


def act_mul(gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
    """act(gate) * up, (T, F): act "silu", or "gelu_tanh" (GELU's tanh approximation)."""
    gelu = ACTIVATIONS[act]
    # matmul_many gives gate and up as the two column halves of one (T, 2F) result: run on that whole array,
    # whose rows are contiguous (the slices' strided rows do not vectorize).
    base = gate.base
    if (base is not None and up.base is base and base.ndim == 2 and base.flags.c_contiguous
            and base.dtype == np.float32 and base.shape == (gate.shape[0], 2 * gate.shape[1])
            and gate.__array_interface__["data"][0] == base.__array_interface__["data"][0]
            and up.__array_interface__["data"][0] == base.__array_interface__["data"][0] + 4 * gate.shape[1]):
        return rowops.act_mul_halves(base, gelu)
    return rowops.act_mul(gate, up, gelu)


def inv_freq(rope_dim: int, base: float, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """The rotary frequencies (rope_dim/2,) f64, divided by freq_factors where given (llama3 scaling)."""
    inv = 1.0 / (base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    return inv / freq_factors.astype(np.float64) if freq_factors is not None else inv


def rope_tables(positions: np.ndarray, rope_dim: int, base: float, scale: float = 1.0,
                freq_factors: np.ndarray | None = None, attn_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (T, rope_dim/2) for the given absolute positions, both times attn_factor (LongRoPE); computed in
    f64, returned in f32."""
    angles = np.outer(positions.astype(np.float64) / scale, inv_freq(rope_dim, base, freq_factors))  # (T, rope_dim/2)
    return (np.cos(angles) * attn_factor).astype(np.float32), (np.sin(angles) * attn_factor).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate x (T, heads, D) by position (a new array); dims past rope_dim (= 2 * cos.shape[1]) pass through.
    style "neox": pairs (i, i + rope_dim/2); else interleaved pairs (2i, 2i+1)."""
    out = np.array(x, dtype=np.float32, order="C")  # a copy
    rowops.rope_rows(out, np.ascontiguousarray(cos), np.ascontiguousarray(sin), style == "neox")
    return out


ATTN_BLOCK = 64  # queries per block of a prompt's attention


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float, window: int = 0,
              softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal (optionally sliding-window) grouped-query attention.

    q (T, H, D) for positions pos0..pos0+T-1; k, v (L, Hkv, D) for positions 0..L-1 (L = pos0 + T).
    A query at position p sees keys j with j <= p and, with a window, p - j < window. sinks (H,): a logit per
    head that joins each softmax's denominator and weighs no value (gpt-oss). Returns (T, H, D).
    """
    T, H, D = q.shape
    if T > ATTN_BLOCK:  # causal: a block of queries needs no key after its last one (a 512-token chunk in 4
        # blocks computes 10/16 of the full score matrix)
        return np.concatenate([attention(q[t0 : t0 + ATTN_BLOCK], k[: pos0 + t0 + ATTN_BLOCK],
                                         v[: pos0 + t0 + ATTN_BLOCK], pos0 + t0, scale, window, softcap, sinks)
                               for t0 in range(0, T, ATTN_BLOCK)])
    L, Hkv, _ = k.shape
    if pos0 == 0 and T < PROMPT_TILE:
        # A prompt's first tile, when partial, runs as a whole one: queries padded with zeros to PROMPT_TILE,
        # keys and values to PROMPT_TILE (past every real query's position: masked). Its two GEMMs then have the
        # shapes a whole first tile has, so a row's numbers there do not depend on the prompt's length:
        # OpenBLAS (its SkylakeX kernels, 0.3.31) takes small products through another kernel whose per-row
        # roundings change with the row and column counts ((x[:4] @ w)[:3] != x[:3] @ w for a (64, 3) w), and
        # the model amplified that to logprobs ~0.5 apart between a prompt and its prefix
        # (tests/test_generate.py::test_logprobs_rows_match_next_logprobs). Cost: a short prompt's attention is
        # a whole tile's (SmolLM2, 3 tokens: 17 -> 22 ms). Not past the first tile: padding a few queries at a
        # long context to a whole tile multiplies that chunk's attention work (up to 64x),
        # and a later tile's rows are promised the same numbers only across cuts on tile boundaries
        # (kernels/backend.py, PROMPT_TILE).
        qp = np.zeros((PROMPT_TILE, H, D), q.dtype)
        qp[:T] = q
        kp, vp = (np.zeros((PROMPT_TILE, *a.shape[1:]), a.dtype) for a in (k, v))
        kp[:L], vp[:L] = k, v
        return attention(qp, kp, vp, pos0, scale, window, softcap, sinks)[:T]
    group = H // Hkv
    first = max(0, pos0 - window + 1) if window else 0  # keys no query of this chunk can see
    k, v = k[first:], v[first:]
    # The G query heads of a kv head share its keys: one GEMM of G*T rows per kv head (not G of T rows each).
    qg = np.ascontiguousarray(q.reshape(T, Hkv, group, D).transpose(1, 2, 0, 3)).reshape(Hkv, group * T, D)
    scores = np.matmul(qg, k.transpose(1, 2, 0))  # (Hkv, G*T, L'), rows g-major: (Hkv, G, T, L') in memory
    scores *= np.float32(scale)
    if softcap:
        scores = np.tanh(scores / np.float32(softcap)) * np.float32(softcap)
    # Masked (causal, sliding window) softmax in place; masked keys get weight 0.
    sink = np.full(H, -np.inf, np.float32) if sinks is None else np.asarray(sinks, np.float32)  # per query head
    rowops.causal_softmax(scores.reshape(Hkv * group, T, L - first), pos0, first, window, sink)
    out = np.matmul(scores, v.transpose(1, 0, 2))  # (Hkv, G*T, D)
    return out.reshape(Hkv, group, T, D).transpose(2, 0, 1, 3).reshape(T, H, D)
