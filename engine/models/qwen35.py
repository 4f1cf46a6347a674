"""The `qwen35` and `qwen35moe` families (Qwen3.5, dense and MoE): hybrids of gated DeltaNet layers
(models/deltanet.py: linear attention, a recurrent state per sequence) and gated full-attention layers.

Blocks: x += mixer(rms_norm(x)); x += mlp(rms_norm(x) by `post_attention_norm`), the mixer being DeltaNet on the
layers `attention.recurrent_layers` marks (or, without it, all but every `full_attention_interval`-th) and
attention elsewhere: q rows and an output gate per head from `attn_q` (the attention output times
sigmoid(gate)), QK-norm, NeoX RoPE on `rope.dimension_count` dims (text positions make the multimodal sections
plain RoPE), GQA. MLP: SwiGLU (qwen35), or the routed experts plus a shared expert gated by
sigmoid(`ffn_gate_inp_shexp` x) (qwen35moe). RMSNorm weights are stored with Gemma-style +1 already added, except
DeltaNet's output norm (Hugging Face's `norm.weight`, used as is).

The Hugging Face layout differs from the GGUF's in the DeltaNet tensors, converted at load (hf_tensor): value
heads reordered so value head h reads key head h % k_heads (Hugging Face: h // (v_heads / k_heads)), A_log ->
-exp(A_log), the depthwise conv's (C, 1, K) -> (C, K).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.errors import ModelLoadError
from engine.kernels.backend import Backend, KVCache
from engine.models import deltanet, dense, moe
from engine.models.config import DeltaNetShape, ModelConfig, common_fields, get
from engine.models.family import Family
from engine.models.weights import Weights

_ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
_MOE_MLP = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp_shexp", "ffn_gate_shexp",
            "ffn_up_shexp", "ffn_down_shexp")


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    p = f["arch"] + "."
    n_layer = f["n_layer"]
    recurrent = get(meta, p + "attention.recurrent_layers")
    if recurrent is None:  # llama.cpp's fallback: attention on every interval-th layer
        interval = int(get(meta, p + "full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    if len(recurrent) != n_layer:
        raise ModelLoadError(f"{p}attention.recurrent_layers has {len(recurrent)} entries for {n_layer} layers")
    k_heads = int(get(meta, p + "ssm.group_count", required=True))
    v_heads = int(get(meta, p + "ssm.time_step_rank", required=True))
    head_dim = int(get(meta, p + "ssm.state_size", required=True))
    inner = int(get(meta, p + "ssm.inner_size", v_heads * head_dim))
    if v_heads % k_heads or inner != v_heads * head_dim:
        raise ModelLoadError(f"{p}ssm: {v_heads} value heads of {inner // max(v_heads, 1)} over {k_heads} key heads "
                             f"of {head_dim} is not a DeltaNet shape this engine runs")
    shape = DeltaNetShape(conv_kernel=int(get(meta, p + "ssm.conv_kernel", required=True)), k_heads=k_heads,
                          v_heads=v_heads, head_k_dim=head_dim, head_v_dim=head_dim)
    moe_fields = {}
    if f["arch"] == "qwen35moe":
        moe_fields = dict(n_expert=int(get(meta, p + "expert_count", required=True)),
                          n_expert_used=int(get(meta, p + "expert_used_count", required=True)),
                          n_ff_expert=int(get(meta, p + "expert_feed_forward_length", required=True)),
                          n_ff_shared=int(get(meta, p + "expert_shared_feed_forward_length", 0)))
        if not 0 < moe_fields["n_expert_used"] <= moe_fields["n_expert"]:
            raise ModelLoadError(f"{p}expert_used_count is not in 1..expert_count")
    return ModelConfig(**f, rms_eps=float(get(meta, p + "attention.layer_norm_rms_epsilon", 1e-6)),
                       rope_style="neox", qk_norm=True, attn_output_gate=True,
                       layer_recurrent=tuple(bool(r) for r in recurrent), deltanet=shape, **moe_fields)


def block_tensors(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    mixer = deltanet.TENSORS if cfg.layer_recurrent[layer] else _ATTENTION
    mlp = (_MOE_MLP if cfg.n_ff_shared else _MOE_MLP[:4]) if cfg.n_expert else _DENSE_MLP
    return ("attn_norm", "post_attention_norm") + mixer + mlp


def forward(cfg: ModelConfig, w: Weights, be: Backend, ids: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run ids (T,) at positions cache.length..: keys/values appended for the attention layers, the recurrent
    layers' states advanced; final-normed hidden (T, n_embd)."""
    T, pos0, eps = len(ids), cache.length, cfg.rms_eps
    x = be.embed(w.tensor("token_embd"), ids)
    rope = be.rope_tables(np.arange(pos0, pos0 + T), cfg.rope_dim, cfg.rope_base)
    slot, row = cfg.kv_slot, cfg.state_row
    for i in range(cfg.n_layer):
        blk = f"blk.{i}."
        h = be.rms_norm(x, w.vector(blk + "attn_norm"), eps)
        if cfg.layer_recurrent[i]:
            x = x + deltanet.mix(cfg, w, be, h, blk, row[i], cache)
        else:
            x = x + dense.attention(cfg, w, be, h, i, slot[i], cache, rope)
        h = be.rms_norm(x, w.vector(blk + "post_attention_norm"), eps)
        x = x + (moe.feed_forward(cfg, w, be, h, blk) if cfg.n_expert else dense.gated_mlp(cfg, w, be, h, blk))
    cache.advance(T)
    return be.rms_norm(x, w.vector("output_norm"), eps)


