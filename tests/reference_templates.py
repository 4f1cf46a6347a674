"""Real chat templates for the tests, fetched from PyPI into the goinfer cache (never committed to this repo).

Why from there: the llama-cpp-python source distribution vendors llama.cpp's `models/templates/`, the chat
templates of real models (Qwen3, Qwen3.5, DeepSeek-R1 distills, Gemma 4, gpt-oss) exactly as their Hub
repositories ship them.
PyPI keeps every release, so one pinned version gives the same bytes forever, and its index publishes the
sdist's sha256; our own sha256 pin per template then guards the member we actually use.

Layout: <home>/templates/llama-cpp-python-0.3.36/<name>.jinja. When every template is cached and matches its
pin, nothing touches the network. Otherwise the sdist (76 MB) is downloaded once into <home>/staging/ under an
exclusive lock (a second process waits, then finds the files published), the members are read straight from
the tarball (nothing is extracted to disk under the archive's own paths), each is checked against its pin and
published with os.replace, and the tarball is deleted. A cached copy that no longer matches its pin (edited,
truncated by a crash outside our atomic publish) counts as missing: it is refetched, never served. A download
whose member does not match its pin raises FetchError and publishes nothing.

Prefetch from a shell (CI does): python -m tests.reference_templates
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

from engine.errors import FetchError
from engine.files import fsync_dir, locked
from engine.store.paths import goinfer_home, locks_dir, staging_dir

__all__ = ["PINS", "RELEASE", "cache_dir", "ensure_reference_templates", "reference_template"]

PROJECT = "llama-cpp-python"
VERSION = "0.3.36"
RELEASE = f"{PROJECT}-{VERSION}"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
MEMBER_DIR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/templates"

# name -> sha256 of models/templates/<name>.jinja in the sdist above.
PINS: dict[str, str] = {
    "Qwen-Qwen3-0.6B": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
    "Qwen3.5-4B": "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "bbe594884b44d740667ee65a70bc8d333a565eab3d63ea59f291ea73ada84ba6",
    "google-gemma-4-31B-it": "85a08664d16d8f3be4416c92427b3ac10df1024ac566cc0b4bc3bab409393f98",
    "openai-gpt-oss-120b": "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
}

_STAGING_PREFIX = f"{RELEASE}-templates."


def cache_dir() -> Path:
    """Where the templates are published (read at each call, so a test can point GOINFER_HOME elsewhere)."""
    return goinfer_home() / "templates" / RELEASE


def reference_template(name: str) -> str:
    """The text of the pinned template `name` (a key of PINS), fetching all of them first when needed."""
    if name not in PINS:
        raise KeyError(f"unknown reference template {name!r} (known: {', '.join(PINS)})")
    path = ensure_reference_templates()[name]
    data = path.read_bytes()
    _check(name, data, f"{path}")  # re-read after publishing: the text returned is the text verified
    return data.decode("utf-8")  # bytes, not read_text: no newline translation may touch the template


def ensure_reference_templates() -> dict[str, Path]:
    """Every pinned template's published path: a no-op when all are cached and verify, else one fetch."""
    if _all_cached():
        return _paths()
    with locked(locks_dir() / f"{RELEASE}-templates.lock", error=FetchError):
        if _all_cached():  # another process published them while we waited for the lock
            return _paths()
        _remove_stale_staging()
        try:
            staging_dir().mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=staging_dir()))
        except OSError as exc:
            raise FetchError(f"cannot create a staging directory under {staging_dir()}: {exc}") from None
        try:
            _fetch_and_publish(staging)
        except OSError as exc:  # disk full, permissions: one line, like the model fetches
            raise FetchError(f"fetching the {RELEASE} chat templates failed: {exc}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _paths()


# --- internals --------------------------------------------------------------------------------------------


def _paths() -> dict[str, Path]:
    return {name: cache_dir() / f"{name}.jinja" for name in PINS}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check(name: str, data: bytes, where: str) -> None:
    got = _digest(data)
    if got != PINS[name]:
        raise FetchError(f"{where}: sha256 mismatch for template {name} (pinned {PINS[name][:16]}..., "
                         f"got {got[:16]}...)")


def _all_cached() -> bool:
    """True when every template is published and matches its pin (a few KB each: hashing them is cheap)."""
    for name, path in _paths().items():
        try:
            data = path.read_bytes()
        except OSError:
            return False
        if _digest(data) != PINS[name]:
            return False
    return True


def _remove_stale_staging() -> None:
    # Called under the lock, so any staging of ours belongs to a fetch that died.
    root = staging_dir()
    if root.is_dir():
        for stale in root.glob(f"{_STAGING_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)


def _fetch_and_publish(staging: Path) -> None:
    from engine.store.pypi import SimpleIndex  # httpx only when something must be fetched

    tarball = staging / SDIST
    with SimpleIndex() as index:
        files = [f for f in index.files(PROJECT) if f.filename == SDIST]
        if not files:
            raise FetchError(f"{SDIST} is not on the package index {index.url}")
        index.download(files[0], tarball, _progress)  # checks the index's sha256 when it gives one
    members = _read_members(tarball)
    tarball.unlink()  # 76 MB: gone before anything else happens
    for name, data in members.items():
        _check(name, data, f"{SDIST}:{MEMBER_DIR}/{name}.jinja")
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    for name, data in members.items():
        part = staging / f"{name}.jinja"
        with open(part, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(part, target / f"{name}.jinja")  # atomic: readers see the old file or the verified one
    fsync_dir(target)


def _read_members(tarball: Path) -> dict[str, bytes]:
    """The pinned members' bytes, read in one streaming pass over the archive (it lists ~3,000 files)."""
    wanted = {f"{MEMBER_DIR}/{name}.jinja": name for name in PINS}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(tarball, "r|gz") as archive:
            for info in archive:
                name = wanted.get(info.name)
                if name is None or not info.isfile():
                    continue
                handle = archive.extractfile(info)
                found[name] = handle.read() if handle is not None else b""
                if len(found) == len(wanted):
                    break
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise FetchError(f"{SDIST} is not a readable tar.gz: {exc}") from None
    missing = [f"{MEMBER_DIR}/{name}.jinja" for name in PINS if name not in found]
    if missing:
        raise FetchError(f"{SDIST} has no member {', '.join(missing)}")
    return found


def _progress(description: str, done: int, total: int | None) -> None:
    # One line when the download starts, on stderr: CI sends stdout (the paths) to /dev/null.
    if done == 0:
        size = f" ({total / 1e6:.1f} MB)" if total else ""
        print(f"{description}{size} for the reference chat templates", file=sys.stderr, flush=True)


def main() -> int:
    try:
        paths = ensure_reference_templates()
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
