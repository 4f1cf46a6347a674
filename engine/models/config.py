"""ModelConfig: what a model's forward pass needs to know, read from GGUF metadata.

Variations between families (norm placement, QK-norm, q/k/v biases, sliding windows, RoPE style and scaling,
the activation) are fields here, read from the file where it states them and defaulted per family where it
does not (docs/models.md: "Facts the GGUF files do not state"). Each family's file reads its own
(`read_config`) from the fields every family shares (`common_fields`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from engine.errors import ModelLoadError, UnsupportedModel


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0  # positions are divided by it (linear); YaRN's factor lives in rope_divisors
    original_context: int = 0


@dataclass(frozen=True)
class DeltaNetShape:
    """The gated DeltaNet layers of a hybrid (Qwen3.5, models/deltanet.py): a short causal convolution over
    q|k|v, then a delta-rule recurrent state of (head_k_dim, head_v_dim) per value head. Value head h reads key
    head h % k_heads (GGUF order: the converter reorders Hugging Face's value heads to make it so)."""

    conv_kernel: int
    k_heads: int
    v_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def conv_channels(self) -> int:  # q, k, v side by side
        return 2 * self.k_heads * self.head_k_dim + self.v_heads * self.head_v_dim


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
    layer_rope_scale: tuple[float, ...] = ()  # per layer linear RoPE factor (Gemma 3: the global layers only)
    attn_scale: float = 1.0
    embed_scale: float = 1.0
    final_logit_softcap: float = 0.0
    attn_softcap: float = 0.0  # attention scores capped to c tanh(s / c) (Gemma 2); 0: none
    rope_factors: str = "rope_freqs"  # the tensor of RoPE frequency divisors, where the file has one
    rope_attn_factor: float = 1.0  # cos and sin multiplied by it (LongRoPE's attention factor, YaRN's mscale)
    rope_divisors: tuple[float, ...] = ()  # frequency divisors the config implies (YaRN), in place of rope_factors
    # A longer window the model reaches with other RoPE divisors (LongRoPE's long factors), chosen at load for
    # the whole model as llama.cpp does when the context asked for exceeds context_length (with_context).
    long_context: int = 0
    long_rope_factors: str = ""
    # Block shape: per-head RMSNorm on q and k before RoPE; biases on q, k, v; a norm after attention and after
    # the MLP (Gemma); the gate's activation ("silu" or "gelu_tanh").
    qk_norm: bool = False
    qkv_bias: bool = False
    fused_qkv: bool = False  # one attn_qkv matrix (q rows, then k, then v) instead of three
    fused_gate_up: bool = False  # ffn_up holds the gate's rows, then the up's (no ffn_gate)
    post_norms: bool = False
    act: str = "silu"
    # Sparse MoE MLPs (models/moe.py): experts per layer, experts per token, each expert's hidden width
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_expert: int = 0
    n_ff_shared: int = 0  # a shared expert every token runs beside the routed ones (Qwen3.5-MoE); 0: none
    expert_biases: bool = False  # router and experts' matrices have biases (gpt-oss)
    # gpt-oss: attention sinks (a logit per head in the softmax's denominator), a bias on the attention output
    attn_sinks: bool = False
    attn_out_bias: bool = False
    # Hybrids: per layer, True where a recurrent layer replaces attention: a gated DeltaNet (Qwen3.5; its shape;
    # the attention layers gate their output per head by sigmoid(a second half of each q head's rows)) or a
    # gated short convolution of shortconv_kernel taps (LFM2, models/lfm2.py).
    layer_recurrent: tuple[bool, ...] = ()
    deltanet: DeltaNetShape | None = None
    attn_output_gate: bool = False
    shortconv_kernel: int = 0
    # Layers that differ in shape (Gemma 4): per layer its head width, KV heads, MLP width, rotary dims, and the
    # layer whose keys and values it attends to (itself, or an earlier one it shares them with); its embeddings
    # per layer (PLE) of this width (0: none). Empty: every layer as the shared fields say.
    layer_head_dim: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_ff: tuple[int, ...] = ()
    layer_rope_dim: tuple[int, ...] = ()
    layer_kv_source: tuple[int, ...] = ()
    per_layer_embd: int = 0

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values (all of them but a hybrid's recurrent ones and the layers that
        share an earlier one's), in cache order."""
        return tuple(i for i in range(self.n_layer) if not (self.layer_recurrent and self.layer_recurrent[i])
                     and not (self.layer_kv_source and self.layer_kv_source[i] != i))

    @property
    def kv_slot(self) -> dict[int, int]:
        """Layer -> the cache slot it attends to (its own; a sharing layer's: its source's)."""
        own = {layer: n for n, layer in enumerate(self.kv_layers)}
        return {i: own[self.layer_kv_source[i] if self.layer_kv_source else i] for i in range(self.n_layer)
                if (self.layer_kv_source[i] if self.layer_kv_source else i) in own}

    @property
    def state_row(self) -> dict[int, int]:
        """Recurrent layer -> its row of the cache's recurrent state arrays."""
        return {layer: n for n, layer in enumerate(i for i in range(self.n_layer)
                                                    if self.layer_recurrent and self.layer_recurrent[i])}

    @property
    def state_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The recurrent state a sequence carries beside its KV cache, as (name, shape) f32 arrays: a hybrid's
        convolution inputs (the last kernel - 1 of them) and delta-rule state, one row per recurrent layer."""
        s, n = self.deltanet, sum(self.layer_recurrent)
        if self.shortconv_kernel:
            return (("conv", (n, self.shortconv_kernel - 1, self.n_embd)),)
        if s is None:
            return ()
        return (("conv", (n, s.conv_kernel - 1, s.conv_channels)), ("ssm", (n, s.v_heads, s.head_k_dim, s.head_v_dim)))


def get(meta: dict[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    if key in meta:
        return meta[key]
    if required:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return default


def common_fields(meta: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The fields every family reads the same way (`{arch}.` keys), as ModelConfig keyword arguments; a family
    adds its own (rms_eps, rope_style, windows, ...)."""
    arch = str(meta.get("general.architecture", ""))
    p = arch + "."
    n_embd = int(get(meta, p + "embedding_length", required=True))
    n_layer = int(get(meta, p + "block_count", required=True))
    n_head = int(get(meta, p + "attention.head_count", required=True))
    head_dim = int(get(meta, p + "attention.key_length", n_embd // n_head))
    rope_base = float(get(meta, p + "rope.freq_base", 10000.0))
    scaling_kind = str(get(meta, p + "rope.scaling.type", "none"))
    if scaling_kind not in ("none", "linear", "yarn"):
        raise UnsupportedModel(f"RoPE scaling type {scaling_kind!r} is not supported (supported: none, linear, yarn)")
    factor = float(get(meta, p + "rope.scaling.factor", 1.0) or 1.0)
    original = int(get(meta, p + "rope.scaling.original_context_length", 0))
    rope_dim = int(get(meta, p + "rope.dimension_count", head_dim))
    yarn = {}
    if scaling_kind == "yarn" and factor > 1:
        if not original:
            raise ModelLoadError(f"{p}rope.scaling.original_context_length is needed for YaRN")
        yarn = dict(rope_divisors=yarn_divisors(rope_base, rope_dim, factor, original,
                                                float(get(meta, p + "rope.scaling.yarn_beta_fast", 32.0)),
                                                float(get(meta, p + "rope.scaling.yarn_beta_slow", 1.0))),
                    rope_attn_factor=0.1 * math.log(factor) + 1.0)
    scaling = RopeScaling(kind=scaling_kind, factor=1.0 if scaling_kind == "yarn" else factor,
                          original_context=original)
    return dict(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=int(get(meta, p + "feed_forward_length", required=True)),
        n_head=n_head,
        n_head_kv=int(get(meta, p + "attention.head_count_kv", n_head)),
        head_dim=head_dim,
        context_length=int(get(meta, p + "context_length", 2048)),
        vocab_size=vocab_size,
        rope_base=rope_base,
        rope_dim=rope_dim,
        rope_scaling=scaling,
        layer_window=(0,) * n_layer,
        layer_rope_base=(rope_base,) * n_layer,
        layer_rope_scale=(scaling.factor,) * n_layer,
        attn_scale=1.0 / math.sqrt(head_dim),
        **yarn,
    )


def yarn_divisors(base: float, rope_dim: int, factor: float, original: int, beta_fast: float,
                  beta_slow: float) -> tuple[float, ...]:
    """YaRN as frequency divisors: pairs that turn more than beta_fast times over the original window keep
    their frequency, those under beta_slow times are divided by factor, a linear ramp between; the ramp's ends
    rounded out to whole pairs (floor, ceil) as llama.cpp and transformers do."""
    def pair_at(turns: float) -> float:  # the (fractional) pair index whose wavelength fits `turns` in the window
        return rope_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(pair_at(beta_fast)), 0), min(math.ceil(pair_at(beta_slow)), rope_dim - 1)
    out = []
    for i in range(rope_dim // 2):
        keep = 1.0 - min(1.0, max(0.0, (i - lo) / max(hi - lo, 0.001)))  # 1: extrapolate, 0: interpolate
        out.append(1.0 / ((1.0 - keep) / factor + keep))
    return tuple(out)


def with_context(cfg: ModelConfig, context: int | None, has_tensor) -> ModelConfig:
    """The configuration for a context window of `context` tokens: past context_length, the long RoPE divisors
    where the model has them (has_tensor(name)), and the window grown up to long_context; else unchanged
    (callers cap their windows at context_length)."""
    if not context or context <= cfg.context_length or not cfg.long_context or not has_tensor(cfg.long_rope_factors):
        return cfg
    return replace(cfg, context_length=min(int(context), cfg.long_context), rope_factors=cfg.long_rope_factors)
