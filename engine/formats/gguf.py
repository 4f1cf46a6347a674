"""A lean GGUF reader: header, metadata and tensor directory, with the weights memory-mapped in place.

gguf.GGUFReader parses every array element eagerly (7.6 s and 772 MB for Gemma's 262k-token vocabulary);
this reader decodes string arrays in one pass and numeric arrays as numpy views, so opening a file costs
milliseconds plus the vocabulary. gguf.GGUFReader stays the oracle in tests.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelLoadError, UnsupportedModel
from engine.kernels.quant_types import BLOCK_GEOMETRY, COMPUTE_TYPES, GGMLType, QTensor, type_name

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars) / numpy dtype (arrays).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPE = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the file's directory describes it. shape is numpy order (outermost first)."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int | None  # None when the type's blocks are unknown to us (size unknown)


class _Cursor:
    """Sequential little-endian decoding over the mapped header, with truncation reported clearly."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF header (needs byte {self.pos + n}, file has {len(self.buf)})")

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def string_array(self, count: int) -> list[str]:
        # One tight loop over (length, bytes) pairs: the hot spot for 262k-token vocabularies.
        buf, pos, out = self.buf, self.pos, []
        end = len(buf)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self._need(8)
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self._need(n)
            out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return self.string_array(count)
            if etype in _DTYPE:
                dtype = np.dtype(_DTYPE[etype])
                self._need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += count * dtype.itemsize
                return arr
            if etype == _ARRAY:  # nested arrays are rare (none in llama.cpp's writers); decode generically
                return [self.value(_ARRAY) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF metadata value type {vtype}")


def read_header_key(data: bytes, key: str, name: str = "GGUF header") -> Any:
    """One metadata value from the first bytes of a GGUF file (None when absent), for remote probes.

    ModelLoadError mentioning "truncated" means the key may lie beyond `data`: read more and retry.
    """
    if data[:4] != MAGIC:
        raise ModelLoadError(f"{name}: not a GGUF file (bad magic number)")
    cur = _Cursor(memoryview(data), Path(name))
    cur.pos = 4
    if cur.scalar("<I") not in (2, 3):
        raise ModelLoadError(f"{name}: unsupported GGUF version")
    cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    for _ in range(min(n_kv, 1_000_000)):
        k = cur.string()
        value = cur.value(cur.scalar("<I"))
        if k == key:
            return value
    return None


class GGUFFile:
    """An opened GGUF file: `.metadata` (dict) and `.entries` (tensor directory), weights mmapped.

    Metadata values: scalars as Python int/float/bool/str, string arrays as list[str], numeric arrays
    as numpy arrays. `tensor(name)` returns a QTensor viewing the mapped bytes (no copy).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelLoadError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise ModelLoadError(f"{self.path}: is a directory, not a GGUF file")
        size = self.path.stat().st_size
        if size < 24:
            raise ModelLoadError(f"{self.path}: not a GGUF file (only {size} bytes)")
        with open(self.path, "rb") as f:
            if f.read(4) != MAGIC:
                raise ModelLoadError(f"{self.path}: not a GGUF file (bad magic number)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        self._parse()

    def _parse(self) -> None:
        cur = _Cursor(memoryview(self._map), self.path)
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ModelLoadError(f"{self.path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 4:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, (int, np.integer)) or isinstance(align, bool) or not 0 < int(align) <= 1 << 20:
            raise ModelLoadError(f"{self.path}: general.alignment is {align!r}; it must be a positive integer")
        align = int(align)
        data_start = -(-cur.pos // align) * align
        self.entries: dict[str, TensorEntry] = {}
        for name, dims, type_id, rel in infos:
            shape = tuple(int(d) for d in reversed(dims))  # GGUF lists ne[0] (columns) first
            nbytes = None
            if type_id in GGMLType._value2member_map_:
                block, bsize = BLOCK_GEOMETRY[GGMLType(type_id)]
                n = int(np.prod(dims)) if dims else 1
                nbytes = n // block * bsize
            entry = TensorEntry(name, type_id, shape, data_start + rel, nbytes)
            if nbytes is not None and entry.offset + nbytes > self.file_size:
                raise ModelLoadError(
                    f"{self.path}: truncated: tensor {name!r} needs bytes up to {entry.offset + nbytes}, "
                    f"file has {self.file_size}"
                )
            self.entries[name] = entry

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def check_tensor_types(self) -> None:
        """Refuse a tensor type we cannot compute with, naming it (before any heavy work)."""
        # A type with known blocks but no kernels yet (Q2_K...) is refused as an unknown one is: nothing can run it.
        for e in self.entries.values():
            if e.type_id not in COMPUTE_TYPES:
                raise UnsupportedModel(
                    f"{self.path.name}: tensor {e.name!r} has type {type_name(e.type_id)}, which goinfer does "
                    f"not support (supported: {', '.join(t.name for t in GGMLType if t in COMPUTE_TYPES)})"
                )

    def tensor(self, name: str) -> QTensor:
        """The named tensor as a 2-D QTensor view (1-D tensors become (1, n))."""
        e = self.entries.get(name)
        if e is None:
            raise ModelLoadError(f"{self.path.name}: missing tensor {name!r}")
        if e.type_id not in COMPUTE_TYPES:
            self.check_tensor_types()
        gtype = GGMLType(e.type_id)
        cols = e.shape[-1]
        rows = int(np.prod(e.shape[:-1])) if len(e.shape) > 1 else 1
        raw = np.frombuffer(self._map, dtype=np.uint8, count=e.nbytes, offset=e.offset)
        return QTensor(name, gtype, (rows, cols), raw.reshape(rows, e.nbytes // rows))

    @property
    def data(self) -> np.ndarray:
        """The whole mapped file as one read-only uint8 array (tensor views lie inside it)."""
        return np.frombuffer(self._map, dtype=np.uint8)

    def vector(self, name: str) -> np.ndarray:
        """A small 1-D tensor (norm weights, biases) as float32: copied, they are tiny."""
        from engine.kernels.reference import dequantize

        return dequantize(self.tensor(name)).reshape(-1).astype(np.float32, copy=False)

    def has(self, name: str) -> bool:
        return name in self.entries

    @property
    def names(self) -> list[str]:
        return list(self.entries)


# --- split models (llama.cpp's gguf-split): <prefix>-0000N-of-0000M.gguf, metadata in the first shard ---------

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def shard_paths(path: str | Path) -> list[Path]:
    """Every shard's path of the split set `path` belongs to (by name), or [path] for a single file."""
    path = Path(path)
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFShards:
    """One model stored as several GGUF shards, read as one: the same interface as GGUFFile.

    Metadata comes from the first shard (gguf-split writes it there); the tensor directory is the union of
    every shard's, each tensor a view of its own shard's mapping. `split.count` and `split.tensors.count`
    are checked so a missing or foreign shard is refused at open, naming it.
    """

    def __init__(self, shards: list[GGUFFile]):
        first = shards[0]
        self.path = first.path
        self.shards = shards
        self.metadata = first.metadata
        self.version = first.version
        self.file_size = sum(s.file_size for s in shards)
        self.entries: dict[str, TensorEntry] = {}
        self._owner: dict[str, GGUFFile] = {}
        for shard in shards:
            for name, entry in shard.entries.items():
                if name in self._owner:
                    raise ModelLoadError(f"{shard.path.name}: tensor {name!r} is also in {self._owner[name].path.name}")
                self.entries[name] = entry
                self._owner[name] = shard
        expected = first.metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.entries):
            raise ModelLoadError(f"{self.path.name}: the split set holds {len(self.entries)} tensors, "
                                 f"its header says {int(expected)}")

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def data(self) -> None:
        """No single buffer holds a split model's tensors (the compiled decode step needs one; split models
        decode layer by layer instead)."""
        return None

    def check_tensor_types(self) -> None:
        for shard in self.shards:
            shard.check_tensor_types()

    def tensor(self, name: str) -> QTensor:
        shard = self._owner.get(name)
        if shard is None:
            raise ModelLoadError(f"{self.path.name}: missing tensor {name!r}")
        return shard.tensor(name)

    def vector(self, name: str) -> np.ndarray:
        shard = self._owner.get(name)
        if shard is None:
            raise ModelLoadError(f"{self.path.name}: missing tensor {name!r}")
        return shard.vector(name)

    def has(self, name: str) -> bool:
        return name in self._owner

    @property
    def names(self) -> list[str]:
        return list(self.entries)


def open_gguf(path: str | Path) -> GGUFFile | GGUFShards:
    """Open a model's GGUF: a single file, or (any shard of) a split set, read as one model."""
    first = GGUFFile(path)
    count = int(first.metadata.get("split.count", 1) or 1)
    if count <= 1:
        return first
    paths = shard_paths(first.path)
    if len(paths) != count:
        raise ModelLoadError(f"{first.path.name}: header says {count} shards, but the name is not "
                             f"<prefix>-0000N-of-{count:05d}.gguf")
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{first.path.name}: split model is missing shard(s) {', '.join(missing)}")
    shards = [first if p == first.path else GGUFFile(p) for p in paths]
    for i, shard in enumerate(shards):
        if int(shard.metadata.get("split.no", -1)) != i or int(shard.metadata.get("split.count", 0)) != count:
            raise ModelLoadError(f"{shard.path.name}: not shard {i + 1} of {count} of this split model")
    return GGUFShards(shards)
