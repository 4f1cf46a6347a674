"""goinfer's engine: load real checkpoints and generate with them.

Public API (documented in docs/python-api.md):
    load_model(ref, quant=None) -> Model
    generate(model, prompt_ids, max_tokens=..., temperature=0.0, seed=None, stop=None, ...) -> iterator of TokenEvent
    set_threads(n) / get_threads(): threads used by the kernels and BLAS (default: every core)
"""

from engine.errors import (ContextOverflow, FetchError, GoinferError, InvalidRequest, ModelLoadError,
                           ModelNotFound, TemplateError, UnsupportedModel)
from engine.generate import TokenEvent, generate
from engine.kernels.threads import get_threads, set_threads
from engine.load import load_model
from engine.models.base import Model

__all__ = ["load_model", "generate", "set_threads", "get_threads", "Model", "TokenEvent", "GoinferError", "ModelLoadError", "UnsupportedModel",
           "ModelNotFound", "FetchError", "TemplateError", "ContextOverflow", "InvalidRequest"]
