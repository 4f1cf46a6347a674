"""goinfer's engine: load real checkpoints and generate with them.

Public API (documented in docs/python-api.md):
    load_model(ref, quant=None) -> Model
    generate(model, prompt_ids, max_tokens=..., sampling=SamplingParams(...) or temperature=..., seed=..., ...)
        -> iterator of TokenEvent
    set_threads(n) / get_threads(): threads used by the kernels and BLAS (default: every core)
"""

import os

# OpenBLAS's workers spin for 2^28 cycles after each BLAS call before they sleep; after a prompt's sgemms they
# held the cores the decode step's threads needed, and its first tokens ran markedly slower. 2^16 cycles keeps
# them warm across back-to-back calls only (docs/benchmarks.md, "Measurements behind the code", OpenBLAS thread
# timeout). Read when numpy first loads OpenBLAS, hence here, before any import; a value the user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

from engine.errors import (ContextOverflow, FetchError, GoinferError, InvalidRequest, ModelLoadError,
                           ModelNotFound, TemplateError, UnsupportedModel)
from engine.generation.generate import TokenEvent, generate
from engine.kernels.threads import get_threads, set_threads
from engine.loading.load import load_model
from engine.models.base import Model

__all__ = ["load_model", "generate", "set_threads", "get_threads", "Model", "TokenEvent", "GoinferError", "ModelLoadError", "UnsupportedModel",
           "ModelNotFound", "FetchError", "TemplateError", "ContextOverflow", "InvalidRequest"]
