"""A `bert` GGUF (llama.cpp's converter's layout) read as the encoder and tokenizer goinfer's directory path builds.

    config      bert.* keys: widths, layers, heads, context, LayerNorm eps, pooling_type
    weights     GGUF tensor names -> the Hugging Face names BertEncoder asks for; any weight type goinfer reads is
                dequantized to f32 (engine/kernels/reference.py), kept as the encoder's quant asks (a Q8_0 file's
                blocks requantize to themselves under q8)
    tokenizer   the WordPiece vocabulary back from llama.cpp's "phantom space" form ("\u2581word" -> "word",
                "ing" -> "##ing"), with BERT's normalizer (lower-cased, accents stripped, as llama.cpp's WordPiece
                tokenizer does), [CLS] (GGUF's BOS) ... [SEP] added around each input
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.embeddings.bert import BertConfig, BertEncoder
from engine.errors import ModelLoadError, UnsupportedModel

__all__ = ["read_bert_gguf"]

# pooling_type values of llama.cpp (LLAMA_POOLING_TYPE_*)
_POOLING = {1: "mean", 2: "cls", 3: "last"}
_PHANTOM = "\u2581"
_NORMAL, _CONTROL = 1, 3


def _gguf_name(key: str) -> str:
    """A Hugging Face BERT tensor name -> llama.cpp's."""
    fixed = {"embeddings.word_embeddings.weight": "token_embd.weight",
             "embeddings.position_embeddings.weight": "position_embd.weight",
             "embeddings.token_type_embeddings.weight": "token_types.weight",
             "embeddings.LayerNorm.weight": "token_embd_norm.weight",
             "embeddings.LayerNorm.bias": "token_embd_norm.bias"}
    if key in fixed:
        return fixed[key]
    _, _, layer, rest = key.split(".", 3)  # encoder.layer.N.<rest>
    part, kind = rest.rsplit(".", 1)
    names = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
             "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
             "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
    return f"blk.{layer}.{names[part]}.{kind}"


def _tokenizer(meta: dict, path: Path):
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    if meta.get("tokenizer.ggml.model") != "bert":
        raise UnsupportedModel(f"{path.name}: tokenizer {meta.get('tokenizer.ggml.model')!r} is not a WordPiece "
                               "(bert) vocabulary")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    vocab = {}
    for i, token in enumerate(tokens):
        control = types is not None and int(types[i]) == _CONTROL
        text = token if control else token[1:] if token.startswith(_PHANTOM) else "##" + token
        vocab.setdefault(text, i)
    unk = tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 100))]
    tok = Tokenizer(WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id = int(meta.get("tokenizer.ggml.bos_token_id", 101))
    sep_id = int(meta.get("tokenizer.ggml.seperator_token_id", meta.get("tokenizer.ggml.eos_token_id", 102)))
    cls, sep = tokens[cls_id], tokens[sep_id]
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
                                                       special_tokens=[(cls, cls_id), (sep, sep_id)])
    tok.decoder = decoders.WordPiece()
    return tok


def read_bert_gguf(path: Path, quant: str = "f32"):
    """(BertEncoder, tokenizer, pooling, context) of a `bert` GGUF file; quant: the encoder's (bert.QUANTS)."""
    from engine.formats.gguf import open_gguf
    from engine.kernels.reference import dequantize

    source = open_gguf(path)
    if source.architecture != "bert":
        raise UnsupportedModel(f"{path.name}: architecture {source.architecture!r} is not an encoder goinfer embeds "
                               "with (supported: bert)")
    source.check_tensor_types()
    meta = source.metadata
    try:
        config = BertConfig.of({
            "hidden_size": meta["bert.embedding_length"], "num_hidden_layers": meta["bert.block_count"],
            "num_attention_heads": meta["bert.attention.head_count"],
            "intermediate_size": meta["bert.feed_forward_length"], "vocab_size": len(meta["tokenizer.ggml.tokens"]),
            "max_position_embeddings": meta["bert.context_length"],
            "layer_norm_eps": meta.get("bert.attention.layer_norm_epsilon", 1e-12)})
    except KeyError as e:
        raise ModelLoadError(f"{path.name}: GGUF metadata lacks {e.args[0]!r}") from None

    def weight(key: str) -> np.ndarray:
        t = dequantize(source.tensor(_gguf_name(key)))
        vector = key.endswith(".bias") or "LayerNorm" in key  # 1-D in the checkpoint; the reader gives (1, n)
        return np.ascontiguousarray(t.reshape(-1) if vector else t, np.float32)

    pooling = _POOLING.get(int(meta.get("bert.pooling_type", 1)))
    if pooling is None:
        raise UnsupportedModel(f"{path.name}: pooling_type {meta.get('bert.pooling_type')} is not supported "
                               "(mean, CLS, last)")
    return BertEncoder(config, weight, quant), _tokenizer(meta, path), pooling, config.positions
