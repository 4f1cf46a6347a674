"""The `llama` family forward pass (Llama 2/3, SmolLM2, Mistral-style dense models).

Pre-norm blocks: x += attn(rms_norm(x)); x += swiglu_mlp(rms_norm(x)). GQA, RoPE on the GGUF's
permuted Q/K (adjacent pairs), optional linear RoPE scaling and llama3 frequency factors.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.backend import Backend, KVCache
from engine.models.config import ModelConfig
from engine.models.weights import Weights

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def forward(cfg: ModelConfig, w: Weights, be: Backend, ids: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run ids (T,) at positions cache.length.. ; append their K/V; return final-normed hidden (T, n_embd)."""
    T, pos0 = len(ids), cache.length
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    x = be.embed(w.tensor("token_embd"), ids)  # (T, n_embd)
    cos, sin = be.rope_tables(np.arange(pos0, pos0 + T), cfg.rope_dim, cfg.rope_base, cfg.rope_scaling.factor,
                              w.optional_vector("rope_freqs"))
    for i in range(cfg.n_layer):
        blk = f"blk.{i}."
        h = be.rms_norm(x, w.vector(blk + "attn_norm"), cfg.rms_eps)
        q, k, v = be.matmul_many(h, [w.tensor(blk + "attn_q"), w.tensor(blk + "attn_k"), w.tensor(blk + "attn_v")])
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        q, k = be.rope(q, cos, sin, cfg.rope_style), be.rope(k, cos, sin, cfg.rope_style)
        keys, values = cache.write(i, k, v)
        a = be.attention(q, keys, values, pos0, cfg.attn_scale).reshape(T, H * D)
        x = x + be.matmul(a, w.tensor(blk + "attn_output"))
        h = be.rms_norm(x, w.vector(blk + "ffn_norm"), cfg.rms_eps)
        g = be.act_mul(*be.matmul_many(h, [w.tensor(blk + "ffn_gate"), w.tensor(blk + "ffn_up")]), "silu")
        x = x + be.matmul(g, w.tensor(blk + "ffn_down"))
    cache.advance(T)
    return be.rms_norm(x, w.vector("output_norm"), cfg.rms_eps)

# What a backend's compiled decode step needs to know about this family (Backend.prepare).
STEP_FLAGS = {"qk_norm": False, "post_norms": False, "act": "silu"}
