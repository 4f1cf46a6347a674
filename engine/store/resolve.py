"""Model references -> a local file (or checkpoint directory) path.

    None            the default built-in model (fetched on first use)
    path/to/x.gguf  an existing file, used as is
    smollm2-135m    a built-in name or alias (fetched on first use, offline afterwards)
    minilm-l6       a built-in directory model: resolves to its published directory, not a file (the sentence
                    encoder's loader reads config, tokenizer and weights from it)
    hf:OWNER/REPO[:QUANT | :FILE.gguf | :safetensors]   pulled from a Hugging Face hub on first use
                                                          (engine/store/hf.py), offline afterwards
    a directory     a Hugging Face safetensors checkpoint (config.json, *.safetensors, tokenizer.json)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.errors import ModelNotFound
from engine.store import builtin

__all__ = ["resolve_model_ref"]

Progress = Callable[[str, int, "int | None"], None]


def _known() -> str:
    names = []
    for model in builtin.BUILTINS.values():
        label = model.name + (" (default)" if model.name == builtin.DEFAULT_MODEL else "")
        names.append(label)
    return "built-in models: " + ", ".join(names)


def resolve_model_ref(ref: str | None = None, *, progress: Progress | None = None, offline: bool = False) -> Path:
    """The local file (or directory) a model reference names, fetching a built-in model into the cache if needed.

    Raises ModelNotFound for a reference that names nothing (one line, listing the built-in names) and
    FetchError when fetching a built-in model fails.
    """
    if ref is None or not str(ref).strip():
        return builtin.ensure_builtin(builtin.DEFAULT_MODEL, progress=progress, offline=offline)
    ref = str(ref).strip()
    if ref.lower().startswith("hf:"):
        from engine.store.hf import resolve_hf  # huggingface_hub only when a hf: reference is named

        return resolve_hf(ref, progress=progress, offline=offline)
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if any(path.glob("*.safetensors")):
            return path  # models/hf_checkpoint.py reads it (and says what is missing)
        raise ModelNotFound(f"{ref!r} is a directory, not a model file")
    model = builtin.lookup(ref)
    if model is not None:
        return builtin.ensure_builtin(model, progress=progress, offline=offline)
    if "/" in ref or "\\" in ref or ref.lower().endswith(".gguf"):
        raise ModelNotFound(f"no such file: {ref} ({_known()})")
    raise ModelNotFound(f"unknown model {ref!r}: not a file and not a built-in name ({_known()})")
