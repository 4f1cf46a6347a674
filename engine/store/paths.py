"""Where the model cache lives on disk.

    <home>/models/<builtin-name>/<filename>   published, verified model files (the only loadable place)
    <home>/models/<builtin-name>/<dirname>/  the same for a checkpoint directory (published whole, in one rename)
    <home>/staging/<name>.<random>/           downloads in progress (wheels, the file or directory being built)
    <home>/locks/<name>.lock                  fcntl locks: one fetch per model at a time across processes

<home> is $GOINFER_HOME, else ~/.cache/goinfer (engine/files.py). Read at each call, so tests and users can change
it. Compiled kernels live beside the models, in <home>/kernels (engine/kernels/kernel_cache.py).
"""

from __future__ import annotations

from pathlib import Path

from engine.files import goinfer_home

__all__ = ["goinfer_home", "models_dir", "staging_dir", "locks_dir"]


def models_dir() -> Path:
    return goinfer_home() / "models"


def staging_dir() -> Path:
    return goinfer_home() / "staging"


def locks_dir() -> Path:
    return goinfer_home() / "locks"
