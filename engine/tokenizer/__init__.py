"""Tokenizers built from GGUF metadata on Hugging Face `tokenizers`, matching llama.cpp's token ids.

    Tokenizer.from_gguf_metadata(meta) -> Tokenizer   # encode / decode / special ids
    IncrementalDecoder(tokenizer, skip_special=True)   # streaming detokenizer: push(id) -> str, flush()
"""

from engine.tokenizer.gguf_tokenizer import Tokenizer
from engine.tokenizer.streaming import IncrementalDecoder

__all__ = ["Tokenizer", "IncrementalDecoder"]
