"""The `qwen3moe` family (Qwen3-MoE: Qwen3-30B-A3B and kin): qwen3's attention (QK-norm, no biases, NeoX RoPE)
with a sparse MoE MLP in every block (models/moe.py): a softmax router over `expert_count` experts, the top
`expert_used_count` of them renormalized, SwiGLU experts of width `expert_feed_forward_length`.

The compiled decode step runs it (kernels/cpu/moe_step.py): a decoded token reads its k experts' rows only.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ModelLoadError, UnsupportedModel
from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    n_expert = int(get(meta, "qwen3moe.expert_count", required=True))
    used = int(get(meta, "qwen3moe.expert_used_count", required=True))
    if not 0 < used <= n_expert:
        raise ModelLoadError(f"qwen3moe.expert_used_count {used} is not in 1..expert_count ({n_expert})")
    return ModelConfig(**f, rms_eps=float(get(meta, "qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)),
                       rope_style="neox", qk_norm=True, n_expert=n_expert, n_expert_used=used,
                       n_ff_expert=int(get(meta, "qwen3moe.expert_feed_forward_length", f["n_ff"])))


def hf_keys(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1) or 1) != 1:
        raise UnsupportedModel("Qwen3-MoE checkpoints with dense MLP layers between the MoE ones (mlp_only_layers, "
                               "decoder_sparse_step) are not supported")
    if not config.get("norm_topk_prob", True):
        raise UnsupportedModel("Qwen3-MoE with norm_topk_prob false (router weights not renormalized) is not supported")
    return {"qwen3moe.expert_count": int(config.get("num_experts") or config.get("num_local_experts") or 0),
            "qwen3moe.expert_used_count": int(config.get("num_experts_per_tok") or 0),
            "qwen3moe.expert_feed_forward_length": int(config.get("moe_intermediate_size") or 0)}


FAMILY = Family(name="qwen3moe", gguf_archs=("qwen3moe",), hf_model_types=("qwen3_moe",), read_config=read_config,
                layer_tensors=("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                               "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                forward=dense.forward, step_flags=dense.step_flags, hf_keys=hf_keys)
