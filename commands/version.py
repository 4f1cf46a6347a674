"""goinfer's version as `goinfer --version` and `goinfer check` print it: the installed version and, where the code
runs from a git checkout, its commit ("0.1.0 (a1b2c3d)"), so a bug report names the code that ran.

Here rather than in engine/: `--version` answers without importing the engine (numpy, numba: a second or so).
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the directory holding commands/, engine/ and goinfer_cli/
_HASH = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")


@cache
def goinfer_version() -> str:
    """'0.1.0', '0.1.0 (a1b2c3d)' in a checkout, 'unknown (not installed)' for a checkout never installed."""
    try:
        version = metadata.version("goinfer")
    except metadata.PackageNotFoundError:
        version = None
    commit = checkout_commit()
    if version is None:
        return f"unknown (not installed{', ' + commit if commit else ''})"
    return f"{version} ({commit})" if commit else version


def checkout_commit(root: Path = ROOT) -> str | None:
    """HEAD's short hash where root is the top of a git checkout (a .git directory, or a worktree's .git file);
    None for an installed package (no .git beside it: an enclosing repository's HEAD is not this code's) and
    whenever git cannot tell within a second. Never raises."""
    if not (root / ".git").exists():
        return None
    try:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=1, stdin=subprocess.DEVNULL)
        if r.returncode == 0 and re.fullmatch(r"[0-9a-f]{4,64}", r.stdout.strip()):
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git on PATH, or a slow one
        pass
    try:
        return _read_head(root / ".git")
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _read_head(dotgit: Path) -> str | None:
    """HEAD's short hash read from the files, without git: a detached hash, or a branch's loose or packed ref."""
    if dotgit.is_file():  # a worktree or submodule: "gitdir: PATH"
        gitdir = dotgit.read_text().strip().removeprefix("gitdir:").strip()
        dotgit = (dotgit.parent / gitdir).resolve()
    head = (dotgit / "HEAD").read_text().strip()
    if _HASH.fullmatch(head):
        return head[:7]
    ref = head.removeprefix("ref:").strip()
    common = dotgit / (dotgit / "commondir").read_text().strip() if (dotgit / "commondir").exists() else dotgit
    for d in (dotgit, common):
        if (d / ref).is_file():
            value = (d / ref).read_text().strip()
            return value[:7] if _HASH.fullmatch(value) else None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            value, _, name = line.partition(" ")
            if name == ref and _HASH.fullmatch(value):
                return value[:7]
    return None
