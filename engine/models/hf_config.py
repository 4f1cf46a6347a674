"""A Hugging Face config.json read as the GGUF metadata llama.cpp's converter (convert_hf_to_gguf.py) writes
for it, so a safetensors checkpoint is configured by the same family code as its GGUF.

The keys every family shares are mapped here; a family adds its own through `Family.hf_keys` (softcaps,
windows). RoPE scaling becomes what the converter makes of it: `linear` a metadata key, `llama3` the
`rope_freqs` divisors, `longrope` the short and long factor tensors and an attention factor. Both spellings of
the RoPE settings are read: transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.errors import ModelLoadError, UnsupportedModel


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: multimodal checkpoints nest them under `text_config`."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """{rope_type, rope_theta, ...scaling fields} from either spelling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # one set per kind of layer (Gemma 3): the global layers'
    out = dict(params) if isinstance(params, dict) else dict(config.get("rope_scaling") or {})
    out.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    out["rope_type"] = str(out.get("rope_type", out.get("type", "default")) or "default").lower()
    return out


def need(config: dict[str, Any], key: str) -> Any:
    value = config.get(key)
    if value is None:
        raise ModelLoadError(f"config.json lacks {key!r}")
    return value


def gguf_metadata(config: dict[str, Any], arch: str, name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, tensors the converter generates: RoPE factors) for an architecture's config.json."""
    p = arch + "."
    n_embd, n_head = int(need(config, "hidden_size")), int(need(config, "num_attention_heads"))
    head_dim = int(config.get("head_dim") or n_embd // n_head)
    rope = rope_parameters(config)
    rotary = float(config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) or 1.0)
    rope_dim = int(head_dim * rotary)
    meta: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": name,
        p + "context_length": int(config.get("max_position_embeddings") or 2048),
        p + "embedding_length": n_embd,
        p + "block_count": int(need(config, "num_hidden_layers")),
        # an all-MoE model may state only its experts' width
        p + "feed_forward_length": int(config.get("intermediate_size") or need(config, "moe_intermediate_size")),
        p + "attention.head_count": n_head,
        p + "attention.head_count_kv": int(config.get("num_key_value_heads") or n_head),
        p + "attention.key_length": head_dim,
        p + "attention.value_length": head_dim,
        p + "attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        p + "rope.dimension_count": rope_dim,
        p + "rope.freq_base": float(rope["rope_theta"]),
        p + "vocab_size": int(need(config, "vocab_size")),
    }
    tensors: dict[str, np.ndarray] = {}
    kind = rope["rope_type"]
    if kind == "linear":
        meta[p + "rope.scaling.type"] = "linear"
        meta[p + "rope.scaling.factor"] = float(rope.get("factor", 1.0))
    elif kind == "llama3":
        tensors["rope_freqs"] = llama3_divisors(rope, rope_dim)
    elif kind in ("longrope", "su"):
        meta.update(_longrope(config, rope, p, rope_dim, tensors))
    elif kind == "yarn":
        if rope.get("attention_factor") is not None or rope.get("mscale") or not rope.get("truncate", True):
            raise UnsupportedModel("YaRN with its own attention_factor, mscale or truncate false is not supported")
        meta.update({p + "rope.scaling.type": "yarn", p + "rope.scaling.factor": float(rope["factor"]),
                     p + "rope.scaling.original_context_length": int(need(rope, "original_max_position_embeddings")),
                     p + "rope.scaling.yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
                     p + "rope.scaling.yarn_beta_slow": float(rope.get("beta_slow") or 1.0)})
    elif kind == "proportional" and arch == "gemma4":  # its global layers: the family makes the divisors
        pass  # (Family.hf_generated)
    elif kind != "default":
        raise UnsupportedModel(f"RoPE scaling type {kind!r} is not supported yet (supported: default, linear, "
                               f"llama3, longrope, yarn)")
    return meta, tensors


def llama3_divisors(rope: dict[str, Any], rope_dim: int) -> np.ndarray:
    """Llama 3.1's frequency divisors per rotary pair, as the converter computes them: high frequencies kept,
    low ones divided by `factor`, a smooth ramp between the two wavelengths."""
    base, factor = float(rope["rope_theta"]), float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_context = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, rope_dim, 2):
        wavelen = 2 * math.pi * base ** (i / rope_dim)
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _longrope(config: dict[str, Any], rope: dict[str, Any], p: str, rope_dim: int,
              tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    original = int(rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                   or need(config, "max_position_embeddings"))
    scale = int(config.get("max_position_embeddings") or original) / original
    for kind in ("short", "long"):
        factors = rope.get(kind + "_factor")
        if factors is None or len(factors) != rope_dim // 2:
            raise ModelLoadError(f"config.json: LongRoPE {kind}_factor must have {rope_dim // 2} entries")
        tensors[f"rope_factors_{kind}"] = np.asarray(factors, dtype=np.float32)
    return {p + "rope.scaling.original_context_length": original,
            p + "rope.scaling.attn_factor": math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0}
