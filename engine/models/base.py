"""`Model`: a loaded checkpoint — config, weights, tokenizer, chat template, backend — and its two steps over a
KV cache: `prefill` (a prompt, in chunks, through the family's forward pass) and `decode` (one new token for
each of several sequences, through the backend's compiled step where it has one), with the scoring API
(`logprobs`, `next_logprobs`) built on them."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np

from engine.kernels import memory
from engine.kernels.backend import Backend, KVCache
from engine.models.config import ModelConfig
from engine.models.family import ForwardFn
from engine.models.weights import Weights

PREFILL_CHUNK = 512  # tokens per forward call: bounds attention scores and activations
# One model computation at a time in the process. The compiled decode step releases the GIL, so a server's handler
# threads send tokens while it runs; two models' parallel kernels must still not launch at once (numba's
# workqueue threading layer, where OpenMP is missing, aborts the process on concurrent launches). On a machine
# whose cores one computation already fills, taking turns costs nothing.
COMPUTE = threading.RLock()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax computed in float64 (as the reference data is), returned as float32."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return z.astype(np.float32)


class Model:
    def __init__(self, *, path: Path, config: ModelConfig, weights: Weights, forward: ForwardFn, backend: Backend,
                 tokenizer, template, quant: str, metadata: dict):
        self.path, self.config, self.weights, self._forward = path, config, weights, forward
        self.backend, self.tokenizer, self.template = backend, tokenizer, template
        self.quant = quant  # as asked for: "auto" runs the backend's fast path, "f32" its exact one (backend.path)
        self.metadata = metadata
        self.name = path.stem
        # Where it runs and why (load_model: engine/loading/placement.py): "backend" cpu | webgpu, "asked" cpu |
        # webgpu | auto, "reason" for the choice, "adapter" (the WebGPU adapter's report) and "selftest" where one ran.
        self.placement: dict = {"backend": backend.name, "asked": backend.name}
        self.adapters: list[dict] = []  # LoRA adapters merged into the weights (models/lora.py): their identities

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        return self.backend.new_cache(self.config, max_tokens or self.config.context_length)

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Logits (T, vocab) from final-normed hidden states (T, n_embd)."""
        w = self.weights
        t = w.tensor("output") if w.has("output") else w.tensor("token_embd")  # tied: the embedding table
        return self._finish_logits(self.backend.matmul(hidden, t))

    def _finish_logits(self, logits: np.ndarray) -> np.ndarray:
        """Raw head output -> logits: final soft-capping (Gemma 2 style), padding rows past the vocabulary cut."""
        cap = self.config.final_logit_softcap
        if cap:
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        return logits[:, : self.config.vocab_size]

    def prefill(self, ids, cache: KVCache, logits_from: int | None = None,
                on_chunk: Callable[[int], None] | None = None) -> np.ndarray:
        """Append the prompt ids to the sequence in cache; return logits (n, vocab) for ids[logits_from:]
        (default: the last token only). `on_chunk(done)` is called after each chunk of ids (a server
        polls it to abandon a long prompt whose client has gone: an exception it raises ends the call)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        if logits_from is None:
            logits_from = len(ids) - 1
        # A one-token prompt: the compiled step is the faster way. Not a one-token continuation of a prefix: its
        # position must get the numbers a whole prompt's pass gives it (a reused prefix, engine/sessions/pool.py).
        if len(ids) == 1 and cache.length == 0 and self.backend.has_decode_step:
            logits = self.decode(ids, [cache])
            if on_chunk is not None:
                on_chunk(1)
            return logits
        cache.reserve(len(ids))
        rows = []
        try:
            for c0 in range(0, len(ids), PREFILL_CHUNK):  # a chunk at a time (COMPUTE is taken per chunk)
                chunk = ids[c0 : c0 + PREFILL_CHUNK]
                part = self.prefill_part(chunk, cache, max(0, logits_from - c0))
                if part is not None:
                    rows.append(part)
                if on_chunk is not None:
                    on_chunk(c0 + len(chunk))
        finally:
            with COMPUTE:  # another thread's prompt may be mid-chunk on the same kernels' scratch
                self.backend.end_prompt()
            memory.trim()  # the heap kept the prompt's freed activations for reuse; back to the OS now
        return np.concatenate(rows) if len(rows) > 1 else rows[0]

    def prefill_part(self, ids: np.ndarray, cache: KVCache, logits_from: int) -> np.ndarray | None:
        """One chunk of a prompt through the forward pass, as `prefill` runs each of its chunks (the scheduler
        runs a long prompt's chunks between other sequences' decode steps): ids appended to cache; logits for
        ids[logits_from:], None when that is empty. The caller ends the prompt (backend.end_prompt)."""
        ids = np.asarray(ids, dtype=np.int64)
        cache.reserve(len(ids))
        with COMPUTE:
            hidden = self._forward(self.config, self.weights, self.backend, ids, cache)  # (T, n_embd)
            return self.head(hidden[logits_from:]) if logits_from < len(ids) else None

    def hidden_states(self, ids) -> np.ndarray:
        """(len(ids), n_embd) float32: the final-normed hidden states of ids from a fresh cache, before the head
        (what a decoder used as an embedder pools)."""
        ids = np.asarray(ids, dtype=np.int64)
        cache = self.new_cache(max(len(ids), 1))
        rows = []
        try:
            for c0 in range(0, len(ids), PREFILL_CHUNK):
                chunk = ids[c0 : c0 + PREFILL_CHUNK]
                cache.reserve(len(chunk))
                with COMPUTE:
                    rows.append(np.array(self._forward(self.config, self.weights, self.backend, chunk, cache),
                                         np.float32))  # a copy: the forward pass's buffers are reused
        finally:
            with COMPUTE:  # another thread's prompt may be mid-chunk on the same kernels' scratch
                self.backend.end_prompt()
            memory.trim()
        return np.concatenate(rows) if len(rows) > 1 else rows[0]

    def decode(self, ids, caches: list[KVCache]) -> np.ndarray:
        """One new token for each of several sequences: ids[m] appended to caches[m]; logits (M, vocab).
        With the backend's compiled step every weight is read once for all M sequences; without one, each
        token runs the forward pass on its own."""
        if len(ids) != len(caches):
            raise ValueError(f"{len(ids)} tokens for {len(caches)} caches")
        if self.backend.has_decode_step:
            with COMPUTE:
                raw = self.backend.decode(ids, caches)
            return self._finish_logits(raw)
        return np.concatenate([self.prefill([t], c) for t, c in zip(ids, caches)])

    def runs_on(self, cache: KVCache) -> bool:
        """decode_runs can take several tokens of this cache's sequence at once (engine/generation/speculation.py): the
        backend's step takes runs, and the sequence has no recurrent state (which a rejected token would leave
        advanced)."""
        return self.backend.has_decode_step and self.backend.has_run_step and not cache.state

    def decode_runs(self, runs: list, caches: list[KVCache]) -> list[np.ndarray]:
        """Several new tokens for each of several sequences in one step: runs[m] (ids) appended to caches[m];
        logits (len(runs[m]), vocab) for each, row j the distribution after runs[m][j]. Row for row the same
        numbers as one decode per token (see runs_on for where it runs)."""
        if len(runs) != len(caches):
            raise ValueError(f"{len(runs)} runs for {len(caches)} caches")
        if all(len(r) == 1 for r in runs):
            logits = self.decode([r[0] for r in runs], caches)
        else:
            if not all(self.runs_on(c) for r, c in zip(runs, caches) if len(r) > 1):
                raise ValueError("this model's decode step takes one token per sequence")
            with COMPUTE:
                logits = self._finish_logits(self.backend.decode_runs(runs, caches))
        ends = np.cumsum([len(r) for r in runs]).tolist()
        return [logits[a:b] for a, b in zip([0] + ends[:-1], ends)]

    def logprobs(self, ids, start: int = 0) -> np.ndarray:
        """(len(ids) - start, vocab) float32: row j is the log-softmax of the next-token distribution
        after position start + j. One forward pass over ids."""
        ids = list(ids)
        if not 0 <= start < len(ids):
            raise ValueError(f"start must be in [0, {len(ids)}), got {start}")
        cache = self.new_cache(max(len(ids), 1))
        return log_softmax(self.prefill(ids, cache, logits_from=start))

    def next_logprobs(self, ids) -> np.ndarray:
        """(vocab,) float32: log-probabilities of the token after ids."""
        ids = list(ids)
        return self.logprobs(ids, start=len(ids) - 1)[0]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
