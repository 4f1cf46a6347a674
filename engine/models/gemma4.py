"""The `gemma4` family (the text part of Gemma 4): Gemma's four norms per block (weights used as stored), GeGLU,
embeddings scaled by sqrt(n_embd), final-logit softcap, tied embeddings, and its own particulars:

- QK-norm and an unweighted V-norm, attention scale 1 (the norms set it);
- sliding layers (`attention.sliding_window_pattern`) with their own head width (`key_length_swa`), RoPE base
  (`freq_base_swa`) and rotary dims; global layers with `rope_freqs` divisors (proportional RoPE: the unrotated
  pairs divided by 1e30);
- KV-head count and MLP width per layer where the metadata gives arrays;
- KV sharing: the last `attention.shared_kv_layers` layers compute only queries and attend to the keys and
  values of the last earlier layer of the same kind;
- per-layer embeddings (PLE, `embedding_length_per_layer_input` = P > 0): per layer a P-slice of
  (per_layer_token_embd[id] * sqrt(P) + rms_norm(per_layer_model_proj(x0) / sqrt(n_embd))) / sqrt(2) feeds
  x += post_norm(proj(gelu(inp_gate x) * slice)) after the block's MLP;
- `layer_output_scale` multiplies the block's output (the whole residual stream).

The cache keeps keys and values for the layers that compute them, widened to the widest head with zeros and
with each KV head repeated to the most KV heads: the compiled decode step's layout (kernels/cpu/gemma4_step.py),
whose attention kernels then run unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.errors import ModelLoadError
from engine.kernels.backend import Backend, KVCache
from engine.models import dense
from engine.models.config import ModelConfig, common_fields, get
from engine.models.family import Family
from engine.models.weights import Weights

_P = "gemma4."


def _per_layer(meta: dict[str, Any], key: str, n_layer: int, default: Any) -> tuple:
    v = get(meta, _P + key, default)
    if isinstance(v, (list, tuple, np.ndarray)):
        if len(v) != n_layer:
            raise ModelLoadError(f"{_P}{key} has {len(v)} entries for {n_layer} layers")
        return tuple(v)
    return (v,) * n_layer


def read_config(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    n_layer = int(get(meta, _P + "block_count", required=True))
    kv = tuple(int(k) for k in _per_layer(meta, "attention.head_count_kv", n_layer, None))
    ff = tuple(int(f) for f in _per_layer(meta, "feed_forward_length", n_layer, None))
    f = common_fields({**meta, _P + "attention.head_count_kv": max(kv), _P + "feed_forward_length": max(ff)},
                      vocab_size)
    if any(max(kv) % k for k in kv) or f["n_head"] % max(kv):  # (KV heads repeat to the most: gemma4_step.py)
        raise ModelLoadError(f"gemma4: KV heads per layer {kv} must divide each other and the {f['n_head']} heads")
    sliding = tuple(bool(s) for s in _per_layer(meta, "attention.sliding_window_pattern", n_layer, False))
    d_global = int(get(meta, _P + "attention.key_length", f["head_dim"]))
    d_swa = int(get(meta, _P + "attention.key_length_swa", d_global))
    window = int(get(meta, _P + "attention.sliding_window", 512))
    shared = int(get(meta, _P + "attention.shared_kv_layers", 0))
    source = []  # the layer whose keys and values each layer attends to
    for i in range(n_layer):
        if i < n_layer - shared:
            source.append(i)
        else:
            earlier = [j for j in range(n_layer - shared) if sliding[j] == sliding[i]]
            if not earlier:
                raise ModelLoadError(f"gemma4: shared layer {i} has no earlier layer of its kind to share with")
            source.append(earlier[-1])
    f.update(head_dim=max(d_global, d_swa), layer_window=tuple(window if s else 0 for s in sliding),
             layer_rope_base=tuple(float(get(meta, _P + "rope.freq_base_swa", 10000.0)) if s else f["rope_base"]
                                   for s in sliding),
             attn_scale=1.0, embed_scale=math.sqrt(f["n_embd"]))
    return ModelConfig(**f, rms_eps=float(get(meta, _P + "attention.layer_norm_rms_epsilon", 1e-6)),
                       rope_style="neox", qk_norm=True, post_norms=True, act="gelu_tanh",
                       final_logit_softcap=float(get(meta, _P + "final_logit_softcapping", 0.0) or 0.0),
                       layer_head_dim=tuple(d_swa if s else d_global for s in sliding), layer_kv_heads=kv,
                       layer_ff=ff, layer_kv_source=tuple(source),
                       layer_rope_dim=tuple(int(get(meta, _P + "rope.dimension_count_swa", d_swa)) if s else
                                            int(get(meta, _P + "rope.dimension_count", d_global)) for s in sliding),
                       per_layer_embd=int(get(meta, _P + "embedding_length_per_layer_input", 0)))


def block_tensors(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    names = ("attn_norm", "attn_q", "attn_q_norm", "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate",
             "ffn_up", "ffn_down", "post_ffw_norm", "layer_output_scale")
    if cfg.layer_kv_source[layer] == layer:
        names += ("attn_k", "attn_k_norm")  # attn_v: absent where keys are the values
    return names + (("inp_gate", "proj", "post_norm") if cfg.per_layer_embd else ())


def _per_layer_inputs(cfg: ModelConfig, w: Weights, be: Backend, ids: np.ndarray, x0: np.ndarray) -> np.ndarray:
    """(T, n_layer, P): each layer's slice of the per-layer embeddings."""
    T, L, P = len(ids), cfg.n_layer, cfg.per_layer_embd
    token = be.embed(w.tensor("per_layer_token_embd"), ids).reshape(T, L, P) * np.float32(math.sqrt(P))
    proj = be.matmul(x0, w.tensor("per_layer_model_proj")).reshape(T, L, P) * np.float32(1 / math.sqrt(cfg.n_embd))
    proj = be.rms_norm(proj, w.vector("per_layer_proj_norm"), cfg.rms_eps)
    return (proj + token) * np.float32(1 / math.sqrt(2))


