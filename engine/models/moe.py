"""The sparse MoE MLP (Qwen3-MoE): a router picks each token's top-k experts; their SwiGLU outputs, weighted
by the router's probabilities renormalized over the k, are summed. Expert weights are stacked tensors
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: n_expert matrices one under another).

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
    """The MoE MLP of block `blk` ("blk.3.") over normed h (T, n_embd)."""
    chosen, weight = route(be.matmul(h, w.tensor(blk + "ffn_gate_inp")), cfg.n_expert_used)
    out = np.zeros_like(h)
    for e in np.unique(chosen):
        rows, slot = np.nonzero(chosen == e)  # the tokens that chose e, and where in their k
        x = h[rows]
        gate, up = be.matmul_many(x, [w.expert(blk + "ffn_gate_exps", e, cfg.n_expert),
                                      w.expert(blk + "ffn_up_exps", e, cfg.n_expert)])
        d = be.matmul(be.act_mul(gate, up, cfg.act), w.expert(blk + "ffn_down_exps", e, cfg.n_expert))
        out[rows] += weight[rows, slot][:, None] * d
    return out
