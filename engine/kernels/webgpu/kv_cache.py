"""The WebGPU backend's KV cache of one sequence (kernels/backend.py's KVCache), resident on the device.

Keys and values in f16 where the adapter has shader-f16 (as the CPU's default cache), else f32; a buffer each per
layer, (capacity, Hkv, D): the attention shader reads a position's
heads contiguously, and a layer's buffer stays within the binding limit far longer than one for all layers would
(SmolLM2's 30 layers at 8,192 positions are 188 MB; one layer is 6 MB). Grown in steps as the sequence grows, as
the CPU cache is (a server must not reserve the whole window for every request), by a device-side copy. The
forward pass (resident.py) writes new positions with its kv_store op inside its own recording; `write`, `keys`
and `values` move them between host and device for a saved session (engine/sessions/disk.py).
"""

from __future__ import annotations

import itertools

import numpy as np

from engine.errors import ContextOverflow

_GROW_STEP = 256  # positions; capacity grows to the next multiple, doubling for long sequences
_SERIALS = itertools.count()


class WebGPUKVCache:
    def __init__(self, gpu, n_layer: int, n_head_kv: int, head_dim: int, max_tokens: int):
        self.gpu, self.n_layer, self.n_head_kv, self.head_dim = gpu, n_layer, n_head_kv, head_dim
        self.dtype = "f16" if gpu.kv_f16 else "f32"
        self._np = np.float16 if gpu.kv_f16 else np.float32
        self._bytes = 2 if gpu.kv_f16 else 4  # per element
        self.width = n_head_kv * head_dim  # floats per position
        # a layer's keys are one binding: past the adapter's limit a longer sequence is a context overflow
        self.max_tokens = min(max_tokens, gpu.matrices.max_binding_bytes // (self.width * self._bytes))
        self.state: dict = {}  # no recurrent state: the WebGPU pass runs dense families only
        self.length = 0
        self.capacity = 0
        self.serial = next(_SERIALS)  # new with every set of buffers: what a recorded pass over them is keyed by
        self.k: list = []
        self.v: list = []

    def reserve(self, n_new: int) -> None:
        need = self.length + n_new
        if need > self.max_tokens:
            raise ContextOverflow(f"{need} tokens do not fit the context window of {self.max_tokens}")
        if need > self.capacity:
            self._grow(min(self.max_tokens, max(need, 2 * self.capacity, _GROW_STEP)))

    def _grow(self, capacity: int) -> None:
        keep = -(-self.length * self.width * self._bytes // 4) * 4
        k = [self.gpu.buffer(capacity * self.width * self._bytes) for _ in range(self.n_layer)]
        v = [self.gpu.buffer(capacity * self.width * self._bytes) for _ in range(self.n_layer)]
        if keep:
            for old, new in zip(self.k + self.v, k + v):
                self.gpu.copy(old, new, keep)
        self.k, self.v, self.capacity, self.serial = k, v, capacity, next(_SERIALS)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v (T, Hkv, D) at positions length.. of a layer from the host (a saved session coming back)."""
        for buf, a in ((self.k[layer], k), (self.v[layer], v)):
            data = np.ascontiguousarray(a, self._np).reshape(-1)  # whole words: a position's Hkv * D is even
            self.gpu.write(buf, data, self.length * self.width * self._bytes)

    def keys(self, layer: int, n: int | None = None) -> np.ndarray:
        """The first n (default: length) keys of a layer, (n, Hkv, D) f32, read from the device."""
        return self._read(self.k[layer], self.length if n is None else n)

    def values(self, layer: int, n: int | None = None) -> np.ndarray:
        return self._read(self.v[layer], self.length if n is None else n)

    def _read(self, buf, n: int) -> np.ndarray:
        return self.gpu.read(buf, n * self.width, self._np).reshape(n, self.n_head_kv, self.head_dim) if n else \
            np.zeros((0, self.n_head_kv, self.head_dim), np.float32)

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        self.length = min(self.length, max(0, n))

    def snapshot(self) -> tuple[int, dict]:
        return self.length, {}

    def restore(self, snap: tuple[int, dict]) -> None:
        length, _ = snap
        if length > self.length:
            raise ValueError(f"snapshot at {length} is past the cache's {self.length} positions")
        self.length = length

    def fork(self, length: int | None = None) -> WebGPUKVCache:
        """A copy on the device that continues on its own from this position (from position length: its first
        length positions only)."""
        n = self.length if length is None else min(length, self.length)
        twin = WebGPUKVCache(self.gpu, self.n_layer, self.n_head_kv, self.head_dim, self.max_tokens)
        if self.capacity:
            twin._grow(self.capacity)
            for old, new in zip(self.k + self.v, twin.k + twin.v):
                self.gpu.copy(old, new, -(-n * self.width * self._bytes // 4) * 4)
        twin.length = n
        return twin

    def nbytes(self) -> int:
        return 2 * self.n_layer * self.capacity * self.width * self._bytes
