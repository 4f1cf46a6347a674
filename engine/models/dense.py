"""The forward pass of the decoder-only transformer every supported family is (llama, qwen2, qwen3, phi3,
gemma2, gemma3, qwen3moe), written once in the backend's ops; what differs between families is ModelConfig fields.

Pre-norm blocks: x += attn(rms_norm(x)); x += gated_mlp(rms_norm(x)), with, per the config: biases on q, k, v
(qwen2), per-head RMSNorm on q and k before RoPE (qwen3, gemma3), a norm after attention and after the MLP
(gemma2, gemma3), embeddings scaled (gemma2, gemma3), attention scores soft-capped (gemma2), fused q|k|v and
gate|up matrices (phi3), a sparse MoE MLP (qwen3moe: models/moe.py); GQA, RoPE interleaved or NeoX on rope_dim dims with optional frequency divisors (llama3's
`rope_freqs`, LongRoPE's) and attention factor, per-layer sliding windows and RoPE bases. Shapes: T tokens,
H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.backend import Backend, KVCache, frequency_divisors
from engine.models import moe
from engine.models.config import ModelConfig
from engine.models.weights import Weights

# Tensors every block of a dense model has; a family adds its own (q/k norms, post norms).
BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")
FUSED_BLOCK_TENSORS = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")  # phi3


def forward(cfg: ModelConfig, w: Weights, be: Backend, ids: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run ids (T,) at positions cache.length.. ; append their K/V; return final-normed hidden (T, n_embd)."""
    T, pos0 = len(ids), cache.length
    eps = cfg.rms_eps
    x = be.embed(w.tensor("token_embd"), ids)  # (T, n_embd)
    if cfg.embed_scale != 1.0:
        x *= np.float32(cfg.embed_scale)
    positions = np.arange(pos0, pos0 + T)
    freq_factors = frequency_divisors(cfg, w)
    rope = list(zip(cfg.layer_rope_base, cfg.layer_rope_scale))  # (base, linear factor) per layer
    tables = {bs: be.rope_tables(positions, cfg.rope_dim, bs[0], bs[1], freq_factors, cfg.rope_attn_factor)
              for bs in set(rope)}
    for i in range(cfg.n_layer):
        blk = f"blk.{i}."
        h = be.rms_norm(x, w.vector(blk + "attn_norm"), eps)
        o = attention(cfg, w, be, h, i, i, cache, tables[rope[i]])
        x = x + (be.rms_norm(o, w.vector(blk + "post_attention_norm"), eps) if cfg.post_norms else o)
        h = be.rms_norm(x, w.vector(blk + "ffn_norm"), eps)
        d = moe.feed_forward(cfg, w, be, h, blk) if cfg.n_expert else gated_mlp(cfg, w, be, h, blk)
        x = x + (be.rms_norm(d, w.vector(blk + "post_ffw_norm"), eps) if cfg.post_norms else d)
    cache.advance(T)
    return be.rms_norm(x, w.vector("output_norm"), eps)


def attention(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, layer: int, slot: int, cache: KVCache,
              cos_sin: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Self-attention of block `layer` over normed h (T, n_embd), before the output's residual add: q, k, v, their
    norms and RoPE (cos_sin: the layer's tables), the keys and values appended to the cache's `slot`, attention
    over all of them, the output projection (T, n_embd)."""
    T, pos0 = len(h), cache.length
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    blk = f"blk.{layer}."
    if cfg.fused_qkv:  # one matrix: q rows, then k, then v
        qkv = be.matmul(h, w.tensor(blk + "attn_qkv"))
        q, k, v = qkv[:, : H * D], qkv[:, H * D : (H + Hkv) * D], qkv[:, (H + Hkv) * D :]
    else:
        q, k, v = be.matmul_many(h, [w.tensor(blk + "attn_q"), w.tensor(blk + "attn_k"), w.tensor(blk + "attn_v")])
    if cfg.qkv_bias:
        q, k, v = q + w.bias(blk + "attn_q"), k + w.bias(blk + "attn_k"), v + w.bias(blk + "attn_v")
    gate = None
    if cfg.attn_output_gate:  # each head's q rows, then its gate's (Qwen3.5)
        q, gate = q.reshape(T, H, 2, D)[:, :, 0], q.reshape(T, H, 2, D)[:, :, 1].reshape(T, H * D)
    q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    if cfg.qk_norm:
        q = be.rms_norm(q, w.vector(blk + "attn_q_norm"), cfg.rms_eps)
        k = be.rms_norm(k, w.vector(blk + "attn_k_norm"), cfg.rms_eps)
    cos, sin = cos_sin
    q, k = be.rope(q, cos, sin, cfg.rope_style), be.rope(k, cos, sin, cfg.rope_style)
    keys, values = cache.write(slot, k, v)
    a = be.attention(q, keys, values, pos0, cfg.attn_scale, window=cfg.layer_window[layer], softcap=cfg.attn_softcap,
                     sinks=w.vector(blk + "attn_sinks") if cfg.attn_sinks else None).reshape(T, H * D)
    if gate is not None:
        a = a / (np.float32(1) + np.exp(-gate))  # times sigmoid(gate)
    o = be.matmul(a, w.tensor(blk + "attn_output"))
    return o + w.bias(blk + "attn_output") if cfg.attn_out_bias else o


def gated_mlp(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, blk: str) -> np.ndarray:
    """down(act(gate h) * up h) of block `blk` over normed h (T, n_embd)."""
    if cfg.fused_gate_up:  # ffn_up: the gate's rows, then the up's
        gu = be.matmul(h, w.tensor(blk + "ffn_up"))
        g = be.act_mul(gu[:, : cfg.n_ff], gu[:, cfg.n_ff :], cfg.act)
    else:
        g = be.act_mul(*be.matmul_many(h, [w.tensor(blk + "ffn_gate"), w.tensor(blk + "ffn_up")]), cfg.act)
    return be.matmul(g, w.tensor(blk + "ffn_down"))


def step_flags(cfg: ModelConfig) -> dict:
    """What a backend's compiled decode step needs to know of a dense model's blocks (Backend.prepare)."""
    return {"qk_norm": cfg.qk_norm, "post_norms": cfg.post_norms, "act": cfg.act, "qkv_bias": cfg.qkv_bias,
            "fused_qkv": cfg.fused_qkv, "fused_gate_up": cfg.fused_gate_up, "moe": bool(cfg.n_expert)}
