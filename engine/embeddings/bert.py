"""The BERT encoder (sentence-transformers checkpoints such as all-MiniLM-L6-v2): a batch of token-id sequences in
(one after another, unpadded), the last layer's hidden states out.

    embeddings  word + absolute position + token type (0), then LayerNorm
    each layer  self-attention over the unmasked keys (no causal mask), output projection, residual, LayerNorm;
                GELU (exact, erf) feed-forward, residual, LayerNorm (post-LN, as BERT is)

f32 by default: the matrices are BLAS sgemm calls over the whole batch's real tokens (no padding); attention runs
per (sequence, head) over that sequence's own keys, read in place from the q|k|v rows, and the elementwise work
(GELU, residual + LayerNorm) is compiled (encoder_ops.py). A sequence never sees another's keys, as transformers'
additive mask of f32's smallest value gives for a padded batch. quant "q8" keeps the four
matrices per layer (q|k|v, output, up, down) as Q8_0 blocks (a quarter of the bytes; see Q8Matrix); everything
else stays f32.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from engine.errors import ModelLoadError, UnsupportedModel
from engine.kernels.cpu.encoder_ops import Q8Matrix, attention, gelu_inplace, residual_layer_norm

__all__ = ["QUANTS", "BertConfig", "BertEncoder"]


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


class F32Matrix:
    """W (out, in) as f32, transposed once so that x @ W.T is one sgemm over a contiguous (in, out) operand."""

    def __init__(self, w: np.ndarray):
        self.t = np.ascontiguousarray(w.T)

    def apply(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = x @ W.T (out: (rows of x, W's rows) f32, C-contiguous), returned."""
        return np.matmul(x, self.t, out=out)


QUANTS = ("f32", "q8")


class BertEncoder:
    """The encoder's weights and its forward pass. `weights(name)` gives an f32 tensor by its Hugging Face name
    without the model prefix ("embeddings.word_embeddings.weight", "encoder.layer.0..."); `quant` is how the
    layers' matrices are kept (QUANTS)."""

    def __init__(self, config: BertConfig, weights, quant: str = "f32"):
        if quant not in QUANTS:
            raise UnsupportedModel(f"--embed-quant {quant!r}: choose from {', '.join(QUANTS)}")
        self.config, self.quant = config, quant
        if quant == "q8":
            matrix = Q8Matrix
        else:
            matrix = F32Matrix
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
                matrix(qkv), qkv_bias,  # (3 hidden, hidden): one matmul for q|k|v
                matrix(w(p + "attention.output.dense.weight")), w(p + "attention.output.dense.bias"),
                (w(p + "attention.output.LayerNorm.weight"), w(p + "attention.output.LayerNorm.bias")),
                matrix(w(p + "intermediate.dense.weight")), w(p + "intermediate.dense.bias"),
                matrix(w(p + "output.dense.weight")), w(p + "output.dense.bias"),
                (w(p + "output.LayerNorm.weight"), w(p + "output.LayerNorm.bias")),
            ))
        self._zeros = np.zeros(config.hidden, np.float32)
        self._lock = threading.Lock()  # one forward pass at a time: they share the workspace
        self._workspace: dict[str, np.ndarray] = {}

    def _buffers(self, tokens: int) -> dict[str, np.ndarray]:
        """The forward pass's activations for `tokens` rows, views of arrays kept from pass to pass (grown when a
        batch is larger). Why: numpy takes arrays this large (MBs) from fresh mmap'd pages that the kernel zeroes
        on first touch, and gives them back on free; allocating every layer's outputs anew cost a measurable share
        of a run on all-MiniLM-L6-v2 (docs/benchmarks.md, "Measurements behind the code", BERT buffers)."""
        n = self.config.hidden
        widths = {"x": n, "spare": n, "qkv": 3 * n, "attended": n, "ffn": self.config.intermediate}
        if not self._workspace or self._workspace["x"].shape[0] < tokens:
            self._workspace = {k: np.empty((tokens, w), np.float32) for k, w in widths.items()}
        return {k: a[:tokens] for k, a in self._workspace.items()}

    def forward(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """A batch of sequences one after another, unpadded: ids (tokens,) int, lengths (batch,) int (each >= 1,
        summing to tokens) -> the last layer's hidden states (tokens, hidden), in the same order.

        Nothing is padded: the matrices run over the real tokens, attention over each sequence's own. The
        activations live in a workspace kept between passes (_buffers); the result is a new array."""
        with self._lock:
            return self._forward(ids, np.asarray(lengths, np.int64))

    def _forward(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        c = self.config
        n, heads = c.hidden, c.heads
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        positions = np.concatenate([np.arange(m) for m in lengths])
        ws = self._buffers(len(ids))
        # x: the hidden states; spare: a free (tokens, hidden) buffer. A LayerNorm writes over its input h (allowed)
        # and the old x becomes the spare.
        x, spare = ws["x"], ws["spare"]
        residual_layer_norm(self.word[ids], self._zeros, self.position[positions] + self.token_type[0],
                            *self.embed_norm, c.eps, out=x)
        scale = 1.0 / math.sqrt(n // heads)
        for i, (qkv_w, qkv_b, o_w, o_b, norm1, up_w, up_b, down_w, down_b, norm2) in enumerate(self.layers):
            attended = attention(qkv_w.apply(x, ws["qkv"]), qkv_b, starts, lengths, heads, scale, ws["attended"])
            o = o_w.apply(attended, spare)
            x, spare = residual_layer_norm(o, o_b, x, *norm1, c.eps, out=o), x
            h = up_w.apply(x, ws["ffn"])
            gelu_inplace(h, up_b)
            last = i == len(self.layers) - 1
            d = down_w.apply(h, np.empty_like(x) if last else spare)  # the result outlives the workspace
            x, spare = residual_layer_norm(d, down_b, x, *norm2, c.eps, out=d), x
        return x if self.layers else x.copy()  # never a view of the workspace
