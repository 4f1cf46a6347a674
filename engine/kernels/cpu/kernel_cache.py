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
(numba fires its compile event on a cache miss only).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numba
from numba.core import event
from numba.core.caching import NullCache

from engine.files import kernels_dir

_ENGINE = Path(__file__).resolve().parents[2]  # the engine package
# What the cached kernels compile from: the CPU backend's modules, the type tables whose numbers they compile in as
# constants, the encoder's ops (not the WebGPU backend: no numba there).
_SOURCES = ("kernels/cpu/*.py", "kernels/quant_types.py", "embeddings/encoder_ops.py")


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


def configure() -> Path | None:
    """Point numba's cache at directory() (before any kernel module is imported); None where NUMBA_CACHE_DIR
    is set (the user's choice stands)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None
    path = directory()
    numba.config.CACHE_DIR = str(path)
    return path


def active_directory() -> Path | None:
    """Where this process's kernels are cached (None: beside the sources, numba's default)."""
    return Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else None


class _FirstCompile(event.Listener):
    """Calls the callback set last (announce_compiles) at the first compile this process starts, once."""

    def __init__(self):
        self.then, self._fired, self._lock = None, False, threading.Lock()

    def on_start(self, ev) -> None:
        dispatcher = (ev.data or {}).get("dispatcher")
        if isinstance(getattr(dispatcher, "_cache", None), NullCache):  # an uncached helper: no disk to miss
            return
        with self._lock:
            if self._fired or self.then is None:
                return
            self._fired = True
        self.then()

    def on_end(self, ev) -> None:
        pass


_first_compile = _FirstCompile()
event.register("numba:compile", _first_compile)


def announce_compiles(then) -> None:
    """Call `then()` when this process first compiles a kernel (never when it loads one from the cache): the
    line a user should read while the first run on a machine sits computing nothing visible."""
    _first_compile.then = then
