"""load_model: model reference -> ready Model (file opened, checked, tokenizer and template built).

Cheap checks come first (file, header, architecture, tensor types) so a bad model is refused
before any heavy work.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from engine.errors import InvalidRequest
from engine.formats.gguf import open_gguf
from engine.kernels.backend import get_backend
from engine.memory import release_free_memory, tune_allocator
from engine.models import decode_step
from engine.models.base import Model
from engine.models.config import config_from_gguf
from engine.models.registry import family
from engine.models.weights import Weights
from engine.templates import template_for
from engine.tokenizer import Tokenizer

# auto: the fast path over the stored blocks: decode runs the int8-activation kernels in one compiled call per
# token (engine/models/decode_step.py), prompts dequantize each weight once per chunk and call BLAS.
# f32: the exact path: weights dequantized per use, f32 activations everywhere (slow; debugging, oracles).
QUANT_MODES = ("auto", "f32")
COMPUTE_PATH = {"auto": "int8", "f32": "f32"}  # quant mode -> the kernels that actually run


def load_model(ref: str | Path | None = None, quant: str | None = None, *, progress=None,
               selftest: bool = True) -> Model:
    """Load a model from a .gguf path, a built-in name or an hf: reference (None: the default built-in model).

    selftest=False (or GOINFER_NO_SELFTEST=1) skips the once-per-process kernel self-test.
    """
    quant = quant or "auto"
    if quant not in QUANT_MODES:
        raise InvalidRequest(f"unknown quant mode {quant!r} (choose from: {', '.join(QUANT_MODES)})")
    path = _resolve(ref, progress)
    tune_allocator()
    gguf = open_gguf(path)  # one file, or every shard of a split model read as one
    meta = gguf.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(meta.get(f"{gguf.architecture}.vocab_size", 0))
    config = config_from_gguf(meta, vocab)
    gguf.check_tensor_types()
    fam = family(config.arch)
    weights = Weights(gguf)
    weights.require(["token_embd", "output_norm"]
                    + [f"blk.{i}.{n}" for i in range(config.n_layer) for n in fam.LAYER_TENSORS])
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    release_free_memory()  # building a 262k-token vocabulary leaves ~80 MB of freed heap behind
    template = template_for(config.arch, meta.get("tokenizer.chat_template"),
                            bos_token=tokenizer.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
                            eos_token=tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else "")
    path_name = COMPUTE_PATH[quant]
    if kernels_uncompiled():  # say why the first run after install sits silent for a minute
        print("goinfer: compiling the CPU kernels for this machine (first run only: about a minute)",
              file=sys.stderr, flush=True)
    backend, slow = cpu_backend(selftest, "cpu-q8" if path_name == "int8" else "cpu")
    step = None
    flags = getattr(fam, "STEP_FLAGS", None)
    if path_name == "int8" and not slow & _matrix_types(weights, config, fam) and decode_step.supported(config, weights,
                                                                                                     flags):
        # The layers' and the head's legacy-block matrices in the row-interleaved layout of the decode kernels
        # (same bytes, anonymous memory; their mapped pages are let go). Not for split models: those decode
        # layer by layer.
        weights.pack([f"blk.{i}.{r}" for i in range(config.n_layer) for r in decode_step.ROLES]
                     + ["output" if weights.has("output") else "token_embd"])
        step = decode_step.build(config, weights, flags)
    return Model(path=path, config=config, weights=weights, forward=fam.forward, backend=backend, step=step,
                 tokenizer=tokenizer, template=template, quant=quant, compute_path=path_name, metadata=meta)


def cpu_backend(selftest: bool = True, name: str = "cpu"):
    """(backend, types stepped down) for the CPU backend `name`, after the kernel self-test (first load of the
    process): a type whose fast kernel disagreed with the reference runs on the reference tier instead."""
    from engine.kernels import selftest as st

    if not selftest or os.environ.get("GOINFER_NO_SELFTEST", "").strip() not in ("", "0"):
        st.mark_skipped()
        return get_backend(name), frozenset()
    st.run_selftest(warn=lambda line: print(f"goinfer: {line}", file=sys.stderr, flush=True),
                    kernels=st.PATH_KERNELS[name])
    slow = st.disabled_types()
    if not slow:
        return get_backend(name), slow
    return st.TieredBackend(get_backend(name), get_backend(st.TIERS[1]), slow), slow


def kernels_uncompiled() -> bool:
    """True when numba's on-disk cache holds no compiled decode step for this code (a fresh install, or an
    upgrade): the kernels will compile now, which takes 40-75 s on a 2-core machine. Reads numba's cache
    index through private attributes; anything unexpected counts as compiled (no message)."""
    try:
        return not decode_step.decode_step._cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - a numba version without these internals: stay silent
        return False


def _matrix_types(weights: Weights, config, fam) -> frozenset[int]:
    names = ["token_embd"] + (["output"] if weights.has("output") else [])
    names += [f"blk.{i}.{n}" for i in range(config.n_layer) for n in fam.LAYER_TENSORS]
    return frozenset(int(weights.tensor(n).ggml_type) for n in names)


def _resolve(ref, progress) -> Path:
    if ref is not None and Path(ref).suffix == ".gguf" and not str(ref).lower().startswith("hf:"):
        return Path(ref)  # a file path: GGUFFile reports a missing file itself
    from engine.store import resolve_model_ref  # the store fetches built-in models on first use

    return resolve_model_ref(None if ref is None else str(ref), progress=progress)
