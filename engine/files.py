"""File-system helpers shared by the model store, the kernel cache and the batch runner: the goinfer home,
exclusive locks and directory fsync.

Why they exist: two processes must not write one model (a fetch or a pull) or one batch output at once,
so each takes an exclusive fcntl lock first; and a rename or a newly created file is durable only once its
directory is fsynced, so each publish fsyncs the directory it renamed into.

Both degrade quietly where the platform lacks them (Windows: no fcntl, no fsync of a directory): the
atomic renames still keep the cache sane, and the files' own data is still fsynced.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process locks
    fcntl = None

__all__ = ["fsync_dir", "goinfer_home", "kernels_dir", "lock_exclusive", "locked"]


def goinfer_home() -> Path:
    """Where goinfer keeps what it fetches and builds (models, compiled kernels): $GOINFER_HOME, else
    ~/.cache/goinfer. Read at each call, so tests and users can change it."""
    value = os.environ.get("GOINFER_HOME")
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "goinfer"


def kernels_dir() -> Path:
    """The compiled kernels of every version and CPU (engine/kernels/kernel_cache.py lays it out)."""
    return goinfer_home() / "kernels"


def lock_exclusive(file: int | IO, *, blocking: bool = True) -> bool:
    """Take an exclusive fcntl lock on an open file (a descriptor or a file object); closing it releases it.

    Blocking (the default), wait for another process holding it; with blocking=False, return False at
    once instead. True when the lock is held, and always where fcntl is missing (no lock is taken)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(file, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def locked(path: Path, *, on_wait: Callable[[], None] | None = None,
           error: type[Exception] = OSError) -> Iterator[None]:
    """Hold an exclusive lock on the lock file `path` for the `with` block.

    The file (and its directory) is created when missing and left in place. When another process holds
    the lock, `on_wait()` is called once, then the lock is waited for. A lock file that cannot be created
    raises `error("cannot create a lock file PATH: why")`. Where fcntl is missing, nothing is locked or
    created."""
    if fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+b")
    except OSError as exc:
        raise error(f"cannot create a lock file {path}: {exc}") from None
    with handle:
        if not lock_exclusive(handle, blocking=False):
            if on_wait is not None:
                on_wait()
            lock_exclusive(handle)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so that a rename into it (or a file created in it) survives a power cut.

    Failures are ignored: not every platform can open or fsync a directory (Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write a small file whole: to a temporary name, fsynced, renamed over `path`, its directory fsynced; a crash
    leaves the old file or the new one, never part of one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
