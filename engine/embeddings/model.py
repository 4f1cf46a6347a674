"""An embedding model: a sentence-transformers checkpoint directory (config.json, safetensors, tokenizer.json,
modules.json with its pooling and normalisation) loaded and run: texts or token ids in, one vector per input out.

    load_embedding_model(ref)          a directory, or a built-in name (minilm-l6), -> EmbeddingModel
    model.tokenize(texts)              token ids per text ([CLS] ... [SEP] as the tokenizer's post-processor adds)
    model.embed(token_lists)           (n, dimension) float32, pooled as the checkpoint declares, L2-normalised

Inputs are run in batches sorted by length, unpadded, at most MAX_BATCH_TOKENS tokens per forward pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.embeddings.bert import QUANTS, BertConfig, BertEncoder
from engine.errors import ModelLoadError, UnsupportedModel
from engine.formats.checkpoint_json import read_json_object
from engine.formats.gguf import open_gguf
from engine.formats.safetensors import SafetensorsCheckpoint, to_f32
from engine.models.base import COMPUTE

__all__ = ["EmbeddingModel", "POOLINGS", "load_embedding_model"]

POOLINGS = ("mean", "cls", "last")
MAX_BATCH_TOKENS = 8192  # tokens per forward pass: bounds the activations (the FFN's are 4 hidden wide)
_BERT_ARCHS = {"BertModel", "BertForMaskedLM", "BertForPreTraining", None}
# The process-wide compute lock the generation models take: an encoder's parallel kernels take turns with theirs
# (numba's workqueue layer aborts on concurrent launches).
_COMPUTE = COMPUTE


class EmbeddingModel:
    def __init__(self, *, name: str, path: Path, encoder: BertEncoder, tokenizer, pooling: str, normalize: bool,
                 context: int, prompts: dict[str, str] | None = None, default_prompt: str | None = None):
        self.name, self.path, self.encoder, self.tokenizer = name, path, encoder, tokenizer
        self.pooling, self.normalize, self.context = pooling, normalize, context
        # Instruction prefixes by input type (config_sentence_transformers.json's "prompts": query, document...)
        self.prompts, self.default_prompt = dict(prompts or {}), default_prompt
        self.dimension = encoder.config.hidden
        self.vocab_size = encoder.config.vocab

    def prefix(self, input_type: str | None) -> str:
        """The text put before an input of this type (the default prompt when none is named; "" without)."""
        name = input_type or self.default_prompt
        return self.prompts.get(name, "") if name else ""

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def embed(self, token_lists: list[list[int]]) -> np.ndarray:
        """(n, dimension) float32 vectors of the token lists (each non-empty and within the context)."""
        out = np.empty((len(token_lists), self.dimension), np.float32)
        order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
        start = 0
        while start < len(order):
            end, size = start + 1, len(token_lists[order[start]])
            while end < len(order) and size + len(token_lists[order[end]]) <= MAX_BATCH_TOKENS:
                size += len(token_lists[order[end]])
                end += 1
            batch = order[start:end]
            lengths = np.array([len(token_lists[i]) for i in batch], np.int64)
            ids = np.fromiter((t for i in batch for t in token_lists[i]), np.int64, int(lengths.sum()))
            with _COMPUTE:
                hidden = self.encoder.forward(ids, lengths)
            out[batch] = self._pool(hidden, lengths)
            start = end
        return out

    def _pool(self, hidden: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """hidden (tokens, n): the sequences of `lengths` one after another -> one pooled vector each."""
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        if self.pooling == "cls":
            pooled = hidden[starts]
        elif self.pooling == "last":
            pooled = hidden[starts + lengths - 1]
        else:
            pooled = np.add.reduceat(hidden, starts, axis=0) / lengths[:, None].astype(np.float32)
        pooled = pooled.astype(np.float32)
        if self.normalize:
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled


def _modules(directory: Path) -> list:
    """modules.json: the sentence-transformers pipeline (an array of modules), [] where there is none."""
    path = directory / "modules.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, list):
        raise ModelLoadError(f"{path}: not a JSON array of modules")
    return value


def _pooling_and_normalize(directory: Path) -> tuple[str, bool]:
    """The pooling and normalisation the sentence-transformers modules declare (mean and normalised if none)."""
    modules = _modules(directory)
    normalize = any(isinstance(m, dict) and str(m.get("type", "")).endswith("Normalize") for m in modules)
    pooling_dir = next((m.get("path") for m in modules if isinstance(m, dict)
                        and str(m.get("type", "")).endswith("Pooling")), None)
    if not modules:
        return "mean", True
    config = read_json_object(directory / (pooling_dir or "1_Pooling") / "config.json", required=False)
    if config.get("pooling_mode_cls_token"):
        return "cls", normalize
    if config.get("pooling_mode_lasttoken"):
        return "last", normalize
    if config.get("pooling_mode_max_tokens") or config.get("pooling_mode_mean_sqrt_len_tokens"):
        raise UnsupportedModel(f"{directory}: only mean, CLS and last-token pooling are supported")
    return "mean", normalize


def load_embedding_model(ref: str | Path, *, name: str | None = None, progress=None, quant: str = "f32"):
    """A sentence-transformers directory (or a built-in name that resolves to one), a `bert` GGUF file, or a decoder
    GGUF that declares a pooling type, as an embedding model called `name` (default: the built-in's name, else the
    directory's or file's). `quant` (QUANTS): f32, or q8: an encoder's matrices as Q8_0 blocks (bert.py); a
    decoder on the generation fast path (int8 activations) rather than the exact f32 one."""
    from tokenizers import Tokenizer

    from engine.store.resolve import resolve_model_ref

    if quant not in QUANTS:
        raise UnsupportedModel(f"--embed-quant {quant!r}: choose from {', '.join(QUANTS)}")
    path = Path(resolve_model_ref(str(ref), progress=progress))
    if path.is_file() and open_gguf(path).architecture != "bert":
        return _decoder_embedder(path, name, quant)
    if path.is_file():  # a GGUF encoder (llama.cpp's `bert` layout); L2-normalised, as llama.cpp's embeddings are
        from engine.embeddings.gguf_bert import read_bert_gguf

        encoder, tokenizer, pooling, context = read_bert_gguf(path, quant)
        return EmbeddingModel(name=name or path.stem, path=path, encoder=encoder, tokenizer=tokenizer,
                              pooling=pooling, normalize=True, context=context)
    config = read_json_object(path / "config.json")
    arch = (config.get("architectures") or [None])[0]
    if config.get("model_type") != "bert" or arch not in _BERT_ARCHS:
        raise UnsupportedModel(f"{path}: {arch or config.get('model_type')!r} is not an encoder goinfer embeds with "
                               "(supported: BERT, e.g. sentence-transformers/all-MiniLM-L6-v2)")
    bert = BertConfig.of(config)
    checkpoint = SafetensorsCheckpoint(path)
    names = set(checkpoint.names)

    def weight(key: str) -> np.ndarray:
        for full in (key, "bert." + key):
            if full in names:
                return np.ascontiguousarray(to_f32(checkpoint.array(full), checkpoint.dtype(full)))
        raise ModelLoadError(f"{path}: tensor {key!r} is missing")

    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path}: tokenizer.json is missing")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_truncation()  # over-long inputs are refused by the caller, never cut silently
    tokenizer.no_padding()
    pooling, normalize = _pooling_and_normalize(path)
    limit = read_json_object(path / "sentence_bert_config.json", required=False).get("max_seq_length")
    st_config = read_json_object(path / "config_sentence_transformers.json", required=False)
    prompts = {k: v for k, v in (st_config.get("prompts") or {}).items() if isinstance(v, str)}
    default_prompt = st_config.get("default_prompt_name") if isinstance(st_config.get("default_prompt_name"),
                                                                        str) else None
    context = min(int(limit), bert.positions) if isinstance(limit, int) and limit > 0 else bert.positions
    if name is None:  # a built-in goes by its built-in name, a directory by its own
        from engine.store.builtin import lookup
        builtin = lookup(str(ref))
        name = builtin.name if builtin is not None else path.name
    return EmbeddingModel(name=name, path=path, encoder=BertEncoder(bert, weight, quant), tokenizer=tokenizer,
                          pooling=pooling, normalize=normalize, context=context, prompts=prompts,
                          default_prompt=default_prompt)


def _decoder_embedder(path: Path, name: str | None, quant: str):
    """A decoder GGUF that declares a pooling type, loaded as a generation model and pooled."""
    from engine.embeddings.decoder import DecoderEmbedder, declared_pooling
    from engine.loading.load import load_model

    pooling = declared_pooling(open_gguf(path).metadata, path.name)
    return DecoderEmbedder(load_model(str(path), quant="f32" if quant == "f32" else "auto"), pooling,
                           name or path.stem)
