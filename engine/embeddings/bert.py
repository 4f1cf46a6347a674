"""The BERT encoder (sentence-transformers checkpoints such as all-MiniLM-L6-v2): a padded batch of token ids in,
the last layer's hidden states out.

    embeddings  word + absolute position + token type (0), then LayerNorm
    each layer  self-attention over the unmasked keys (no causal mask), output projection, residual, LayerNorm;
                GELU (exact, erf) feed-forward, residual, LayerNorm (post-LN, as BERT is)

f32 throughout: the matrices are BLAS sgemm calls over the whole batch (rows = batch x tokens), attention a
batched matmul per layer; the elementwise work between them (GELU, residual + LayerNorm, the masked softmax) is
compiled (encoder_ops.py). A padded key weighs 0 in the softmax, as transformers' additive mask of f32's
smallest value makes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.embeddings.encoder_ops import gelu_inplace, masked_softmax_inplace, residual_layer_norm
from engine.errors import ModelLoadError, UnsupportedModel

__all__ = ["BertConfig", "BertEncoder"]


@dataclass(frozen=True)
class BertConfig:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    positions: int  # max_position_embeddings
    eps: float

    @classmethod
    def of(cls, config: dict) -> BertConfig:
        """From a Hugging Face config.json (BertModel and its relatives)."""
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModel(f"BERT position_embedding_type {config['position_embedding_type']!r} is not "
                                   "supported (only absolute)")
        if config.get("hidden_act", "gelu") != "gelu":
            raise UnsupportedModel(f"BERT hidden_act {config['hidden_act']!r} is not supported (only gelu)")
        try:
            c = cls(int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["num_attention_heads"]),
                    int(config["intermediate_size"]), int(config["vocab_size"]),
                    int(config.get("max_position_embeddings", 512)), float(config.get("layer_norm_eps", 1e-12)))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json: not a BERT configuration ({e})") from None
        if c.hidden % c.heads:
            raise ModelLoadError(f"config.json: hidden_size {c.hidden} is not a multiple of {c.heads} heads")
        return c


class BertEncoder:
    """The encoder's weights (f32) and its forward pass. `weights(name)` gives a tensor by its Hugging Face name
    without the model prefix ("embeddings.word_embeddings.weight", "encoder.layer.0...")."""

    def __init__(self, config: BertConfig, weights):
        self.config = config
        w = weights
        self.word = w("embeddings.word_embeddings.weight")
        self.position = w("embeddings.position_embeddings.weight")
        self.token_type = w("embeddings.token_type_embeddings.weight")
        self.embed_norm = (w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(config.layers):
            p = f"encoder.layer.{i}."
            qkv = np.concatenate([w(p + f"attention.self.{n}.weight") for n in ("query", "key", "value")])
            qkv_bias = np.concatenate([w(p + f"attention.self.{n}.bias") for n in ("query", "key", "value")])
            self.layers.append((
                np.ascontiguousarray(qkv.T), qkv_bias,  # (hidden, 3 hidden): x @ W, one sgemm for q|k|v
                np.ascontiguousarray(w(p + "attention.output.dense.weight").T), w(p + "attention.output.dense.bias"),
                (w(p + "attention.output.LayerNorm.weight"), w(p + "attention.output.LayerNorm.bias")),
                np.ascontiguousarray(w(p + "intermediate.dense.weight").T), w(p + "intermediate.dense.bias"),
                np.ascontiguousarray(w(p + "output.dense.weight").T), w(p + "output.dense.bias"),
                (w(p + "output.LayerNorm.weight"), w(p + "output.LayerNorm.bias")),
            ))
        self._zeros = np.zeros(config.hidden, np.float32)

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """ids, mask: (batch, tokens) int (mask 1 for real tokens, 0 for padding; real tokens first) ->
        (batch, tokens, hidden)."""
        c = self.config
        b, t = ids.shape
        n, heads = c.hidden, c.heads
        d = n // heads
        lengths = mask.sum(axis=1).astype(np.int64)
        rows = np.ascontiguousarray(self.word[ids].reshape(b * t, n))
        positions = np.tile(self.position[:t] + self.token_type[0], (b, 1))
        x = residual_layer_norm(rows, self._zeros, positions, *self.embed_norm, c.eps)
        for qkv_w, qkv_b, o_w, o_b, norm1, up_w, up_b, down_w, down_b, norm2 in self.layers:
            qkv = (x @ qkv_w + qkv_b).reshape(b, t, 3, heads, d)
            q = np.ascontiguousarray(qkv[:, :, 0].transpose(0, 2, 1, 3))  # (b, heads, t, d)
            k = np.ascontiguousarray(qkv[:, :, 1].transpose(0, 2, 3, 1))  # (b, heads, d, t)
            v = np.ascontiguousarray(qkv[:, :, 2].transpose(0, 2, 1, 3))
            scores = q @ k
            masked_softmax_inplace(scores, lengths, 1.0 / math.sqrt(d))
            attended = np.ascontiguousarray((scores @ v).transpose(0, 2, 1, 3)).reshape(b * t, n)
            x = residual_layer_norm(attended @ o_w, o_b, x, *norm1, c.eps)
            h = x @ up_w
            gelu_inplace(h, up_b)
            x = residual_layer_norm(h @ down_w, down_b, x, *norm2, c.eps)
        return x.reshape(b, t, n)
