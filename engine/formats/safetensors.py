"""Read a Hugging Face safetensors checkpoint: one `model.safetensors`, or the shards that
`model.safetensors.index.json` lists, each memory-mapped; tensors come out as numpy views in their stored dtype.

The format: 8 bytes (little-endian u64) of header length, a JSON header {name: {dtype, shape, data_offsets}}
(offsets relative to the end of the header), then the data. bfloat16 has no numpy dtype: its raw uint16 words
are handed out and `to_f32` widens them (a bf16 is the high half of an f32).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from engine.errors import ModelLoadError, UnsupportedModel

# safetensors dtype -> (numpy dtype of the stored words, GGML type name of the same numbers)
DTYPES = {"F32": (np.float32, "F32"), "F16": (np.float16, "F16"), "BF16": (np.uint16, "BF16")}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


class SafetensorsCheckpoint:
    """Every tensor of a checkpoint directory by name: `names`, `dtype(name)`, `shape(name)`, `array(name)`."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._maps: dict[Path, mmap.mmap] = {}
        self._entries: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for shard in _shards(self.directory):
            self._read_header(shard)
        if not self._entries:
            raise ModelLoadError(f"{self.directory}: the safetensors files hold no tensors")

    def _read_header(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path.name}: not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelLoadError(f"{path.name}: not a safetensors file (header length {n})")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelLoadError(f"{path.name}: corrupt safetensors header ({e})") from None
            self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else None
        if not isinstance(header, dict):
            raise ModelLoadError(f"{path.name}: corrupt safetensors header")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (lo, hi) = str(info["dtype"]), tuple(int(d) for d in info["shape"]), info["data_offsets"]
                lo, hi = int(lo), int(hi)
            except (KeyError, TypeError, ValueError):
                raise ModelLoadError(f"{path.name}: corrupt safetensors entry for {name!r}") from None
            if name in self._entries:
                raise ModelLoadError(f"{path.name}: tensor {name!r} is also in {self._entries[name][0].name}")
            start, end = 8 + n + lo, 8 + n + hi
            if dtype in DTYPES and (end > size or hi - lo != int(np.prod(shape)) * np.dtype(DTYPES[dtype][0]).itemsize):
                raise ModelLoadError(f"{path.name}: truncated or inconsistent tensor {name!r}")
            self._entries[name] = (path, dtype, shape, start, end)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def dtype(self, name: str) -> str:
        return self._entries[name][1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def array(self, name: str) -> np.ndarray:
        """The stored words of `name`, shaped, read-only (bf16 as uint16)."""
        path, dtype, shape, start, end = self._entries[name]
        if dtype not in DTYPES:
            raise UnsupportedModel(f"{path.name}: tensor {name!r} is stored as {dtype}, which goinfer does not "
                                   f"load (supported: {', '.join(DTYPES)})")
        if start == end:
            return np.zeros(shape, DTYPES[dtype][0])
        words = np.frombuffer(self._maps[path], DTYPES[dtype][0], (end - start) // np.dtype(DTYPES[dtype][0]).itemsize,
                              start)
        return words.reshape(shape)


def to_f32(words: np.ndarray, dtype: str) -> np.ndarray:
    """Stored words (SafetensorsCheckpoint.array) as float32: exact for every supported dtype."""
    if dtype == "BF16":
        return (words.astype(np.uint32) << 16).view(np.float32)
    return words.astype(np.float32)


def _shards(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"{index}: not a valid safetensors index") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise ModelLoadError(f"{directory}: the index names shard(s) that are missing: {', '.join(missing[:3])}")
        return [directory / n for n in names]
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{directory}: no .safetensors file")
    return shards
