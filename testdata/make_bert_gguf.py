"""A `bert` GGUF written from a sentence-transformers checkpoint directory, laid out as llama.cpp's converter lays
it out (conversion/bert.py of llama-cpp-python 0.3.36's vendored tree), with the gguf writer and numpy only (no
torch): the test fixture for goinfer's GGUF encoder path.

    python -m testdata.make_bert_gguf MODEL_DIR OUT.gguf [f16|f32|q8_0]

What the converter does and this script does too: the WordPiece vocabulary in "phantom space" form ("##ing" ->
"ing", "word" -> "\u2581word", control tokens as they are), token types CONTROL for the tokenizer's special added
tokens, the special token ids ([CLS] as BOS, [SEP] as EOS and SEP, pad / unk / mask), non-causal attention, the pooling type the
sentence-transformers modules declare, tensor names from gguf's tensor map, 2-D weights in the output type but
the position and token-type tables and the 1-D tensors (norms, biases) in f32, the position_ids buffer and the
pooler dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import safetensors.numpy

_POOLING = {"pooling_mode_mean_tokens": gguf.PoolingType.MEAN, "pooling_mode_cls_token": gguf.PoolingType.CLS,
            "pooling_mode_lasttoken": gguf.PoolingType.LAST}
_TYPES = {"f16": gguf.GGMLQuantizationType.F16, "f32": gguf.GGMLQuantizationType.F32,
          "q8_0": gguf.GGMLQuantizationType.Q8_0}


def _pooling(directory: Path) -> gguf.PoolingType | None:
    modules = directory / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            config = json.loads((directory / module.get("path", "1_Pooling") / "config.json").read_text())
            return next((kind for key, kind in _POOLING.items() if config.get(key)), None)
    return None


def _vocab(directory: Path) -> tuple[list[str], list[int], dict]:
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    types = [int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL) for i in range(len(tokens))]
    phantom = [t if types[i] == gguf.TokenType.CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
               for i, t in enumerate(tokens)]
    ids = {name: vocab[text] for name, text in (("cls", "[CLS]"), ("sep", "[SEP]"), ("pad", "[PAD]"),
                                                ("unk", "[UNK]"), ("mask", "[MASK]")) if text in vocab}
    return phantom, types, ids


def write_bert_gguf(directory: str | Path, out: str | Path, outtype: str = "f16") -> Path:
    directory, out = Path(directory), Path(out)
    config = json.loads((directory / "config.json").read_text())
    tensors = safetensors.numpy.load_file(str(directory / "model.safetensors"))
    arch = gguf.MODEL_ARCH.BERT
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(directory.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    pooling = _pooling(directory)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    tokens, types, ids = _vocab(directory)
    writer.add_token_type_count(config.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # GGUF has no CLS key: llama.cpp's WordPiece vocabulary adds [CLS] as its BOS and [SEP] as its EOS / SEP.
    for name, add in (("cls", writer.add_bos_token_id), ("sep", writer.add_eos_token_id),
                      ("sep", writer.add_sep_token_id), ("pad", writer.add_pad_token_id),
                      ("unk", writer.add_unk_token_id), ("mask", writer.add_mask_token_id)):
        if name in ids:
            add(ids[name])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    qtype = _TYPES[outtype]
    for hf_name, array in tensors.items():
        hf_name = hf_name.removeprefix("bert.")
        if hf_name == "embeddings.position_ids" or hf_name.startswith(("pooler.", "cls.")):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        array = np.ascontiguousarray(array, np.float32)
        # llama.cpp keeps the tables it adds (not multiplies) in f32: its graph adds them to f32 activations
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32 or name.startswith(("position_embd",
                                                                                           "token_types")):
            writer.add_tensor(name, array)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__.strip().splitlines()[3].strip())
    print(write_bert_gguf(sys.argv[1], sys.argv[2], *sys.argv[3:]))
