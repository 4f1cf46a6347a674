"""Model configuration read from GGUF metadata, with the facts llama.cpp hard-codes per architecture.

Variations between families (norm placement, QK-norm, sliding windows, RoPE style and scaling) are
fields here, read from the file where it states them and defaulted per architecture where it does not
(see ../shared/MODELS.md: "facts the GGUF files do not state").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ModelLoadError, UnsupportedModel

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | yarn (yarn refused for now)
    factor: float = 1.0
    original_context: int = 0


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    context_length: int
    vocab_size: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_style: str  # "interleaved": adjacent pairs (llama GGUF); "neox": first/second half
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Sliding-window attention: per-layer window (0 = global) and RoPE base.
    layer_window: tuple[int, ...] = ()
    layer_rope_base: tuple[float, ...] = ()
    attn_scale: float = 1.0
    embed_scale: float = 1.0
    final_logit_softcap: float = 0.0


def _get(meta: dict[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    if key in meta:
        return meta[key]
    if required:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return default


def config_from_gguf(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"architecture {arch or '(none)'!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    p = arch + "."
    n_embd = int(_get(meta, p + "embedding_length", required=True))
    n_layer = int(_get(meta, p + "block_count", required=True))
    n_head = int(_get(meta, p + "attention.head_count", required=True))
    n_head_kv = int(_get(meta, p + "attention.head_count_kv", n_head))
    head_dim = int(_get(meta, p + "attention.key_length", n_embd // n_head))
    rope_base = float(_get(meta, p + "rope.freq_base", 10000.0))
    scaling_kind = str(_get(meta, p + "rope.scaling.type", "none"))
    if scaling_kind not in ("none", "linear"):
        raise UnsupportedModel(f"RoPE scaling type {scaling_kind!r} is not supported yet (supported: none, linear)")
    scaling = RopeScaling(
        kind=scaling_kind,
        factor=float(_get(meta, p + "rope.scaling.factor", 1.0) or 1.0),
        original_context=int(_get(meta, p + "rope.scaling.original_context_length", 0)),
    )
    common = dict(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=int(_get(meta, p + "feed_forward_length", required=True)),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        context_length=int(_get(meta, p + "context_length", 2048)),
        vocab_size=vocab_size,
        rope_base=rope_base,
        rope_dim=int(_get(meta, p + "rope.dimension_count", head_dim)),
        rope_scaling=scaling,
    )
    if arch == "llama":
        return ModelConfig(
            **common,
            rms_eps=float(_get(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
            # llama.cpp's converter permutes Q/K rows for adjacent-pair ("normal") RoPE.
            rope_style="interleaved",
            layer_window=(0,) * n_layer,
            layer_rope_base=(rope_base,) * n_layer,
            attn_scale=1.0 / math.sqrt(head_dim),
        )
    # gemma3: every 6th layer is global (full attention, the file's rope base); the others use a
    # sliding window and RoPE base 10000 (llama.cpp hard-codes both; MODELS.md).
    window = int(_get(meta, p + "attention.sliding_window", 512))
    is_global = [(i + 1) % 6 == 0 for i in range(n_layer)]
    return ModelConfig(
        **common,
        rms_eps=float(_get(meta, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_style="neox",
        layer_window=tuple(0 if g else window for g in is_global),
        layer_rope_base=tuple(rope_base if g else 10000.0 for g in is_global),
        attn_scale=1.0 / math.sqrt(head_dim),  # query_pre_attn_scalar = head_dim
        embed_scale=math.sqrt(n_embd),
        final_logit_softcap=float(_get(meta, p + "final_logit_softcapping", 0.0) or 0.0),
    )
