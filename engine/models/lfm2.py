"""The `lfm2` family (Liquid LFM2 / LFM2.5): a hybrid of gated short-convolution blocks and attention blocks.

`attention.head_count_kv` is an array, 0 marking a convolution layer. Convolution block: `shortconv.in_proj`
gives three n_embd chunks B, C, x; y = C * conv(B * x), a causal depthwise convolution of `shortconv.l_cache`
taps (`shortconv.conv`, (n_embd, taps), no bias, no activation) carried across calls in the cache's "conv"
state; then `shortconv.out_proj`. Attention block: GQA with per-head RMSNorm on q and k, NeoX RoPE, scale
1/sqrt(head_dim). Every block: x += op(rms_norm(x) by `attn_norm`); x += SwiGLU(rms_norm(x) by `ffn_norm`). The
final norm is `token_embd_norm`; tied embeddings.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.errors import ModelLoadError
from engine.kernels.backend import Backend, KVCache
from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family
from engine.models.weights import Weights

_CONV = ("attn_norm", "shortconv.in_proj", "shortconv.conv", "shortconv.out_proj", "ffn_norm", "ffn_gate", "ffn_up",
         "ffn_down")
_ATTENTION = dense.BLOCK_TENSORS + ("attn_q_norm", "attn_k_norm")


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    kv = get(meta, "lfm2.attention.head_count_kv", required=True)
    kv = [int(k) for k in kv] if isinstance(kv, (list, tuple, np.ndarray)) else None
    f = common_fields({**meta, "lfm2.attention.head_count_kv": max(kv) if kv else 0}, vocab_size)
    if not kv or len(kv) != f["n_layer"] or not max(kv):
        raise ModelLoadError("lfm2.attention.head_count_kv must list every layer's KV heads (0: a convolution layer)")
    if any(k not in (0, max(kv)) for k in kv):
        raise ModelLoadError("lfm2: attention layers with different KV head counts are not supported")
    return ModelConfig(**f, rms_eps=float(get(meta, "lfm2.attention.layer_norm_rms_epsilon", 1e-5)),
                       rope_style="neox", qk_norm=True, layer_recurrent=tuple(k == 0 for k in kv),
                       shortconv_kernel=int(get(meta, "lfm2.shortconv.l_cache", required=True)))


def block_tensors(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    return _CONV if cfg.layer_recurrent[layer] else _ATTENTION


def short_conv(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, blk: str, row: int,
               cache: KVCache) -> np.ndarray:
    """The convolution block's output (T, n_embd) for normed h; row: its row of the cache's "conv" state."""
    E = cfg.n_embd
    bcx = be.matmul(h, w.tensor(blk + "shortconv.in_proj"))
    b, c, x = bcx[:, :E], bcx[:, E : 2 * E], bcx[:, 2 * E :]
    conv = w.vector(blk + "shortconv.conv").reshape(E, cfg.shortconv_kernel)
    y = c * be.causal_conv(b * x, conv, cache.state["conv"][row])
    return be.matmul(y, w.tensor(blk + "shortconv.out_proj"))


def forward(cfg: ModelConfig, w: Weights, be: Backend, ids: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run ids (T,) at positions cache.length..: keys/values for the attention layers, the convolution layers'
    states advanced; final-normed hidden (T, n_embd)."""
    T, pos0, eps = len(ids), cache.length, cfg.rms_eps
    x = be.embed(w.tensor("token_embd"), ids)
    rope = be.rope_tables(np.arange(pos0, pos0 + T), cfg.rope_dim, cfg.rope_base)
    slot, row = cfg.kv_slot, cfg.state_row
    for i in range(cfg.n_layer):
        blk = f"blk.{i}."
        h = be.rms_norm(x, w.vector(blk + "attn_norm"), eps)
        if cfg.layer_recurrent[i]:
            x = x + short_conv(cfg, w, be, h, blk, row[i], cache)
        else:
            x = x + dense.attention(cfg, w, be, h, i, slot[i], cache, rope)
        x = x + dense.gated_mlp(cfg, w, be, be.rms_norm(x, w.vector(blk + "ffn_norm"), eps), blk)
    cache.advance(T)
    return be.rms_norm(x, w.vector("token_embd_norm"), eps)


def hf_keys(config: dict[str, Any]) -> dict[str, Any]:
    kinds = config.get("layer_types") or []
    if not kinds:
        full = set(config.get("full_attn_idxs") or [])
        kinds = ["full_attention" if i in full else "conv" for i in range(int(config["num_hidden_layers"]))]
    if config.get("conv_bias"):
        raise ModelLoadError("config.json: LFM2 with conv_bias is not supported")
    ff = int(config["intermediate_size"])
    if config.get("block_auto_adjust_ff_dim"):  # as transformers sizes the MLP
        ff = int(2 * ff / 3)
        if config.get("block_ffn_dim_multiplier") is not None:
            ff = int(float(config["block_ffn_dim_multiplier"]) * ff)
            step = int(config.get("block_multiple_of") or 256)
            ff = step * ((ff + step - 1) // step)
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return {"lfm2.attention.head_count_kv": [0 if k == "conv" else kv for k in kinds],
            "lfm2.shortconv.l_cache": int(config["conv_L_cache"]), "lfm2.feed_forward_length": ff,
            "lfm2.attention.layer_norm_rms_epsilon": float(config.get("norm_eps", 1e-5))}


def hf_tensor(name: str, values: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The depthwise conv's (C, 1, K) -> (C, K); the projections as they are."""
    return values.reshape(values.shape[0], -1) if values.ndim == 3 else values


def step_flags(cfg: ModelConfig) -> dict:
    """The compiled step's flags: the dense ones, the layer kinds (the final norm's name: Family.final_norm)."""
    return {**dense.step_flags(cfg), "recurrent": cfg.layer_recurrent, "shortconv": True}


FAMILY = Family(name="lfm2", gguf_archs=("lfm2",), hf_model_types=("lfm2",), read_config=read_config,
                layer_tensors=(), forward=forward, step_flags=step_flags, hf_keys=hf_keys, block_tensors=block_tensors,
                hf_reshaped=frozenset(("shortconv",)), hf_tensor=hf_tensor, final_norm="token_embd_norm")
