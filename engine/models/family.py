"""`Family`: the record a family's file declares: what it loads (GGUF architectures, Hugging Face model types),
how it reads its configuration, the tensors its blocks need, its forward pass, what a compiled decode step
needs of it, and how its Hugging Face checkpoints differ from its GGUFs. models/registry.py collects them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from engine.kernels.backend import Backend, KVCache
from engine.models.config import ModelConfig
from engine.models.weights import Weights

ForwardFn = Callable[[ModelConfig, Weights, Backend, np.ndarray, KVCache], np.ndarray]


@dataclass(frozen=True)
class Family:
    name: str
    gguf_archs: tuple[str, ...]  # general.architecture values it loads
    hf_model_types: tuple[str, ...]  # config.json model_type values it loads
    read_config: Callable[[dict[str, Any], int], ModelConfig]  # GGUF metadata, vocabulary size -> config
    layer_tensors: tuple[str, ...]  # the matrices and norms every block must have
    forward: ForwardFn  # the prompt pass over the backend's ops
    step_flags: Callable[[ModelConfig], dict] | None  # what a compiled decode step needs; None: no step
    # Hugging Face checkpoints (models/hf_checkpoint.py): the GGUF keys of the family's own config.json fields
    # (models/hf_config.py maps the shared ones); None: safetensors directories of this family are refused.
    hf_keys: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    hf_norm_offset: float = 0.0  # added to RMSNorm weights (Gemma stores w where GGUF holds 1 + w)
    final_norm: str = "output_norm"  # the norm after the last block (LFM2: token_embd_norm)
    # Blocks of more than one kind (hybrids): the tensors block i must have, in place of layer_tensors.
    block_tensors: Callable[[ModelConfig, int], tuple[str, ...]] | None = None
    # Hugging Face tensors the converter reshapes or reorders for the family's GGUF layout: those whose GGUF
    # name's stem (`ssm_a` of `blk.0.ssm_a`) is in hf_reshaped go through hf_tensor(GGUF name, f32 values,
    # config) -> the values as the GGUF stores them (models/hf_checkpoint.py). Norms in hf_plain_norms get no
    # hf_norm_offset.
    hf_reshaped: frozenset[str] = frozenset()
    hf_aliases: tuple[tuple[str, str], ...] = ()  # (Hugging Face name part, the spelling gguf's name map knows)
    hf_view: Callable[[Any], Any] | None = None  # the safetensors as the converter sees them (split fused tensors)
    hf_generated: Callable[[dict[str, Any]], dict[str, np.ndarray]] | None = None  # tensors the converter makes
    hf_tensor: Callable[[str, np.ndarray, ModelConfig], np.ndarray] | None = None
    hf_plain_norms: frozenset[str] = frozenset()

    def tensors_of(self, cfg: ModelConfig, layer: int) -> tuple[str, ...]:
        """The tensors block `layer` must have."""
        return self.block_tensors(cfg, layer) if self.block_tensors else self.layer_tensors

    def decode_step_flags(self, cfg: ModelConfig) -> dict | None:
        """What a compiled decode step needs of this family (Backend.prepare), None: no step. Its step_flags, and
        what the record declares already: the norm after the last block, and the norm before the MLP (`ffn_norm`,
        or `post_attention_norm` where the blocks have no ffn_norm: Qwen3.5, gpt-oss)."""
        if self.step_flags is None:
            return None
        ffn_norm = "ffn_norm" if "ffn_norm" in self.tensors_of(cfg, 0) else "post_attention_norm"
        return {**self.step_flags(cfg), "final_norm": self.final_norm, "ffn_norm": ffn_norm}


def no_hf_keys(config: dict[str, Any]) -> dict[str, Any]:
    """A family whose config.json holds nothing beyond the shared fields."""
    return {}
