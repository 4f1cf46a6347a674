"""A Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files) read as the GGUF that
llama.cpp's converter would make of it, built in memory at load: the same metadata keys (models/hf_config.py
plus the family's `hf_keys`), the same tensor names (gguf's TensorNameMap), the same layouts. Everything
downstream (family configuration, forward pass, backend, compiled decode step) is the GGUF path, unchanged.

What the conversion does, once, here:
- names: Hugging Face tensor names -> GGUF names; a tied head's copy is dropped; MoE experts' matrices are stacked
  into the experts' tensor (`ffn_up_exps`: expert 0's rows, then 1's, ...);
- RoPE layout: Hugging Face rotates the two halves of each head (NeoX); a family whose GGUF rotates adjacent
  pairs (llama) gets its q/k rows permuted, as the converter does;
- Gemma's RMSNorm weights get their +1 (`Family.hf_norm_offset`);
- the RoPE factors a config describes become the tensors the converter writes (`rope_freqs`, LongRoPE's);
- storage: the exact path keeps every matrix's stored numbers (bf16/f16/f32, widened to f32 as they are used);
  the default path quantizes matrices to Q8_0 blocks so they run on the int8 kernels. Vectors are f32.
All tensors lie in one anonymous buffer, as a GGUF's lie in its mapping, so the compiled decode step runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from engine.errors import ModelLoadError, UnsupportedModel
from engine.formats.checkpoint_json import read_json_object
from engine.formats.safetensors import SafetensorsCheckpoint, to_f32
from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType, QTensor
from engine.models import hf_config
from engine.models.family import Family
from engine.models.registry import HF_MODEL_TYPES, family
from engine.models.tensor_image import TensorImage, aligned_buffer

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)(?P<suffix>\..+)$")  # model.layers.0.mlp.experts.3.up_proj.weight
_STORED = {"F32": GGMLType.F32, "F16": GGMLType.F16, "BF16": GGMLType.BF16}
_WORDS = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint16): "BF16"}  # stored words


def is_hf_checkpoint(path: Path) -> bool:
    """A directory is read as a checkpoint (what it lacks, config.json or shards, is then named)."""
    return path.is_dir()


def read_metadata(directory: Path) -> tuple[dict[str, Any], Family, dict[str, Any], dict[str, np.ndarray]]:
    """(config.json's language-model settings, the family, the GGUF metadata of them, generated RoPE tensors)."""
    config = hf_config.text_config(read_json_object(directory / "config.json"))
    model_type = str(config.get("model_type", ""))
    arch = HF_MODEL_TYPES.get(model_type)
    if arch is None and model_type == "bert":  # an encoder: it embeds, it does not chat
        raise UnsupportedModel(f"{directory.name} is an embedding model (BERT encoder), not a chat model: serve it "
                               "with goinfer serve --embed-model")
    if arch is None:
        raise UnsupportedModel(f"{directory.name}: Hugging Face model_type {model_type or '(none)'!r} is not "
                               f"supported (supported: {', '.join(sorted(HF_MODEL_TYPES))})")
    fam = family(arch)
    try:
        meta, generated = hf_config.gguf_metadata(config, arch, directory.name)
        meta.update(fam.hf_keys(config))
        if fam.hf_generated is not None:
            generated.update(fam.hf_generated(config))
    except (TypeError, ValueError) as e:  # a field of the wrong type: a number that is not one
        raise ModelLoadError(f"{directory.name}/config.json: {e}") from None
    except ModelLoadError as e:
        raise type(e)(f"{directory.name}/{e}") from None
    return config, fam, meta, generated


def loaded_bytes(directory: Path, *, quantize: bool) -> int:
    """What the converted weights take in memory (Q8_0 matrices on the default path), from the headers alone."""
    source = SafetensorsCheckpoint(directory)
    total = 0
    for name in source.names:
        shape, stored = source.shape(name), _STORED.get(source.dtype(name))
        n = int(np.prod(shape))
        if len(shape) == 2 and quantize and shape[1] % 32 == 0:
            total += n // 32 * 34
        elif len(shape) == 2 and stored is not None:
            total += n * BLOCK_GEOMETRY[stored][1]
        else:
            total += n * 4
    return total


class HFCheckpoint(TensorImage):
    """The GGUFFile interface (metadata, has, tensor, vector, data) over a converted checkpoint directory."""

    def __init__(self, directory: str | Path, *, quantize: bool):
        self.path = Path(directory)
        config, fam, meta, generated = read_metadata(self.path)
        self.metadata = meta
        cfg = fam.read_config(meta, int(config["vocab_size"]))
        source = SafetensorsCheckpoint(self.path)
        if fam.hf_view is not None:
            source = fam.hf_view(source)
        plan = _plan(source, cfg.arch, cfg.n_layer, tied=bool(config.get("tie_word_embeddings", True)),
                     aliases=fam.hf_aliases)
        permute = {"attn_q": cfg.n_head, "attn_k": cfg.n_head_kv} if cfg.rope_style == "interleaved" else {}
        items: list[tuple[str, np.ndarray, GGMLType]] = []
        for name, srcs in plan.items():
            src, dtype = srcs[0], source.dtype(srcs[0])
            words = source.array(src) if len(srcs) == 1 else np.concatenate([source.array(e) for e in srcs])
            stem = name.split(".")[2] if name.startswith("blk.") else ""
            if stem in permute:  # rows of each head: halves -> adjacent pairs (the converter's permute)
                words = interleave_heads(words, permute[stem])
            if stem in fam.hf_reshaped:  # the family's own layout (reordered heads, reshaped convolutions)
                words, dtype = fam.hf_tensor(name, to_f32(words, dtype), cfg), "F32"
            if words.ndim == 1 or (words.ndim == 2 and words.shape[1] % 32 and quantize):
                values = to_f32(words, dtype)
                if fam.hf_norm_offset and name.endswith("norm.weight") and stem not in fam.hf_plain_norms:
                    values = values + np.float32(fam.hf_norm_offset)
                items.append((name, values.reshape(1, -1) if words.ndim == 1 else values, GGMLType.F32))
            elif words.ndim == 2:
                items.append((name, words, GGMLType.Q8_0 if quantize else _STORED[dtype]))
            else:
                raise UnsupportedModel(f"{self.path.name}: tensor {src!r} has {words.ndim} dimensions")
        items += [(n + ".weight", v.reshape(1, -1), GGMLType.F32) for n, v in generated.items()]
        self._buffer, self._tensors = _lay_out(items)
        self._freeze()

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def check_tensor_types(self) -> None:
        """Every type here was chosen at conversion: nothing to refuse."""


def _plan(source, arch: str, n_layer: int, *, tied: bool,
          aliases: tuple[tuple[str, str], ...] = ()) -> dict[str, list[str]]:
    """GGUF name -> the safetensors names it is made of (one, or every expert's matrix of a stacked expert tensor,
    in expert order), for every tensor the converter would keep."""
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, n_layer)
    plan: dict[str, list[str]] = {}
    experts: dict[str, dict[int, str]] = {}
    for src in source.names:
        m = _EXPERT.match(src)  # one expert's matrix: stacked under the name of the experts' tensor
        known = m["prefix"] + m["suffix"] if m else src
        for part, spelling in aliases:
            known = known.replace(part, spelling)
        name = names.get_name(known, try_suffixes=(".weight", ".bias"))
        if name is None:
            continue  # buffers a checkpoint may carry (rotary inv_freq, ...): the converter drops them too
        if m:
            experts.setdefault(name, {})[int(m["e"])] = src
        else:
            plan[name] = [src]
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ModelLoadError(f"{name}: the checkpoint's experts are not numbered 0..{len(by_index) - 1}")
        plan[name] = [by_index[e] for e in range(len(by_index))]
    if tied and "output.weight" in plan and "token_embd.weight" in plan:
        del plan["output.weight"]
    return plan


