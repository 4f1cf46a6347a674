"""`Family`: the record a family's file declares: what it loads (GGUF architectures, Hugging Face model types),
how it reads its configuration, the tensors its blocks need, its forward pass, and what a compiled decode step
needs of it. models/registry.py collects them."""

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
