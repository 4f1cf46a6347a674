"""The `gemma3` family (Gemma 3 text): four norms per block (pre/post attention, pre/post MLP), per-head RMSNorm
on q and k, a GELU (tanh) gate, embeddings scaled by sqrt(n_embd), NeoX RoPE, and interleaved sliding-window
layers: every 6th layer is global (the file's RoPE base), the others attend to the last `window` positions with
RoPE base 10000 (llama.cpp hard-codes both; docs/models.md); a config.json's layer_types and local RoPE base
(hf_keys) override them. The GGUF's norm weights already hold Gemma's +1.
"""

from __future__ import annotations

import math
from typing import Any

from engine.errors import UnsupportedModel
from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    window = int(get(meta, "gemma3.attention.sliding_window", 512))
    sliding = get(meta, "gemma3.attention.sliding_window_pattern")  # per layer, where a config.json states it
    if sliding is not None and len(sliding) == f["n_layer"]:
        is_global = [not bool(s) for s in sliding]
    else:  # llama.cpp's fixed pattern: every 6th layer global
        is_global = [(i + 1) % 6 == 0 for i in range(f["n_layer"])]
    local_base = float(get(meta, "gemma3.rope.freq_base_swa", 10000.0))
    f.update(layer_window=tuple(0 if g else window for g in is_global),
             layer_rope_base=tuple(f["rope_base"] if g else local_base for g in is_global),
             # linear RoPE scaling (Gemma 3 4B and up) is the global layers' only, as llama.cpp's rope_freq_scale_swa 1
             layer_rope_scale=tuple(f["rope_scaling"].factor if g else 1.0 for g in is_global))
    if "gemma3.attention.scale" in meta:  # a config.json's query_pre_attn_scalar (hf_keys)
        f["attn_scale"] = float(meta["gemma3.attention.scale"])
    return ModelConfig(**f, rms_eps=float(get(meta, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
                       rope_style="neox", embed_scale=math.sqrt(f["n_embd"]),  # attn_scale: 1/sqrt(head_dim)
                       final_logit_softcap=float(get(meta, "gemma3.final_logit_softcapping", 0.0) or 0.0),
                       qk_norm=True, post_norms=True, act="gelu_tanh")


def hf_keys(config: dict[str, Any]) -> dict[str, Any]:
    n_layer = int(config.get("num_hidden_layers") or 0)
    types = config.get("layer_types")
    if not isinstance(types, list) or len(types) != n_layer:
        period = int(config.get("sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layer)]
    if config.get("attn_logit_softcapping"):
        raise UnsupportedModel("Gemma 3 with attention-logit soft-capping is not supported")
    rope = config.get("rope_parameters")
    local = rope.get("sliding_attention", {}) if isinstance(rope, dict) else {}
    keys = {"gemma3.attention.sliding_window": int(config.get("sliding_window") or 512),
            "gemma3.attention.sliding_window_pattern": [t == "sliding_attention" for t in types],
            "gemma3.rope.freq_base_swa": float(local.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0),
            "gemma3.final_logit_softcapping": float(config.get("final_logit_softcapping") or 0.0)}
    if config.get("query_pre_attn_scalar"):
        keys["gemma3.attention.scale"] = 1.0 / math.sqrt(float(config["query_pre_attn_scalar"]))
    return keys


FAMILY = Family(name="gemma3", gguf_archs=("gemma3",), hf_model_types=("gemma3", "gemma3_text"),
                read_config=read_config,
                layer_tensors=dense.BLOCK_TENSORS + ("attn_q_norm", "attn_k_norm", "post_attention_norm",
                                                     "post_ffw_norm"),
                forward=dense.forward, step_flags=dense.step_flags, hf_keys=hf_keys, hf_norm_offset=1.0)
