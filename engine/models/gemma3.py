"""The `gemma3` family forward pass.

Four norms per block (pre/post attention, pre/post FFN), per-head RMSNorm on q and k, GELU (tanh)
gated MLP, embeddings scaled by sqrt(n_embd), NeoX RoPE, and interleaved sliding-window layers:
local layers attend to the last `window` positions with RoPE base 10000, every 6th layer is global.
The GGUF's norm weights already include Gemma's +1.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.backend import Backend, KVCache
from engine.models.config import ModelConfig
from engine.models.weights import Weights

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")


def forward(cfg: ModelConfig, w: Weights, be: Backend, ids: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run ids (T,) at positions cache.length.. ; append their K/V; return final-normed hidden (T, n_embd)."""
    T, pos0 = len(ids), cache.length
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    eps = cfg.rms_eps
    x = be.embed(w.tensor("token_embd"), ids) * np.float32(cfg.embed_scale)  # (T, n_embd)
    positions = np.arange(pos0, pos0 + T)
    tables = {base: be.rope_tables(positions, cfg.rope_dim, base, cfg.rope_scaling.factor)
              for base in set(cfg.layer_rope_base)}
    for i in range(cfg.n_layer):
        blk = f"blk.{i}."
        cos, sin = tables[cfg.layer_rope_base[i]]
        h = be.rms_norm(x, w.vector(blk + "attn_norm"), eps)
        q, k, v = be.matmul_many(h, [w.tensor(blk + "attn_q"), w.tensor(blk + "attn_k"), w.tensor(blk + "attn_v")])
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        q = be.rope(be.rms_norm(q, w.vector(blk + "attn_q_norm"), eps), cos, sin, cfg.rope_style)
        k = be.rope(be.rms_norm(k, w.vector(blk + "attn_k_norm"), eps), cos, sin, cfg.rope_style)
        keys, values = cache.write(i, k, v)
        a = be.attention(q, keys, values, pos0, cfg.attn_scale, window=cfg.layer_window[i]).reshape(T, H * D)
        x = x + be.rms_norm(be.matmul(a, w.tensor(blk + "attn_output")), w.vector(blk + "post_attention_norm"), eps)
        h = be.rms_norm(x, w.vector(blk + "ffn_norm"), eps)
        g = be.act_mul(*be.matmul_many(h, [w.tensor(blk + "ffn_gate"), w.tensor(blk + "ffn_up")]), "gelu_tanh")
        x = x + be.rms_norm(be.matmul(g, w.tensor(blk + "ffn_down")), w.vector(blk + "post_ffw_norm"), eps)
    cache.advance(T)
    return be.rms_norm(x, w.vector("output_norm"), eps)

# What a backend's compiled decode step needs to know about this family (Backend.prepare).
STEP_FLAGS = {"qk_norm": True, "post_norms": True, "act": "gelu_tanh"}
