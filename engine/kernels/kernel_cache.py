"""Where the CPU kernels' compiled code is kept: numba's on-disk cache, in the goinfer home, not the install tree.

    <home>/kernels/<tier>-<cpu>/<sources>/   numba's index (.nbi) and machine code (.nbc) files

- In the home, so GOINFER_HOME isolates it, `goinfer cache` shows and removes it, and a read-only install (a
  system package, a container layer) caches too. numba's default wrote into engine/kernels/cpu/__pycache__.
- Keyed on the sources: numba checks a cached function against its own file's timestamp only, so a change in a
  function it calls from another module left the old machine code running. <sources> is a hash of every file the
  kernels compile from (engine/kernels/cpu/*.py, the type tables, the encoder's ops) and of numba's, llvmlite's,
  numpy's and Python's versions: an edit or an upgrade starts a fresh directory and never loads stale code.
- <tier>-<cpu>: the best code tier this CPU runs (ir.py) and LLVM's name for it; numba keys each entry on the
  CPU too, so this only keeps two machines sharing a home (a network home directory) apart for the reader.
NUMBA_CACHE_DIR, where set, wins: numba's own layout and staleness rule, as numba documents it.

`configure()` runs in engine/kernels/cpu/__init__.py before any kernel module is imported: numba fixes a
function's cache location when its decorator runs. `announce_compiles` says so when something really compiles
(numba fires its compile event on a cache miss only), with the time the last compile of its kind took here
(`expected_seconds`, kept by `record_compile_time` in <home>/kernels/compile-times.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numba
from numba.core import event
from numba.core.caching import NullCache

from engine.files import kernels_dir

_ENGINE = Path(__file__).resolve().parents[1]  # the engine package
# What the cached kernels compile from: the CPU backend's modules, the type tables whose numbers they compile in as
# constants, the encoder's ops (not the WebGPU backend: no numba there).
_SOURCES = ("kernels/cpu/*.py", "kernels/quant_types.py", "kernels/vmath.py", "kernels/threads.py")


def sources_hash() -> str:
    """A hash of the kernels' sources and the compiler stack's versions (16 hex digits)."""
    import llvmlite
    import numpy
    import sys

    h = hashlib.sha256(f"{numba.__version__} {llvmlite.__version__} {numpy.__version__} {sys.version}".encode())
    for pattern in _SOURCES:
        for path in sorted(_ENGINE.glob(pattern)):
            h.update(path.relative_to(_ENGINE).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def machine_key() -> str:
    """<tier>-<cpu>: the best code tier this CPU runs and LLVM's name of the CPU numba compiles for."""
    from llvmlite import binding

    from engine.kernels.cpu.ir import available_tiers

    cpu = numba.config.CPU_NAME or binding.get_host_cpu_name()
    return f"{available_tiers()[-1]}-{''.join(c if c.isalnum() else '_' for c in cpu)}"


def directory() -> Path:
    """This install's kernel cache on this machine."""
    return kernels_dir() / machine_key() / sources_hash()


# None: not configured yet; True: configure() found this version's cache empty (this process compiles from nothing)
_empty_at_start: bool | None = None


def configure() -> Path | None:
    """Point numba's cache at directory() (before any kernel module is imported); None where NUMBA_CACHE_DIR
    is set (the user's choice stands)."""
    global _empty_at_start
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None
    if _empty_at_start is not None:  # configured already (every package of numba kernels calls this first)
        return Path(numba.config.CACHE_DIR)
    path = directory()
    _empty_at_start = not any(path.rglob("*.nbi")) if path.is_dir() else True
    numba.config.CACHE_DIR = str(path)
    return path


def active_directory() -> Path | None:
    """Where this process's kernels are cached (None: beside the sources, numba's default)."""
    return Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else None


class _CompileWatch(event.Listener):
    """numba's compile events (cache misses only): calls the callback set last (announce_compiles) at the first
    compile of a cached kernel, once, and adds up the seconds this process spent compiling (outermost compiles
    only: a kernel's compile sets off its callees' inside it; numba compiles one at a time)."""

    def __init__(self):
        self.then, self._fired, self._lock = None, False, threading.Lock()
        self.seconds = 0.0
        self._depth = threading.local()

    def on_start(self, ev) -> None:
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        if depth == 0:
            self._depth.t0 = time.monotonic()
        dispatcher = (ev.data or {}).get("dispatcher")
        if isinstance(getattr(dispatcher, "_cache", None), NullCache):  # an uncached helper: no disk to miss
            return
        with self._lock:
            if self._fired or self.then is None:
                return
            self._fired = True
        self.then()

    def on_end(self, ev) -> None:
        self._depth.n = getattr(self._depth, "n", 1) - 1
        if self._depth.n == 0:
            self.seconds += time.monotonic() - self._depth.t0


_watch = _CompileWatch()
event.register("numba:compile", _watch)


def announce_compiles(then) -> None:
    """Call `then()` when this process first compiles a kernel (never when it loads one from the cache): the
    line a user should read while the first run on a machine sits computing nothing visible."""
    _watch.then = then


# How long compiles took on this machine, so that the next "compiling ..." line (after an upgrade, a new model)
# gives this machine's figure rather than the dev VM's: <home>/kernels/compile-times.json, per machine_key, per
# kind ("prompt": what a load and its first prompt compiled in the foreground; "step": the background compile).
_TIMES = "compile-times.json"


def expected_seconds(kind: str, default: float) -> int:
    """The last recorded compile of this kind on this machine, else `default`."""
    try:
        data = json.loads((kernels_dir() / _TIMES).read_text())
        return round(float(data[machine_key()][kind]))
    except (OSError, ValueError, KeyError, TypeError):
        return round(default)


def record_compile_time(kind: str, *, from_empty: bool = True) -> None:
    """Remember what this process spent compiling as the `kind` figure: only where its cache was empty at start
    (from_empty; a process that found some kernels compiled would record a part for the whole) and it compiled
    a second or more. Best effort: a home that cannot be written keeps the defaults."""
    if _watch.seconds < 1 or (from_empty and not _empty_at_start):
        return
    path = kernels_dir() / _TIMES
    try:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        data.setdefault(machine_key(), {})[kind] = round(_watch.seconds, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_TIMES}.{os.getpid()}.tmp")  # two processes may record at once
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
