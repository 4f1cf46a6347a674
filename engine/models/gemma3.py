"""The `gemma3` family (Gemma 3 text): four norms per block (pre/post attention, pre/post MLP), per-head RMSNorm
on q and k, a GELU (tanh) gate, embeddings scaled by sqrt(n_embd), NeoX RoPE, and interleaved sliding-window
layers: every 6th layer is global (the file's RoPE base), the others attend to the last `window` positions with
RoPE base 10000 (llama.cpp hard-codes both; ../shared/MODELS.md). The GGUF's norm weights already hold Gemma's +1.
"""

from __future__ import annotations

import math
from typing import Any

from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    window = int(get(meta, "gemma3.attention.sliding_window", 512))
    is_global = [(i + 1) % 6 == 0 for i in range(f["n_layer"])]
    f.update(layer_window=tuple(0 if g else window for g in is_global),
             layer_rope_base=tuple(f["rope_base"] if g else 10000.0 for g in is_global))
    return ModelConfig(**f, rms_eps=float(get(meta, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
                       rope_style="neox", embed_scale=math.sqrt(f["n_embd"]),  # attn_scale: 1/sqrt(head_dim)
                       final_logit_softcap=float(get(meta, "gemma3.final_logit_softcapping", 0.0) or 0.0),
                       qk_norm=True, post_norms=True, act="gelu_tanh")


FAMILY = Family(name="gemma3", gguf_archs=("gemma3",), hf_model_types=("gemma3", "gemma3_text"),
                read_config=read_config,
                layer_tensors=dense.BLOCK_TENSORS + ("attn_q_norm", "attn_k_norm", "post_attention_norm",
                                                     "post_ffw_norm"),
                forward=dense.forward, step_flags=dense.step_flags)
