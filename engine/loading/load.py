"""load_model: model reference -> ready Model (file opened, checked, tokenizer and template built).

Cheap checks come first (file, header, architecture, tensor types) so a bad model is refused
before any heavy work.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from engine.errors import InvalidRequest, ModelLoadError
from engine.formats.gguf import open_gguf
from engine.kernels.registry import load_backend
from engine.kernels.memory import release_free_memory, tune_allocator
from engine.models.base import Model
from engine.models.config import with_context
from engine.models.hf_checkpoint import HFCheckpoint, is_hf_checkpoint, loaded_bytes, read_metadata
from engine.models.lora import AdaptedSource, read_adapter
from engine.models.registry import config_from_gguf, family
from engine.models.weights import Weights
from engine.loading.placement import BACKEND_CHOICES, choose, place_on_webgpu
from engine.templates import template_for
from engine.tokenizer import Tokenizer
from engine.tokenizer.hf_json import chat_template, from_hf_directory

# quant mode (what a user asks for) -> the backend's configuration (engine/kernels/backend.py):
# auto: the fast path over the stored blocks: int8 activations at decode, in one compiled call per token; prompts
# dequantize each weight once per chunk and call BLAS. f32: the exact path: weights dequantized per use, f32
# activations everywhere (slow; debugging, oracles).
QUANT_MODES = {"auto": "fast", "f32": "exact"}


def load_model(ref: str | Path | None = None, quant: str | None = None, *, progress=None,
               selftest: bool = True, context: int | None = None, background_compile: bool | str = False,
               backend: str = "cpu", lora: Sequence[tuple[str | Path, float]] = ()) -> Model:
    """Load a model from a .gguf path, a Hugging Face checkpoint directory, a built-in name or an hf: reference
    (None: the default built-in model).

    selftest=False (or GOINFER_NO_SELFTEST=1) skips the once-per-process kernel self-test. context: the window
    the caller means to use; past the model's default one, a model with long-context RoPE factors (Phi-3's
    LongRoPE) switches to them for good (models/config.py: with_context). background_compile: where the compiled
    decode step is not in numba's cache yet, a detached process compiles it and the model decodes without it
    until then (kernels/cpu/step_compile.py; a first `goinfer chat` answers without the minute or two of compile);
    True or "detached": that process may outlive this one (a one-shot chat), "tied": it ends with this one (a server).
    backend: cpu | webgpu | auto (engine/loading/placement.py); the model's `placement` says what it got and why.
    lora: (PEFT adapter directory, multiplier) pairs merged into the weights at load (models/lora.py).
    """
    quant = quant or "auto"
    if quant not in QUANT_MODES:
        raise InvalidRequest(f"unknown quant mode {quant!r} (choose from: {', '.join(QUANT_MODES)})")
    if backend not in BACKEND_CHOICES:  # before any file is read
        raise InvalidRequest(f"unknown backend {backend!r} (choose from: {', '.join(BACKEND_CHOICES)})")
    path = _resolve(ref, progress)
    tune_allocator()
    if is_hf_checkpoint(path):  # converted at load into the GGUF image llama.cpp's converter would write
        meta = read_metadata(path)[2]
        vocab = int(meta[f"{meta['general.architecture']}.vocab_size"])
        tokenizer = from_hf_directory(path, vocab)  # before the conversion: a missing tokenizer costs nothing
        check_memory(path, loaded_bytes(path, quantize=QUANT_MODES[quant] == "fast"))
        # with adapters, converted unquantized: an adapted matrix is quantized once, after its merge
        source = HFCheckpoint(path, quantize=QUANT_MODES[quant] == "fast" and not lora)
        meta = source.metadata
        meta["tokenizer.chat_template"] = chat_template(path)
    else:
        source, vocab = _open_checked(path)
        meta = source.metadata
        tokenizer = None
    config = config_from_gguf(meta, vocab)
    source.check_tensor_types()
    fam = family(config.arch)
    adapters = [read_adapter(p, m) for p, m in lora]
    if adapters:  # merged once here: the weights below are the adapted model's
        source = AdaptedSource(source, adapters, config, fam, exact=QUANT_MODES[quant] == "exact",
                               quantize_stored=is_hf_checkpoint(path) and QUANT_MODES[quant] == "fast")
    weights = Weights(source)
    config = with_context(config, context, weights.has)
    weights.require(["token_embd", fam.final_norm]
                    + [f"blk.{i}.{n}" for i in range(config.n_layer) for n in fam.tensors_of(config, i)])
    if tokenizer is None:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    release_free_memory()  # building a 262k-token vocabulary leaves ~80 MB of freed heap behind
    template = template_for(config.arch, meta.get("tokenizer.chat_template"),
                            bos_token=tokenizer.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
                            eos_token=tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else "")
    skip = not selftest or os.environ.get("GOINFER_NO_SELFTEST", "").strip() not in ("", "0")
    matrices = _matrices(weights, config, fam)
    adapter, placement = choose(backend, config, weights, matrices)
    if adapter is not None:
        resident = place_on_webgpu(adapter, config, weights, matrices, placement, selftest=not skip)
        if resident is not None:
            model = Model(path=path, config=config, weights=weights, forward=resident.forward, backend=resident,
                          tokenizer=tokenizer, template=template, quant=quant, metadata=meta)
            model.placement = placement
            model.adapters = [a.identity() for a in adapters]
            return model
    compile_command = None
    if background_compile:
        compile_command = [sys.executable, "-m", "engine.loading.precompile", str(path), quant]
        if background_compile == "tied":
            compile_command += ["--tied", str(os.getpid())]
    cpu = load_backend("cpu", QUANT_MODES[quant], selftest=not skip, background_compile=compile_command)
    cpu.prepare(config, weights, fam.decode_step_flags(config), matrices)
    model = Model(path=path, config=config, weights=weights, forward=fam.forward, backend=cpu,
                  tokenizer=tokenizer, template=template, quant=quant, metadata=meta)
    model.placement = placement
    model.adapters = [a.identity() for a in adapters]
    return model


def check_model_file(ref: str | Path | None) -> None:
    """The cheap checks of a local .gguf reference (the file, its header, its architecture and tensor types,
    whether it fits in memory), without loading it: for a server that reports a bad model before it listens.
    Other references (built-in names, hf:, checkpoint directories) are checked as they load."""
    if ref is None or Path(ref).suffix != ".gguf" or str(ref).lower().startswith("hf:"):
        return
    source, vocab = _open_checked(Path(ref))
    family(config_from_gguf(source.metadata, vocab).arch)
    source.check_tensor_types()


def _open_checked(path: Path):
    """A GGUF file (one, or every shard of a split model read as one) whose weights fit in memory, and its
    vocabulary size."""
    source = open_gguf(path)
    check_memory(path, sum(e.nbytes or 0 for e in source.entries.values()))
    tokens = source.metadata.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(source.metadata.get(f"{source.architecture}.vocab_size", 0))
    return source, vocab


def check_memory(path: Path, weights_bytes: int) -> None:
    """Refuse a model whose weights alone are more than the memory available (cgroup limits included): loading it
    would end in swapping or the OOM killer, after minutes, with no word of why. GOINFER_NO_MEMORY_CHECK=1 loads it
    anyway (e.g. where the weights are already in the page cache and /proc/meminfo cannot tell)."""
    if os.environ.get("GOINFER_NO_MEMORY_CHECK", "").strip() not in ("", "0"):
        return
    from engine.loading.hardware import memory_info

    available = memory_info()["available_bytes"]
    if available is not None and weights_bytes > available:
        gib = 1 << 30
        raise ModelLoadError(f"{Path(path).name} needs {weights_bytes / gib:.1f} GiB for its weights and "
                             f"{available / gib:.1f} GiB of memory is available: it cannot run here (a smaller "
                             "quant would; GOINFER_NO_MEMORY_CHECK=1 loads it anyway)")


def _matrices(weights: Weights, config, fam) -> list[str]:
    """The model's matrices (not the norms): what its load self-tests the kernels on."""
    names = ["token_embd"] + (["output"] if weights.has("output") else [])
    names += [f"blk.{i}.{n}" for i in range(config.n_layer) for n in fam.tensors_of(config, i)]
    names = [n for n in names if weights.has_weight(n)]
    return [n for n in names if len(weights.tensor(n).shape) == 2 and weights.tensor(n).rows > 1]


def _resolve(ref, progress) -> Path:
    if ref is not None and Path(ref).suffix == ".gguf" and not str(ref).lower().startswith("hf:"):
        return Path(ref)  # a file path: GGUFFile reports a missing file itself
    from engine.store import resolve_model_ref  # the store fetches built-in models on first use

    return resolve_model_ref(None if ref is None else str(ref), progress=progress)
