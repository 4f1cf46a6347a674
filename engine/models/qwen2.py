"""The `qwen2` family (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen): the dense blocks with biases on q, k and v,
SwiGLU, GQA, NeoX RoPE (the converter does not permute Q/K), usually a tied head."""

from __future__ import annotations

from typing import Any

from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family, no_hf_keys


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    return ModelConfig(**f, rms_eps=float(get(meta, "qwen2.attention.layer_norm_rms_epsilon", 1e-6)),
                       rope_style="neox", qkv_bias=True)


FAMILY = Family(name="qwen2", gguf_archs=("qwen2",), hf_model_types=("qwen2",), read_config=read_config,
                layer_tensors=dense.BLOCK_TENSORS, forward=dense.forward, step_flags=dense.step_flags, hf_keys=no_hf_keys)
