"""What the goinfer cache holds, and removing entries (`goinfer cache`, `goinfer cache rm`).

Complete entries are the published built-in files (or directories) and hf: pulls (a directory with manifest.json);
incomplete ones are pulls left in staging by an interrupted run (the next pull of the same reference
resumes them). One more entry, "kernels", is the compiled CPU kernels (engine/kernels/kernel_cache.py): every
version and CPU, removed whole (they compile again on next use). Nothing here touches the network.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.errors import ModelNotFound
from engine.store import builtin
from engine.store.hfref import MANIFEST, parse_hf_ref, read_manifest
from engine.files import kernels_dir
from engine.store.paths import models_dir, staging_dir

KERNELS = "kernels"  # the kernel cache's name in the listing and for `cache rm`

__all__ = ["CacheEntry", "list_cache", "remove"]


@dataclass(frozen=True)
class CacheEntry:
    name: str  # what to pass to --model (and to `cache rm`)
    kind: str  # "builtin", "gguf" or "safetensors"
    size: int  # bytes on disk
    complete: bool
    path: str  # the file to load (complete GGUF), else the directory (a built-in directory model's too)

    def to_json(self) -> dict:
        return asdict(self)


def _dir_size(path: Path, *, hidden: bool = False) -> int:
    """Bytes of the files under `path`. Dot-files are bookkeeping (a pull's .plan.json, partial downloads) and
    left out unless `hidden`: a built-in directory's own dot-files (.gitattributes) are part of the model."""
    return sum(p.stat().st_size for p in path.rglob("*")
               if p.is_file() and (hidden or not p.name.startswith(".")))


def list_cache() -> list[CacheEntry]:
    entries: list[CacheEntry] = []
    for model in builtin.BUILTINS.values():
        path = builtin.model_path(model)
        if path.is_file():
            size = path.stat().st_size
        elif path.is_dir():  # a directory model (BuiltinDirModel); complete when every pinned file is whole
            size = _dir_size(path, hidden=True)
        else:
            continue
        entries.append(CacheEntry(model.name, "builtin", size, builtin.cached_path(model) is not None, str(path)))
    hf_root = models_dir() / "hf"
    if hf_root.is_dir():
        for manifest_path in sorted(hf_root.glob(f"*/*/*/{MANIFEST}")):
            directory = manifest_path.parent
            m = read_manifest(directory)
            if not m:
                continue
            entry = directory / m["entry"] if m.get("entry") else directory
            entries.append(CacheEntry(m["ref"], m.get("kind", "gguf"), _dir_size(directory), True, str(entry)))
    staging = staging_dir()
    if staging.is_dir():
        for d in sorted(staging.glob("hf--*")):
            stamp = d / ".plan.json"
            try:
                plan = json.loads(stamp.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            ref = plan.get("ref")
            if ref:
                entries.append(CacheEntry(ref, plan.get("kind", "gguf"), _dir_size(d), False, str(d)))
    if _has_kernels():
        kernels = kernels_dir()
        entries.append(CacheEntry(KERNELS, KERNELS, _dir_size(kernels, hidden=True), True, str(kernels)))
    return entries


def _has_kernels() -> bool:
    """Compiled kernels are there (numba makes its directories as soon as the kernel modules are imported)."""
    return kernels_dir().is_dir() and any(p.is_file() for p in kernels_dir().rglob("*"))


def remove(name: str) -> list[str]:
    """Delete a cached model (complete or not) by the name `cache` lists; returns the paths removed."""
    removed: list[str] = []
    model = builtin.lookup(name)
    if name == KERNELS:
        if _has_kernels():
            removed.append(str(kernels_dir()))
        shutil.rmtree(kernels_dir(), ignore_errors=True)
    elif model is not None:
        target = builtin.model_path(model).parent
        if target.is_dir():
            shutil.rmtree(target)
            removed.append(str(target))
    elif name.strip().lower().startswith("hf:"):
        ref = parse_hf_ref(name)
        refs = [ref] if ref.selector else [
            parse_hf_ref(e.name) for e in list_cache() if e.kind != "builtin" and parse_hf_ref(e.name).repo == ref.repo
            and parse_hf_ref(e.name).revision == ref.revision]
        for r in refs:
            for target in (r.published_dir, r.staging_dir):
                if target.is_dir():
                    shutil.rmtree(target)
                    removed.append(str(target))
        parent = models_dir() / "hf" / ref.repo
        for d in (parent, parent.parent):  # drop emptied OWNER/REPO and OWNER directories
            try:
                d.rmdir()
            except OSError:
                break
    if not removed:
        names = ", ".join(e.name for e in list_cache()) or "the cache is empty"
        raise ModelNotFound(f"{name!r} is not in the cache ({names})")
    return removed
