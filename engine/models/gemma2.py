"""The `gemma2` family (Gemma 2): four norms per block (pre/post attention, pre/post MLP), a GELU (tanh) gate,
embeddings scaled by sqrt(n_embd), NeoX RoPE, attention scores and final logits soft-capped (c tanh(x / c)), and
a sliding window on every even layer (odd layers are global, as llama.cpp's pattern of 2). The query scale is
1/sqrt(head_dim), except Gemma 2 27B's 1/sqrt(n_embd / n_head) (llama.cpp tells it by its 46 layers). The
GGUF's norm weights already hold Gemma's +1.
"""

from __future__ import annotations

import math
from typing import Any

from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    window = int(get(meta, "gemma2.attention.sliding_window", 4096))
    f["layer_window"] = tuple(window if i % 2 == 0 else 0 for i in range(f["n_layer"]))
    if "gemma2.attention.scale" in meta:  # a Hugging Face config's query_pre_attn_scalar (hf_keys)
        f["attn_scale"] = float(meta["gemma2.attention.scale"])
    elif f["n_layer"] == 46:  # Gemma 2 27B: query_pre_attn_scalar = n_embd / n_head
        f["attn_scale"] = 1.0 / math.sqrt(f["n_embd"] / f["n_head"])
    return ModelConfig(**f, rms_eps=float(get(meta, "gemma2.attention.layer_norm_rms_epsilon", 1e-6)),
                       rope_style="neox", embed_scale=math.sqrt(f["n_embd"]),
                       attn_softcap=float(get(meta, "gemma2.attn_logit_softcapping", 50.0) or 0.0),
                       final_logit_softcap=float(get(meta, "gemma2.final_logit_softcapping", 30.0) or 0.0),
                       post_norms=True, act="gelu_tanh")


def hf_keys(config: dict[str, Any]) -> dict[str, Any]:
    keys = {"gemma2.attention.sliding_window": int(config.get("sliding_window") or 4096),
            "gemma2.attn_logit_softcapping": float(config.get("attn_logit_softcapping") or 0.0),
            "gemma2.final_logit_softcapping": float(config.get("final_logit_softcapping") or 0.0)}
    if config.get("query_pre_attn_scalar"):
        keys["gemma2.attention.scale"] = 1.0 / math.sqrt(float(config["query_pre_attn_scalar"]))
    return keys


FAMILY = Family(name="gemma2", gguf_archs=("gemma2",), hf_model_types=("gemma2",), read_config=read_config,
                layer_tensors=dense.BLOCK_TENSORS + ("post_attention_norm", "post_ffw_norm"),
                forward=dense.forward, step_flags=dense.step_flags, hf_keys=hf_keys, hf_norm_offset=1.0)