def step_flags(cfg: ModelConfig) -> dict:
    """The compiled step's flags: the dense ones, the layer kinds, a shared expert (the FFN's norm's name:
    Family.decode_step_flags, from the block tensors)."""
    return {**dense.step_flags(cfg), "recurrent": cfg.layer_recurrent, "shared_expert": bool(cfg.n_ff_shared)}


def hf_keys(config: dict[str, Any]) -> dict[str, Any]:
    arch = "qwen35moe" if "moe" in str(config.get("model_type", "")) else "qwen35"
    p = arch + "."
    kinds = config.get("layer_types") or []
    keys = {p + "ssm.conv_kernel": int(config["linear_conv_kernel_dim"]),
            p + "ssm.state_size": int(config["linear_key_head_dim"]),
            p + "ssm.group_count": int(config["linear_num_key_heads"]),
            p + "ssm.time_step_rank": int(config["linear_num_value_heads"]),
            p + "ssm.inner_size": int(config["linear_num_value_heads"]) * int(config["linear_value_head_dim"]),
            p + "full_attention_interval": int(config.get("full_attention_interval") or 4)}
    if int(config["linear_key_head_dim"]) != int(config["linear_value_head_dim"]):
        raise ModelLoadError("config.json: linear_key_head_dim and linear_value_head_dim differ")
    if kinds:
        keys[p + "attention.recurrent_layers"] = [k == "linear_attention" for k in kinds]
    if arch == "qwen35moe":
        keys.update({p + "expert_count": int(config["num_experts"]),
                     p + "expert_used_count": int(config["num_experts_per_tok"]),
                     p + "expert_feed_forward_length": int(config["moe_intermediate_size"]),
                     p + "expert_shared_feed_forward_length": int(config.get("shared_expert_intermediate_size") or 0)})
    return keys


def hf_tensor(name: str, values: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A Hugging Face DeltaNet tensor (f32) as the GGUF stores it; others unchanged."""
    s = cfg.deltanet
    stem = name.split(".")[2] if name.startswith("blk.") else ""
    r = s.v_heads // s.k_heads
    order = [j * r + i for i in range(r) for j in range(s.k_heads)]  # GGUF value head -> Hugging Face's
    kd = 2 * s.k_heads * s.head_k_dim

    def heads(a: np.ndarray, axis: int = 0) -> np.ndarray:  # value heads along axis, reordered
        shape = a.shape
        split = shape[:axis] + (s.v_heads, shape[axis] // s.v_heads) + shape[axis + 1 :]
        return np.take(a.reshape(split), order, axis=axis).reshape(shape)

    if stem == "ssm_a":
        return heads(-np.exp(values.astype(np.float64)).astype(np.float32))
    if stem in ("ssm_dt", "ssm_alpha", "ssm_beta", "attn_gate"):
        return heads(values)
    if stem == "ssm_out":
        return heads(values, axis=1)
    if stem in ("attn_qkv", "ssm_conv1d"):
        values = values.reshape(values.shape[0], -1)  # the conv's (C, 1, K) -> (C, K)
        return np.concatenate([values[:kd], heads(values[kd:])])
    return values


_HF = dict(hf_keys=hf_keys, hf_norm_offset=1.0, hf_reshaped=frozenset(("ssm_a", "ssm_dt", "ssm_alpha", "ssm_beta",
           "attn_gate", "ssm_out", "attn_qkv", "ssm_conv1d")), hf_aliases=((".dt_bias", ".dt_proj.bias"),),
           hf_tensor=hf_tensor, hf_plain_norms=frozenset(("ssm_norm",)))
FAMILY = Family(name="qwen35", gguf_archs=("qwen35",), hf_model_types=("qwen3_5_text", "qwen3_5"),
                read_config=read_config,
                layer_tensors=(), forward=forward, step_flags=step_flags, block_tensors=block_tensors, **_HF)
MOE_FAMILY = Family(name="qwen35moe", gguf_archs=("qwen35moe",), hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
                    read_config=read_config, layer_tensors=(), forward=forward, step_flags=step_flags,
                    block_tensors=block_tensors, **_HF)
