"""The decode step's compile on a first run: in a background process, while this one answers without the step.

The compiled step (decode_step.py) is one large function: compiling it takes 1-2.5 minutes on a 2-core machine,
once per install (numba's on-disk cache keeps it; the step's argument types are the same for every model). A
first `goinfer chat` should not sit through that, so where the step is not in the cache yet, a detached, niced
process compiles it (engine/loading/precompile.py: it loads the same model, so the argument types match, and runs one
step), holding a lock file while it works (`hold_lock`); meanwhile this process decodes token by token through
the prompt pass (the same kernels; the two agree up to float summation order, tests/test_decode_step.py) and
takes the step up once the compile is done (`PendingStep.ready`). A greedy reply of that first run can
therefore differ from later runs' where two tokens all but tie.

A one-shot `goinfer chat` may return before the compile ends: the compile then goes on alone (`detached`), announced
on stderr with the time it has left (`announce_running`), and ends within COMPILE_LIMIT_S whatever happens; a later
command finds its lock and takes the step up when it is done, never starting a second one. A server's compile is
`tied` to it: it ends when the server does (`stop_running`, and the child's own watch of its parent, which also
covers a server killed outright).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

from numba.core.compiler_lock import global_compiler_lock

from engine.kernels.kernel_cache import expected_seconds

try:
    import fcntl
except ImportError:  # not a POSIX system: no background compile, the step compiles in the foreground
    fcntl = None

POLL_SECONDS = 0.5  # how often a decode without the step looks whether the compile has finished
# The background compile on the 2-core dev VM: the model's load, its prompt kernels and the step (docs/benchmarks.md,
# the first-contact entry), until this machine has recorded its own; and the most it may take before it ends
# itself (a child left behind ends by then).
STEP_COMPILE_S = 80
COMPILE_LIMIT_S = 280

_running: list[tuple[subprocess.Popen, float]] = []  # the compiles this process started, with their start times


def lock_path() -> Path:
    """The lock file a background compile holds while it works (one per user: numba's cache is per install)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"goinfer-{uid}-step-compile.lock"


def load_cached(dispatcher, sig: tuple) -> bool:
    """True when `dispatcher` has a compiled overload for argument types `sig`: in this process, or in numba's
    on-disk cache (then loaded now, as a call would). Never compiles. Goes through numba's private dispatcher
    attributes (Dispatcher.compile's own cache lookup); anything unexpected counts as cached, so a numba version
    without them compiles at the first call as it always did."""
    try:
        with global_compiler_lock:
            if sig in dispatcher.overloads:
                return True
            cres = dispatcher._cache.load_overload(sig, dispatcher.targetctx)
            if cres is None:
                return False
            dispatcher.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
            dispatcher.add_overload(cres)
            return True
    except Exception:  # noqa: BLE001 - numba internals moved: behave as before (compile on the first call)
        return True


def _compiling_elsewhere() -> bool:
    """A background compile holds the lock now."""
    try:
        with open(lock_path(), "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


class PendingStep:
    """A decode step whose compile runs elsewhere: `ready()` gives the step once numba's cache holds it."""

    def __init__(self, step, sig: tuple, process: subprocess.Popen | None):
        self._step, self._sig, self._process = step, sig, process
        self._next_poll = time.monotonic() + POLL_SECONDS
        self._gave_up = False

    def ready(self):
        """The step, when its compile has finished (loaded from numba's cache); else None. Cheap between polls."""
        now = time.monotonic()
        if self._gave_up or now < self._next_poll:
            return None
        self._next_poll = now + POLL_SECONDS
        if self._process is not None and self._process.poll() is None:
            return None
        if _compiling_elsewhere():
            return None
        if load_cached(self._step.dispatcher, self._sig):
            return self._step
        self._gave_up = True  # the compile ended without a step (it failed): decode on without one
        return None


def spawn(command: list[str]) -> subprocess.Popen | None:
    """Start `command` detached (its own session: a Ctrl-C in the terminal is not for it), its stderr in a log
    beside the lock file; None where it cannot start."""
    if fcntl is None:
        return None
    try:
        with open(lock_path().with_suffix(".log"), "w") as err:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                       start_new_session=True)
    except OSError:
        return None
    _running.append((process, time.monotonic()))
    return process


def start_elsewhere(command: list[str]) -> subprocess.Popen | None:
    """The background compile, started now unless one runs already (that one's result serves this process too)."""
    if fcntl is None or _compiling_elsewhere():
        return None
    return spawn(command)


def announce_running(note) -> None:
    """A command returning while its compile goes on: say so, with the time it has left (detached compiles end
    by themselves within COMPILE_LIMIT_S)."""
    for process, started in _running:
        if process.poll() is None:
            left = max(5, round(expected_seconds("step", STEP_COMPILE_S) - (time.monotonic() - started)))
            note(f"the compiled decode step is still compiling in the background (pid {process.pid}, about {left} s "
                 f"more, {COMPILE_LIMIT_S // 60} min at most); later runs use it, and one started meanwhile waits "
                 "for it instead of compiling again")


def stop_running() -> None:
    """A server stopping: its compiles end with it (a half-written cache entry is never read: numba renames
    its files into place)."""
    for process, _ in _running:
        if process.poll() is None:
            process.terminate()
    for process, _ in _running:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
    _running.clear()


def start(step, sig: tuple, command: list[str], process: subprocess.Popen | None = None) -> PendingStep | None:
    """None when the step is compiled already (loaded now) or cannot be compiled elsewhere here (the caller
    then uses `step` and it compiles at its first call); else the pending step, compiled by `process` (one
    started earlier), by a compile another process runs, or else by `command`, started now."""
    if fcntl is None or load_cached(step.dispatcher, sig):
        return None
    if process is None and not _compiling_elsewhere():
        process = spawn(command)
        if process is None:
            return None
    return PendingStep(step, sig, process)


@contextlib.contextmanager
def hold_lock():
    """For the background compile: yields True holding the lock, False where another compile holds it."""
    with open(lock_path(), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
