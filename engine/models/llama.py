"""The `llama` family (Llama 2/3.x, SmolLM2, Mistral-style dense models): the dense blocks with SwiGLU, GQA,
RoPE on adjacent pairs (llama.cpp's converter permutes Q/K rows for it), optional linear RoPE scaling, and
llama3 scaling as the `rope_freqs` divisors."""

from __future__ import annotations

from typing import Any

from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family, no_hf_keys


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    return ModelConfig(**f, rms_eps=float(get(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
                       rope_style="interleaved")


FAMILY = Family(name="llama", gguf_archs=("llama",), hf_model_types=("llama", "mistral"), read_config=read_config,
                layer_tensors=dense.BLOCK_TENSORS, forward=dense.forward, step_flags=dense.step_flags, hf_keys=no_hf_keys)
