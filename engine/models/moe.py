"""The sparse MoE MLP (Qwen3-MoE, Qwen3.5-MoE, gpt-oss): a router picks each token's top-k experts; their SwiGLU
outputs, weighted by the router's probabilities renormalized over the k, are summed. Expert weights are stacked tensors
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: n_expert matrices one under another). Qwen3.5-MoE adds a
shared expert every token runs (`ffn_*_shexp`), scaled by sigmoid(`ffn_gate_inp_shexp` x); gpt-oss biases on the
router and the experts and a clamped SwiGLU.

Prompts group tokens by expert, so each chosen expert's weights are read once per chunk for all of its tokens;
an expert no token chose is not read at all (a decoded token reads only its k experts).
"""

from __future__ import annotations

import numpy as np

from engine.kernels.backend import Backend
from engine.models.config import ModelConfig
from engine.models.weights import Weights


def route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, E) router logits -> the k chosen experts per token (T, k) and their weights (T, k), softmax over all
    experts renormalized over the chosen (which is the softmax over the chosen logits). Ties go to the lower id."""
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, chosen, axis=1).astype(np.float64)
    p = np.exp(top - top[:, :1])
    return chosen, (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


def feed_forward(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, blk: str) -> np.ndarray:
    """The MoE MLP of block `blk` ("blk.3.") over normed h (T, n_embd), one prompt tile at a time: an expert's
    matmul then sees the same rows whatever chunk the tile came in (Backend.prompt_tile), so a reused prompt
    prefix continues with the numbers a cold prefill gets."""
    tile = be.prompt_tile
    if len(h) <= tile:
        return _feed_forward(cfg, w, be, h, blk)
    return np.concatenate([_feed_forward(cfg, w, be, h[t0 : t0 + tile], blk) for t0 in range(0, len(h), tile)])


def _feed_forward(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, blk: str) -> np.ndarray:
    logits = be.matmul(h, w.tensor(blk + "ffn_gate_inp"))
    if cfg.expert_biases:
        logits = logits + w.bias(blk + "ffn_gate_inp")
    chosen, weight = route(logits, cfg.n_expert_used)
    out = np.zeros_like(h)
    names = [blk + n for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    for e in np.unique(chosen):
        rows, slot = np.nonzero(chosen == e)  # the tokens that chose e, and where in their k
        x = h[rows]
        gate, up = be.matmul_many(x, [w.expert(names[0], e, cfg.n_expert), w.expert(names[1], e, cfg.n_expert)])
        if cfg.expert_biases:
            gate, up = gate + _expert_bias(w, names[0], e, cfg), up + _expert_bias(w, names[1], e, cfg)
        g = clamped_swiglu(gate, up) if cfg.act == "swiglu_oai" else be.act_mul(gate, up, cfg.act)
        d = be.matmul(g, w.expert(names[2], e, cfg.n_expert))
        if cfg.expert_biases:
            d += _expert_bias(w, names[2], e, cfg)
        out[rows] += weight[rows, slot][:, None] * d
    if cfg.n_ff_shared:  # the shared expert, every token, scaled by its own sigmoid gate (Qwen3.5-MoE)
        gate, up = be.matmul_many(h, [w.tensor(blk + "ffn_gate_shexp"), w.tensor(blk + "ffn_up_shexp")])
        shared = be.matmul(be.act_mul(gate, up, cfg.act), w.tensor(blk + "ffn_down_shexp"))
        out += shared / (np.float32(1) + np.exp(-be.matmul(h, w.tensor(blk + "ffn_gate_inp_shexp"))))
    return out


def _expert_bias(w: Weights, name: str, e: int, cfg: ModelConfig) -> np.ndarray:
    return w.bias(name).reshape(cfg.n_expert, -1)[e]


SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # gpt-oss's (llama.cpp fixes them too)


def clamped_swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's activation: (clip(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)."""
    g = np.minimum(gate, np.float32(SWIGLU_LIMIT))
    u = np.clip(up, np.float32(-SWIGLU_LIMIT), np.float32(SWIGLU_LIMIT))
    return (u + np.float32(1)) * g / (np.float32(1) + np.exp(np.float32(-SWIGLU_ALPHA) * g))
