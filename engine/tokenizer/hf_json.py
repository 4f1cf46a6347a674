"""The tokenizer of a Hugging Face checkpoint directory: `tokenizer.json` run by the `tokenizers` library as
it is (its normalizer, pre-tokenizer, added tokens), so token ids are exactly what that file gives, plus the
settings transformers takes from `tokenizer_config.json`, `config.json` and `generation_config.json`:
BOS/EOS, whether BOS is added, the end-of-generation tokens and the chat template.

Pieces are rendered as for a GGUF vocabulary: byte-level BPE tokens map characters to bytes, SentencePiece-style
ones (U+2581 for spaces, `<0xNN>` byte fallback) replace the space mark.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelLoadError
from engine.formats.checkpoint_json import read_json_object
from engine.tokenizer.gguf_tokenizer import SPACE, Tokenizer, end_of_generation
from engine.tokenizer.hf_build import BYTE, CONTROL, NORMAL, UNUSED, USER_DEFINED

# tokenizer_config classes whose transformers tokenizer adds BOS unless told not to (SentencePiece models whose
# tokenizer.json may not say so in its post-processor)
_ADDS_BOS = ("LlamaTokenizer", "LlamaTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast", "CodeLlamaTokenizer")
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if isinstance(v, int)] if isinstance(value, list) else []


def chat_template(directory: Path) -> str | None:
    """The checkpoint's chat template: tokenizer_config.json's (a string, or the `default` of named ones), else
    chat_template.jinja."""
    tpl = read_json_object(directory / "tokenizer_config.json", required=False).get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(tpl, str) and tpl:
        return tpl
    path = directory / "chat_template.jinja"
    return path.read_text(encoding="utf-8") if path.is_file() else None


def from_hf_directory(directory: str | Path, n_vocab: int) -> Tokenizer:
    """The Tokenizer of a checkpoint directory; ids past the tokenizer's own up to n_vocab are unused padding."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no tokenizer.json (a checkpoint with only a tokenizer.model is not "
                             f"supported)")
    try:
        hf = HFTokenizer.from_file(str(path))
        spec = json.loads(path.read_text(encoding="utf-8"))
    except Exception as e:  # tokenizers raises its own Exception subclass for any malformed file
        raise ModelLoadError(f"{path}: not a tokenizer.json the tokenizers library can read ({e})") from None
    tok_config = read_json_object(directory / "tokenizer_config.json", required=False)
    model_config = read_json_object(directory / "config.json", required=False)
    gen_config = read_json_object(directory / "generation_config.json", required=False)

    vocab = hf.get_vocab(with_added_tokens=True)
    n = max(n_vocab, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    attrs = np.full(n, UNUSED, dtype=np.int32)
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    for text, i in vocab.items():
        tokens[i] = text
        attrs[i] = BYTE if not byte_level and _BYTE_TOKEN.match(text) else NORMAL
    for i, added in hf.get_added_tokens_decoder().items():
        attrs[i] = CONTROL if added.special else USER_DEFINED
    vocab = {t: i for i, t in enumerate(tokens)}

    def special_id(name: str) -> int | None:
        text = _token_text(tok_config.get(name + "_token"))
        if text is not None and text in vocab:
            return vocab[text]
        ids = _ids(model_config.get(name + "_token_id")) or _ids(gen_config.get(name + "_token_id"))
        return ids[0] if ids and 0 <= ids[0] < n else None

    bos, eos = special_id("bos"), special_id("eos")
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        with_specials = hf.encode("a", add_special_tokens=True).ids
        add_bos = (bos is not None and with_specials[:1] == [bos]) or tok_config.get("tokenizer_class") in _ADDS_BOS
    eog = end_of_generation(vocab, attrs, eos, lambda key, default: default)
    eog |= {i for i in _ids(model_config.get("eos_token_id")) + _ids(gen_config.get("eos_token_id")) if 0 <= i < n}
    first = hf.encode("a", add_special_tokens=False).tokens
    return Tokenizer(kind="gpt2" if byte_level else "llama", tokens=tokens, vocab=vocab, attrs=attrs, hf=hf,
                     bos_id=bos, eos_id=eos, eog_ids=frozenset(eog), add_bos=bool(add_bos and bos is not None),
                     add_eos=bool(tok_config.get("add_eos_token", False)),
                     add_space_prefix=not byte_level and bool(first) and first[0].startswith(SPACE),
                     parses_specials=True)
