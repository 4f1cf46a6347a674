"""The supported families: one record each (`Family`, declared in the family's own file; adding a family is its
file and one entry in _ALL), and what is derived from them: architecture -> family, the supported-architecture list, Hugging Face model_type -> architecture,
and the configuration of a GGUF's metadata."""

from __future__ import annotations

from typing import Any

from engine.errors import UnsupportedModel
from engine.models import gemma2, gemma3, gemma4, gpt_oss, lfm2, llama, phi3, qwen2, qwen3, qwen3moe, qwen35
from engine.models.config import ModelConfig
from engine.models.family import Family

_ALL = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, phi3.FAMILY, gemma2.FAMILY, gemma3.FAMILY, qwen3moe.FAMILY,
        qwen35.FAMILY, qwen35.MOE_FAMILY, gpt_oss.FAMILY, lfm2.FAMILY, gemma4.FAMILY)
FAMILIES: dict[str, Family] = {arch: f for f in _ALL for arch in f.gguf_archs}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# config.json model_type -> architecture, for the families whose safetensors checkpoints load (Family.hf_keys)
HF_MODEL_TYPES = {t: f.gguf_archs[0] for f in _ALL if f.hf_keys is not None for t in f.hf_model_types}


def family(arch: str) -> Family:
    try:
        return FAMILIES[arch]
    except KeyError:
        raise UnsupportedModel(f"architecture {arch or '(none)'!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})") from None


def config_from_gguf(meta: dict[str, Any], vocab_size: int) -> ModelConfig:
    """The configuration of a GGUF's metadata, read by its family (UnsupportedModel for any other)."""
    return family(str(meta.get("general.architecture", ""))).read_config(meta, vocab_size)
