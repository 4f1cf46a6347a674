"""Ollama's wire format, what it says of models: /api/tags and /api/ps entries, the /api/show object.

Pure functions over the loaded models (a generation Model, or an EmbeddingModel: `kind` says which) and the name
goinfer serves each under. Ollama's fields that goinfer has no counterpart for are filled as Ollama fills them for
a model it did not pull from its registry: `parent_model` "", a digest of the file's identity (its path, size and
date: hashing gigabytes to list them would take minutes), no Modelfile parameters.
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import gguf

from engine.requests.prompts import thinking_of

__all__ = ["VERSION", "ps_entry", "show_object", "tags_entry"]

# The Ollama API version goinfer answers as (/api/version): clients turn features on by it (tools, thinking and
# structured outputs are all there by 0.9).
VERSION = "0.12.6"
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # /api/ps's expires_at: goinfer keeps its models loaded until it stops


def _file(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _date(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def _digest(path: Path, st: os.stat_result | None) -> str:
    ident = f"{Path(path).resolve()}:{st.st_size if st else 0}:{st.st_mtime_ns if st else 0}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _parameters(model, kind: str) -> int | None:
    return model.weights.parameter_count() if kind == "generation" else None  # (an encoder's: not counted)


def _file_type(model, kind: str) -> str:
    """The quantization the file says it holds (general.file_type: Q4_K_M, Q8_0, F16...), "" where it says none."""
    value = (getattr(model, "metadata", None) or {}).get("general.file_type") if kind == "generation" else None
    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else ""
    except ValueError:
        return ""


def _size_label(n: int | None) -> str:
    if not n:
        return ""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}" if n < 100 * scale else f"{n / scale:.0f}{unit}"
    return str(n)


def details(model, kind: str) -> dict:
    path = Path(model.path)
    arch = model.config.arch if kind == "generation" else "bert"
    quant = _file_type(model, kind)
    return {"parent_model": "", "format": "gguf" if path.suffix == ".gguf" else "safetensors", "family": arch,
            "families": [arch], "parameter_size": _size_label(_parameters(model, kind)), "quantization_level": quant}


def _size(path: Path) -> int:
    """The model's bytes on disk: the file, or a checkpoint directory's files."""
    path = Path(path)
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    except OSError:
        return 0


def tags_entry(name: str, model, kind: str = "generation") -> dict:
    st = _file(model.path)
    return {"name": name, "model": name, "modified_at": _date(st.st_mtime if st else 0), "size": _size(model.path),
            "digest": _digest(model.path, st), "details": details(model, kind)}


def ps_entry(name: str, model, context: int, kind: str = "generation") -> dict:
    entry = tags_entry(name, model, kind)
    return {"name": name, "model": name, "size": entry["size"], "digest": entry["digest"],
            "details": entry["details"], "expires_at": _FAR_FUTURE, "size_vram": 0, "context_length": context}


def capabilities(model, kind: str) -> list[str]:
    if kind == "embedding":
        return ["embedding"]
    out = ["completion", "tools"]  # tools: every template (one that does not read them gets a built-in tool prompt)
    if thinking_of(model) is not None:
        out.append("thinking")
    return out


def show_object(name: str, model, context: int, kind: str = "generation") -> dict:
    """/api/show: the details, the template, a model_info of the GGUF keys clients read (architecture, context and
    embedding lengths, the parameter count) and the capabilities (completion, tools, thinking; embedding)."""
    st = _file(model.path)
    arch = model.config.arch if kind == "generation" else "bert"
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": _parameters(model, kind) or 0,
                            f"{arch}.context_length": context}
    if kind == "generation":
        c = model.config
        info.update({f"{arch}.embedding_length": c.n_embd, f"{arch}.block_count": c.n_layer,
                     f"{arch}.attention.head_count": c.n_head, f"{arch}.attention.head_count_kv": c.n_head_kv,
                     f"{arch}.feed_forward_length": c.n_ff, f"{arch}.vocab_size": c.vocab_size})
    else:
        info[f"{arch}.embedding_length"] = model.dimension
    template = model.template.source if kind == "generation" and model.template is not None else ""
    return {"modelfile": f"# served by goinfer as {name}\nFROM {model.path}\n", "parameters": "",
            "template": template, "details": details(model, kind), "model_info": info,
            "capabilities": capabilities(model, kind), "modified_at": _date(st.st_mtime if st else 0)}
