"""The `qwen3` family (dense Qwen3): the dense blocks with per-head RMSNorm on q and k before RoPE, no biases,
SwiGLU, GQA, NeoX RoPE; the head dim is `attention.key_length`, which need not be n_embd / n_head."""

from __future__ import annotations

from typing import Any

from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family, no_hf_keys


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    return ModelConfig(**f, rms_eps=float(get(meta, "qwen3.attention.layer_norm_rms_epsilon", 1e-6)),
                       rope_style="neox", qk_norm=True)


FAMILY = Family(name="qwen3", gguf_archs=("qwen3",), hf_model_types=("qwen3",), read_config=read_config,
                layer_tensors=dense.BLOCK_TENSORS + ("attn_q_norm", "attn_k_norm"), forward=dense.forward,
                step_flags=dense.step_flags, hf_keys=no_hf_keys)
