"""The JSON files of a Hugging Face checkpoint directory (config.json, tokenizer_config.json,
generation_config.json): one object each, or a ModelLoadError that names the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError


def read_json_object(path: Path, *, required: bool = True) -> dict[str, Any]:
    """The object in `path`; a missing file is an error when required, else {}."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent}: no {path.name}")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return value
