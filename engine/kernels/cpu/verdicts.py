"""Remembered self-test verdicts: a kernel checked once on this machine, with these kernel sources and this
compiler, is not loaded and run again by every process that loads a model (the self-test was ~0.7 s of a
~3.7 s warm `goinfer chat` on a 2-core box, mostly loading kernels that a packed model never runs).

The verdicts live in a JSON file beside numba's cache of these kernels, so clearing that cache clears them, under
a fingerprint of what decides the compiled code and the check's answer: the sources of this package, the
reference and the type tables, numba's and llvmlite's versions, the CPU's name and features. A verdict is the
check's max relative error (None: the kernel does not serve the type). A file that cannot be read or written
means nothing remembered: the self-test runs as it did. `goinfer check --hardware` always runs the kernels.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

FILE_NAME = "goinfer-selftest-verdicts.json"
_fingerprint: str | None = None


def fingerprint() -> str:
    global _fingerprint
    if _fingerprint is None:
        import llvmlite
        import numba
        from llvmlite import binding

        here = Path(__file__).parent
        h = hashlib.sha256()
        for path in sorted(here.glob("*.py")) + [here.parent / "reference.py", here.parent / "quant_types.py"]:
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        cpu = f"{binding.get_host_cpu_name()} {binding.get_host_cpu_features().flatten()}"
        h.update(f"numba {numba.__version__} llvmlite {llvmlite.__version__} {cpu}".encode())
        _fingerprint = h.hexdigest()
    return _fingerprint


def path() -> Path | None:
    """Beside numba's cache of this package's kernels (its private locator; None where that moved)."""
    try:
        from engine.kernels.cpu import int8

        return Path(int8.rows_into._cache._cache_path) / FILE_NAME
    except Exception:  # noqa: BLE001 - numba internals moved: nothing remembered
        return None


def load() -> dict[str, float | None]:
    """The verdicts remembered under this fingerprint ("kernel/TYPE" -> max relative error or None)."""
    where = path()
    if where is None:
        return {}
    try:
        data = json.loads(where.read_text())
        if isinstance(data, dict) and data.get("fingerprint") == fingerprint():
            found = data.get("verdicts")
            return dict(found) if isinstance(found, dict) else {}
    except (OSError, ValueError):
        pass
    return {}


def remember(found: dict[str, float | None]) -> None:
    """Add verdicts (written whole, by rename: a reader never sees half a file; a lost race loses a verdict,
    which the next load checks again)."""
    where = path()
    if not found or where is None:
        return
    try:
        merged = {**load(), **found}
        fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=".selftest-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": fingerprint(), "verdicts": merged}, f)
        os.replace(tmp, where)
    except OSError:
        pass
