"""The sparse MoE MLP (Qwen3-MoE, Qwen3.5-MoE, gpt-oss): a router picks each token's top-k experts; their SwiGLU
outputs, weighted by the router's probabilities renormalized over the k, are summed. Expert weights are stacked tensors
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: n_expert matrices one under another). Qwen3.5-MoE adds a
shared expert every token runs (`ffn_*_shexp`), scaled by sigmoid(`ffn_gate_inp_shexp` x); gpt-oss biases on the
router and the experts and a clamped SwiGLU.

Prompts group a tile's (token, expert) pairs by expert, so each chosen expert's weights are read once per tile for
all of its tokens (on the fast path in one compiled call per stacked tensor: Backend.expert_matmul, which groups a
whole chunk at once since its rows do not depend on their group); an expert no token chose is not read at all (a
decoded token reads only its k experts).
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


_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def feed_forward(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, blk: str) -> np.ndarray:
    """The MoE MLP of block `blk` ("blk.3.") over normed h (T, n_embd), one prompt tile at a time: an expert's
    matmul then sees the same rows whatever chunk the tile came in (Backend.prompt_tile), so a reused prompt
    prefix continues with the numbers a cold prefill gets. Where the backend's grouped kernel takes the experts
    (takes_experts: each row computed on its own), the whole chunk goes at once, with the same numbers."""
    tile = be.prompt_tile
    takes = getattr(be, "takes_experts", None)  # a kernel computing each row on its own: any grouping will do
    if len(h) <= tile or (takes is not None and takes([w.tensor(blk + n) for n in _STACKS])):
        return _feed_forward(cfg, w, be, h, blk)
    return np.concatenate([_feed_forward(cfg, w, be, h[t0 : t0 + tile], blk) for t0 in range(0, len(h), tile)])


def _feed_forward(cfg: ModelConfig, w: Weights, be: Backend, h: np.ndarray, blk: str) -> np.ndarray:
    logits = be.matmul(h, w.tensor(blk + "ffn_gate_inp"))
    if cfg.expert_biases:
        logits = logits + w.bias(blk + "ffn_gate_inp")
    chosen, weight = route(logits, cfg.n_expert_used)
    T, k = chosen.shape
    # The (token, slot) pairs grouped by expert, tokens in order within a group.
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, counts = np.unique(flat[order], return_counts=True)
    starts = np.concatenate(([0], np.cumsum(counts)))
    names = [blk + n for n in _STACKS]
    gate, up = _experts(cfg, w, be, h[order // k], experts, starts, names[:2])
    if cfg.expert_biases:
        gate, up = gate + _pair_bias(w, names[0], flat[order], cfg), up + _pair_bias(w, names[1], flat[order], cfg)
    g = clamped_swiglu(gate, up) if cfg.act == "swiglu_oai" else be.act_mul(gate, up, cfg.act)
    (d,) = _experts(cfg, w, be, g, experts, starts, names[2:])
    if cfg.expert_biases:
        d += _pair_bias(w, names[2], flat[order], cfg)
    d *= weight.reshape(-1)[order][:, None]
    # Each token's k results added in ascending expert order (as a loop over the experts adds them).
    at = np.empty(T * k, np.int64)
    at[order] = np.arange(T * k)
    by_expert = np.take_along_axis(at.reshape(T, k), np.argsort(chosen, axis=1, kind="stable"), axis=1)
    out = np.zeros_like(h)
    for j in range(k):
        out += d[by_expert[:, j]]
    if cfg.n_ff_shared:  # the shared expert, every token, scaled by its own sigmoid gate (Qwen3.5-MoE)
        gate, up = be.matmul_many(h, [w.tensor(blk + "ffn_gate_shexp"), w.tensor(blk + "ffn_up_shexp")])
        shared = be.matmul(be.act_mul(gate, up, cfg.act), w.tensor(blk + "ffn_down_shexp"))
        out += shared / (np.float32(1) + np.exp(-be.matmul(h, w.tensor(blk + "ffn_gate_inp_shexp"))))
    return out


def _experts(cfg: ModelConfig, w: Weights, be: Backend, x: np.ndarray, experts: np.ndarray, starts: np.ndarray,
             names: list[str]) -> list[np.ndarray]:
    """Each row of x times its group's expert's matrix of every stacked tensor named (group i: rows
    starts[i]..starts[i+1], expert experts[i]): in one call per tensor where the backend has one, else expert by
    expert."""
    grouped = getattr(be, "expert_matmul", None)
    if grouped is not None:
        got = grouped(x, experts, starts, [w.tensor(n) for n in names], cfg.n_expert)
        if got is not None:
            return got
    outs = [np.empty((len(x), w.tensor(n).rows // cfg.n_expert), np.float32) for n in names]
    for i, e in enumerate(experts.tolist()):
        rows = slice(starts[i], starts[i + 1])
        for out, part in zip(outs, be.matmul_many(x[rows], [w.expert(n, e, cfg.n_expert) for n in names])):
            out[rows] = part
    return outs


def _pair_bias(w: Weights, name: str, experts: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Each pair's expert's bias of a stacked tensor (gpt-oss), (pairs, rows per expert)."""
    return w.bias(name).reshape(cfg.n_expert, -1)[experts]


SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # gpt-oss's (llama.cpp fixes them too)


def clamped_swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's activation: (clip(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)."""
    g = np.minimum(gate, np.float32(SWIGLU_LIMIT))
    u = np.clip(up, np.float32(-SWIGLU_LIMIT), np.float32(SWIGLU_LIMIT))
    return (u + np.float32(1)) * g / (np.float32(1) + np.exp(np.float32(-SWIGLU_ALPHA) * g))