def interleave_heads(words: np.ndarray, n_head: int) -> np.ndarray:
    """q/k rows of each head from Hugging Face's order (the two rotated halves) to a GGUF's for adjacent-pair RoPE
    (llama.cpp's converter's permute); also what a LoRA delta of those rows needs (models/lora.py)."""
    rows = words.shape[0]
    return (words.reshape(n_head, 2, rows // n_head // 2, *words.shape[1:]).swapaxes(1, 2)
            .reshape(words.shape))


def _lay_out(items: list[tuple[str, np.ndarray, GGMLType]]) -> tuple[np.ndarray, dict[str, QTensor]]:
    """Write every tensor, converted to its type, into one page-aligned anonymous buffer; QTensor views."""
    sizes = []
    for _, values, gtype in items:
        block, nbytes = BLOCK_GEOMETRY[gtype]
        sizes.append(values.shape[0] * (values.shape[1] // block) * nbytes)
    buf, offsets = aligned_buffer(sizes)
    out = {}
    for (name, values, gtype), off, size in zip(items, offsets, sizes):
        rows = values.shape[0]
        raw = buf[off : off + size].reshape(rows, size // rows)
        if gtype == GGMLType.Q8_0:
            for r0 in range(0, rows, 4096):  # a slab at a time: the f32 copy of a large matrix stays small
                f32 = to_f32(values[r0 : r0 + 4096], _WORDS[values.dtype])
                raw[r0 : r0 + 4096] = gguf.quants.quantize(f32, gguf.GGMLQuantizationType.Q8_0)
        else:
            raw[:] = np.ascontiguousarray(values).view(np.uint8).reshape(rows, -1)
        out[name] = QTensor(name, gtype, (rows, values.shape[1]), raw)
    return buf, out
