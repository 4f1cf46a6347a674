"""`Model`: a loaded checkpoint — config, weights, tokenizer, chat template, backend — and its
forward pass over a KV cache, with the scoring API (`logprobs`, `next_logprobs`) built on it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from engine import memory
from engine.cache.kv import KVCache
from engine.kernels import packed
from engine.kernels.backend import Backend
from engine.models.config import ModelConfig
from engine.models.decode_step import DecodeStep
from engine.models.weights import Weights

PREFILL_CHUNK = 512  # tokens per forward call: bounds attention scores and activations
HEAD_ROWS = 32768  # vocabulary rows per head matmul: bounds the dequantization scratch

ForwardFn = Callable[[ModelConfig, Weights, Backend, np.ndarray, KVCache], np.ndarray]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax computed in float64 (as the reference data is), returned as float32."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return z.astype(np.float32)


class Model:
    def __init__(self, *, path: Path, config: ModelConfig, weights: Weights, forward: ForwardFn, backend: Backend,
                 tokenizer, template, quant: str, compute_path: str, metadata: dict, step: DecodeStep | None = None):
        self.path, self.config, self.weights, self._forward = path, config, weights, forward
        self.step = step  # the compiled one-token decode step (fast path), or None: decode layer by layer
        self.backend, self.tokenizer, self.template, self.quant = backend, tokenizer, template, quant
        self.compute_path = compute_path  # what quant resolved to: equal paths give equal results
        # The fast path keeps an f16 KV cache (as llama.cpp does): half the memory and half the bytes a decoded
        # token's attention reads. The exact path stays f32 throughout.
        self.kv_dtype = "f16" if compute_path == "int8" else "f32"
        self.metadata = metadata
        self.name = path.stem

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        c = self.config
        return KVCache(c.n_layer, c.n_head_kv, c.head_dim, max_tokens or c.context_length, self.kv_dtype)

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Logits (T, vocab) from final-normed hidden states (T, n_embd)."""
        w = self.weights
        t = w.tensor("output") if w.has("output") else w.tensor("token_embd")  # after load: its packed copy
        if hidden.shape[0] <= 8 or t.rows <= HEAD_ROWS:
            logits = self.backend.matmul(hidden, t)
        else:
            logits = np.empty((hidden.shape[0], t.rows), np.float32)
            for r0 in range(0, t.rows, HEAD_ROWS):
                part = packed.slice_rows(t, r0, min(t.rows, r0 + HEAD_ROWS))
                logits[:, r0 : r0 + part.rows] = self.backend.matmul(hidden, part)
        return self._finish_logits(logits)

    def _finish_logits(self, logits: np.ndarray) -> np.ndarray:
        """Raw head output -> logits: final soft-capping (Gemma 2 style), padding rows past the vocabulary cut."""
        cap = self.config.final_logit_softcap
        if cap:
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        return logits[:, : self.config.vocab_size]

    def decode(self, ids, caches: list[KVCache]) -> np.ndarray:
        """One new token for each of several sequences: ids[m] appended to caches[m]; logits (M, vocab).
        With the compiled step every weight is read once for all M sequences."""
        if len(ids) != len(caches):
            raise ValueError(f"{len(ids)} tokens for {len(caches)} caches")
        if self.step is not None:
            return self._finish_logits(self.step(ids, caches))
        return np.concatenate([self.eval([t], c) for t, c in zip(ids, caches)])

    def eval(self, ids, cache: KVCache, logits_from: int | None = None,
             on_chunk: Callable[[int], None] | None = None) -> np.ndarray:
        """Append ids to the sequence in cache; return logits (n, vocab) for ids[logits_from:]
        (default: the last token only). `on_chunk(done)` is called after each chunk of ids (a server
        polls it to abandon a long prompt whose client has gone: an exception it raises ends the call)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            raise ValueError("eval needs at least one token")
        if logits_from is None:
            logits_from = len(ids) - 1
        if len(ids) == 1 and self.step is not None:
            logits = self._finish_logits(self.step(ids, [cache]))
            if on_chunk is not None:
                on_chunk(1)
            return logits
        cache.reserve(len(ids))
        rows = []
        try:
            for c0 in range(0, len(ids), PREFILL_CHUNK):
                chunk = ids[c0 : c0 + PREFILL_CHUNK]
                hidden = self._forward(self.config, self.weights, self.backend, chunk, cache)  # (T, n_embd)
                keep = max(0, logits_from - c0)
                if keep < len(chunk):
                    rows.append(self.head(hidden[keep:]))
                if on_chunk is not None:
                    on_chunk(c0 + len(chunk))
        finally:
            release = getattr(self.backend, "release", None)
            if release is not None:
                release()
            memory.trim()  # the heap kept the prompt's freed activations for reuse; back to the OS now
        return np.concatenate(rows) if len(rows) > 1 else rows[0]

    def logprobs(self, ids, start: int = 0) -> np.ndarray:
        """(len(ids) - start, vocab) float32: row j is the log-softmax of the next-token distribution
        after position start + j. One forward pass over ids."""
        ids = list(ids)
        if not 0 <= start < len(ids):
            raise ValueError(f"start must be in [0, {len(ids)}), got {start}")
        cache = self.new_cache(max(len(ids), 1))
        return log_softmax(self.eval(ids, cache, logits_from=start))

    def next_logprobs(self, ids) -> np.ndarray:
        """(vocab,) float32: log-probabilities of the token after ids."""
        ids = list(ids)
        return self.logprobs(ids, start=len(ids) - 1)[0]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
