"""The `gpt-oss` family (OpenAI gpt-oss): MoE blocks whose attention has sinks and alternates sliding-window and
full layers.

Blocks: x += attn(rms_norm(x)); x += moe(rms_norm(x) by `post_attention_norm`). Attention: biases on q, k, v and
the output, GQA, NeoX RoPE with YaRN scaling (models/config.py: the divisors and attention factor), a sink logit
per head (`attn_sinks`) in every softmax's denominator, a window of `attention.sliding_window` on even layers
(llama.cpp's pattern of 2; a config.json's layer_types where given). MoE: a router with a bias, the softmax
over its top-k logits, experts with biases and the clamped SwiGLU (models/moe.py); `MXFP4_MOE` files store the
experts' matrices in MXFP4. Untied output head.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from engine.errors import ModelLoadError
from engine.kernels.backend import Backend, KVCache, frequency_divisors
from engine.models import dense, moe
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family
from engine.models.weights import Weights

_P = "gpt-oss."


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    f = common_fields(meta, vocab_size)
    window = int(get(meta, _P + "attention.sliding_window", 128))
    sliding = get(meta, _P + "attention.sliding_window_pattern")  # per layer, where a config.json states it
    if sliding is None or len(sliding) != f["n_layer"]:
        sliding = [i % 2 == 0 for i in range(f["n_layer"])]
    n_expert = int(get(meta, _P + "expert_count", required=True))
    used = int(get(meta, _P + "expert_used_count", required=True))
    if not 0 < used <= n_expert:
        raise ModelLoadError(f"{_P}expert_used_count {used} is not in 1..expert_count ({n_expert})")
    f["layer_window"] = tuple(window if s else 0 for s in sliding)
    return ModelConfig(**f, rms_eps=float(get(meta, _P + "attention.layer_norm_rms_epsilon", 1e-5)), rope_style="neox",
                       qkv_bias=True, attn_out_bias=True, attn_sinks=True, act="swiglu_oai", n_expert=n_expert,
                       n_expert_used=used, expert_biases=True,
                       n_ff_expert=int(get(meta, _P + "expert_feed_forward_length", f["n_ff"])))


def forward(cfg: ModelConfig, w: Weights, be: Backend, ids: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run ids (T,) at positions cache.length.. ; append their K/V; final-normed hidden (T, n_embd)."""
    T, pos0, eps = len(ids), cache.length, cfg.rms_eps
    x = be.embed(w.tensor("token_embd"), ids)
    rope = be.rope_tables(np.arange(pos0, pos0 + T), cfg.rope_dim, cfg.rope_base, 1.0, frequency_divisors(cfg, w),
                          cfg.rope_attn_factor)
    for i in range(cfg.n_layer):
        blk = f"blk.{i}."
        x = x + dense.attention(cfg, w, be, be.rms_norm(x, w.vector(blk + "attn_norm"), eps), i, i, cache, rope)
        x = x + moe.feed_forward(cfg, w, be, be.rms_norm(x, w.vector(blk + "post_attention_norm"), eps), blk)
    cache.advance(T)
    return be.rms_norm(x, w.vector("output_norm"), eps)


def hf_keys(config: dict[str, Any]) -> dict[str, Any]:
    kinds = config.get("layer_types") or []
    keys = {_P + "expert_count": int(config["num_local_experts"]),
            _P + "expert_used_count": int(config["num_experts_per_tok"]),
            _P + "expert_feed_forward_length": int(config["intermediate_size"]),
            _P + "attention.sliding_window": int(config.get("sliding_window") or 128)}
    if kinds:
        keys[_P + "attention.sliding_window_pattern"] = [k == "sliding_attention" for k in kinds]
    if float(config.get("swiglu_limit", moe.SWIGLU_LIMIT)) != moe.SWIGLU_LIMIT:
        raise ModelLoadError(f"config.json: swiglu_limit {config['swiglu_limit']} (this engine runs gpt-oss's 7.0)")
    return keys


_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<what>gate_up_proj|down_proj)(?P<bias>_bias)?$")


class ExpertsSplit:
    """A gpt-oss checkpoint's safetensors as the converter sees them: each fused expert tensor (`gate_up_proj`
    (E, n_embd, 2F) with gate and up in alternate columns, `down_proj` (E, F, n_embd), their `_bias`) presented as
    every expert's own matrices and biases in (out, in) order, `experts.3.gate_proj.weight`, which the checkpoint
    reader stacks back into the GGUF's expert tensors."""

    def __init__(self, source):
        self._source = source
        self._virtual: dict[str, tuple[str, int, slice | None, bool]] = {}  # name -> (fused, expert, columns, T)
        self.names = []
        for name in source.names:
            m = _FUSED.match(name)
            if not m:
                self.names.append(name)
                continue
            suffix = ".bias" if m["bias"] else ".weight"
            parts = ((("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))
                     if m["what"] == "gate_up_proj" else (("down_proj", None),))
            for e in range(source.shape(name)[0]):
                for part, cols in parts:
                    virtual = f"{m['prefix']}.{e}.{part}{suffix}"
                    self._virtual[virtual] = (name, e, cols, not m["bias"])
                    self.names.append(virtual)

    def dtype(self, name: str) -> str:
        return self._source.dtype(self._virtual[name][0] if name in self._virtual else name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.array(name).shape if name in self._virtual else self._source.shape(name)

    def array(self, name: str) -> np.ndarray:
        if name not in self._virtual:
            return self._source.array(name)
        fused, e, cols, matrix = self._virtual[name]
        a = self._source.array(fused)[e]
        if cols is not None:
            a = a[..., cols]
        return np.ascontiguousarray(a.T if matrix else a)


FAMILY = Family(name="gpt-oss", gguf_archs=("gpt-oss",), hf_model_types=("gpt_oss",), read_config=read_config,
                layer_tensors=("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_sinks",
                               "post_attention_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                forward=forward, step_flags=dense.step_flags, hf_keys=hf_keys, hf_view=ExpertsSplit,
                hf_aliases=((".self_attn.sinks", ".self_attn.sinks.weight"),))
