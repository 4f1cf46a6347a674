"""A decoder model used as an embedder: a GGUF whose metadata declares `<arch>.pooling_type` (Qwen3-Embedding and
its kind) pools the final norm's hidden states of each input (last token or mean), L2-normalised, as llama.cpp
embeds with such a file. It runs through the generation model's own forward pass (engine.load_model), so every
family and weight type goinfer loads can embed; one input at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.errors import UnsupportedModel

__all__ = ["DecoderEmbedder", "declared_pooling"]

_POOLING = {1: "mean", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_*: MEAN, LAST (CLS has no meaning here)


def declared_pooling(meta: dict, name: str) -> str:
    """The pooling a decoder GGUF declares, or UnsupportedModel saying why it cannot embed."""
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.pooling_type")
    if value is None:
        raise UnsupportedModel(f"{name}: a {arch} model that declares no pooling type ({arch}.pooling_type) is a "
                               "chat model, not an embedding model")
    if int(value) not in _POOLING:
        raise UnsupportedModel(f"{name}: pooling type {value} is not supported for a decoder (mean, last)")
    return _POOLING[int(value)]


class DecoderEmbedder:
    """The EmbeddingModel interface (engine/embeddings/model.py) over a loaded generation Model."""

    normalize = True
    prompts: dict = {}
    default_prompt = None

    def __init__(self, model, pooling: str, name: str):
        self.model, self.pooling, self.name = model, pooling, name
        self.path = Path(model.path)
        self.dimension = model.config.n_embd
        self.vocab_size = model.vocab_size
        self.context = model.context_length

    def prefix(self, input_type: str | None) -> str:
        return ""

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        # the tokenizer's metadata says whether an EOS closes each input (last-token pooling reads it)
        return [self.model.tokenizer.encode(t) for t in texts]

    def embed(self, token_lists: list[list[int]]) -> np.ndarray:
        out = np.empty((len(token_lists), self.dimension), np.float32)
        for i, ids in enumerate(token_lists):
            hidden = self.model.hidden_states(ids)
            out[i] = hidden[-1] if self.pooling == "last" else hidden.mean(axis=0)
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out
