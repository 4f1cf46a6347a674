"""The `phi3` family (Phi-3, Phi-3.5, Phi-4-mini): dense blocks with one fused q|k|v matrix (`attn_qkv`) and the
gate and up projections fused in `ffn_up` (gate rows first; SwiGLU), NeoX RoPE on `rope.dimension_count` dims
(Phi-4-mini rotates 3/4 of each head), and LongRoPE: frequency divisors per rotary pair and an attention factor
that multiplies cos and sin. llama.cpp ignores Phi-3's sliding window, and so does this.

LongRoPE has short factors (up to `rope.scaling.original_context_length`) and long ones (beyond). As llama.cpp,
the choice is made once for the model, by the context window asked for at load (load_model(context=N),
`serve --ctx N`): up to the original length, the short factors and that window; past it, the long factors and
a window up to the trained context length.
"""

from __future__ import annotations

from typing import Any

from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family, no_hf_keys


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    original, trained = int(get(meta, "phi3.rope.scaling.original_context_length", 0)), f["context_length"]
    if original and original < trained:
        f.update(context_length=original, long_context=trained, long_rope_factors="rope_factors_long")
    return ModelConfig(**f, rms_eps=float(get(meta, "phi3.attention.layer_norm_rms_epsilon", 1e-5)),
                       rope_style="neox", rope_factors="rope_factors_short",
                       rope_attn_factor=float(get(meta, "phi3.rope.scaling.attn_factor", 1.0) or 1.0),
                       fused_qkv=True, fused_gate_up=True)


FAMILY = Family(name="phi3", gguf_archs=("phi3",), hf_model_types=("phi3",), read_config=read_config,
                layer_tensors=dense.FUSED_BLOCK_TENSORS, forward=dense.forward, step_flags=dense.step_flags, hf_keys=no_hf_keys)