def _attention(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, i: int, cache: KVCache, rope) -> np.ndarray:
    T, pos0, eps = len(h), cache.length, cfg.rms_eps
    H, D, Hkv = cfg.n_head, cfg.layer_head_dim[i], cfg.layer_kv_heads[i]
    blk, slot = f"blk.{i}.", cfg.kv_slot[i]
    cos, sin = rope
    q = be.rms_norm(be.matmul(h, w.tensor(blk + "attn_q")).reshape(T, H, D), w.vector(blk + "attn_q_norm"), eps)
    q = be.rope(q, cos, sin, "neox")
    if cfg.layer_kv_source[i] == i:
        k = be.matmul(h, w.tensor(blk + "attn_k")).reshape(T, Hkv, D)
        v = be.matmul(h, w.tensor(blk + "attn_v")).reshape(T, Hkv, D) if w.has(blk + "attn_v") else k  # K = V
        v = be.rms_norm(v, np.ones(D, np.float32), eps)  # the V-norm has no weights
        k = be.rope(be.rms_norm(k, w.vector(blk + "attn_k_norm"), eps), cos, sin, "neox")
        # the cache's layout (the compiled step's, kernels/cpu/gemma4_step.py): heads widened with zeros to the
        # widest, each KV head repeated to the most KV heads
        wide = [np.zeros((T, cfg.n_head_kv, cfg.head_dim), np.float32) for _ in range(2)]
        wide[0][:, :, :D] = np.repeat(k, cfg.n_head_kv // Hkv, axis=1)
        wide[1][:, :, :D] = np.repeat(v, cfg.n_head_kv // Hkv, axis=1)
        keys, values = cache.write(slot, *wide)
    else:  # a shared layer: the keys and values its source wrote in this same pass
        keys, values = cache.keys(slot, pos0 + T), cache.values(slot, pos0 + T)
    keys, values = keys[:, :: cfg.n_head_kv // Hkv, :D], values[:, :: cfg.n_head_kv // Hkv, :D]
    a = be.attention(q, np.ascontiguousarray(keys), np.ascontiguousarray(values), pos0, cfg.attn_scale,
                     window=cfg.layer_window[i]).reshape(T, H * D)
    return be.matmul(a, w.tensor(blk + "attn_output"))


def forward(cfg: ModelConfig, w: Weights, be: Backend, ids: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run ids (T,) at positions cache.length..; final-normed hidden (T, n_embd)."""
    T, pos0, eps = len(ids), cache.length, cfg.rms_eps
    x = be.embed(w.tensor("token_embd"), ids) * np.float32(cfg.embed_scale)
    ple = _per_layer_inputs(cfg, w, be, ids, x) if cfg.per_layer_embd else None
    positions = np.arange(pos0, pos0 + T)
    divisors = w.optional_vector("rope_freqs")
    tables = {}
    for i in range(cfg.n_layer):
        key = (cfg.layer_rope_base[i], cfg.layer_rope_dim[i], cfg.layer_window[i] == 0)
        if key not in tables:  # global layers divide their frequencies by rope_freqs (proportional RoPE)
            tables[key] = be.rope_tables(positions, key[1], key[0], 1.0, divisors if key[2] else None)
    for i in range(cfg.n_layer):
        blk = f"blk.{i}."
        h = be.rms_norm(x, w.vector(blk + "attn_norm"), eps)
        o = _attention(cfg, w, be, h, i, cache, tables[(cfg.layer_rope_base[i], cfg.layer_rope_dim[i],
                                                        cfg.layer_window[i] == 0)])
        x = x + be.rms_norm(o, w.vector(blk + "post_attention_norm"), eps)
        h = be.rms_norm(x, w.vector(blk + "ffn_norm"), eps)
        g = be.act_mul(*be.matmul_many(h, [w.tensor(blk + "ffn_gate"), w.tensor(blk + "ffn_up")]), cfg.act)
        x = x + be.rms_norm(be.matmul(g, w.tensor(blk + "ffn_down")), w.vector(blk + "post_ffw_norm"), eps)
        if ple is not None:
            gate = be.matmul(x, w.tensor(blk + "inp_gate"))
            p = be.act_mul(gate, np.ascontiguousarray(ple[:, i]), cfg.act)
            x = x + be.rms_norm(be.matmul(p, w.tensor(blk + "proj")), w.vector(blk + "post_norm"), eps)
        x = x * w.vector(blk + "layer_output_scale")[0]
    cache.advance(T)
    return be.rms_norm(x, w.vector("output_norm"), eps)


def _layer(config: dict[str, Any], i: int, key: str) -> Any:
    """A layer's value of a field: its per_layer_config override, else the shared one."""
    per = (config.get("per_layer_config") or {}).get(str(i)) or (config.get("per_layer_config") or {}).get(i) or {}
    return per.get(key, config.get(key))


def hf_keys(config: dict[str, Any]) -> dict[str, Any]:
    n = int(config["num_hidden_layers"])
    kinds = config.get("layer_types") or []
    if len(kinds) != n:
        raise ModelLoadError("config.json: gemma4 needs layer_types for every layer")
    if config.get("enable_moe_block"):
        raise ModelLoadError("config.json: Gemma 4 MoE (enable_moe_block) is not supported yet")
    sliding = [k == "sliding_attention" for k in kinds]
    shared = int(config.get("num_kv_shared_layers") or 0)
    d = [int(_layer(config, i, "head_dim")) for i in range(n)]
    d_swa = next((d[i] for i in range(n) if sliding[i]), d[0])
    d_global = next((d[i] for i in range(n) if not sliding[i]), d[0])
    ff = int(config["intermediate_size"])
    double = bool(config.get("use_double_wide_mlp"))
    rope = config.get("rope_parameters") or {}
    return {_P + "attention.sliding_window_pattern": sliding,
            _P + "attention.sliding_window": int(config["sliding_window"]),
            _P + "attention.key_length": d_global, _P + "attention.value_length": d_global,
            _P + "attention.key_length_swa": d_swa, _P + "attention.value_length_swa": d_swa,
            _P + "attention.head_count_kv": [int(_layer(config, i, "num_key_value_heads")) for i in range(n)],
            _P + "feed_forward_length": [ff * (2 if double and i >= n - shared else 1) for i in range(n)],
            _P + "attention.shared_kv_layers": shared,
            _P + "embedding_length_per_layer_input": int(config.get("hidden_size_per_layer_input") or 0),
            _P + "final_logit_softcapping": float(config.get("final_logit_softcapping") or 0.0),
            _P + "rope.freq_base": float(rope.get("full_attention", {}).get("rope_theta", 1e6)),
            _P + "rope.freq_base_swa": float(rope.get("sliding_attention", {}).get("rope_theta", 1e4)),
            _P + "rope.dimension_count": d_global, _P + "rope.dimension_count_swa": d_swa}


def hf_generated(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """`rope_freqs`: the global layers' proportional RoPE as divisors (1 on the rotated pairs, 1e30 on the rest)."""
    full = (config.get("rope_parameters") or {}).get("full_attention", {})
    n = int(config["num_hidden_layers"])
    kinds = config.get("layer_types") or []
    d_global = next((int(_layer(config, i, "head_dim")) for i in range(n) if kinds[i] != "sliding_attention"), 0)
    pairs = d_global // 2
    rotated = int(pairs * float(full.get("partial_rotary_factor", 1.0)))
    return {"rope_freqs": np.array([1.0] * rotated + [1e30] * (pairs - rotated), np.float32)}


def step_flags(cfg: ModelConfig) -> dict:
    """The compiled step's flags: the dense ones (QK-norm, post norms, GELU), per-layer embeddings, KV sharing."""
    return {**dense.step_flags(cfg), "per_layer_embd": bool(cfg.per_layer_embd), "kv_source": cfg.layer_kv_source}


FAMILY = Family(name="gemma4", gguf_archs=("gemma4",), hf_model_types=("gemma4_text",), read_config=read_config,
                layer_tensors=(), forward=forward, step_flags=step_flags, block_tensors=block_tensors, hf_keys=hf_keys,
                hf_generated=hf_generated, hf_aliases=((".layer_scalar", ".layer_scalar.weight"),))
