"""The KV cache of one sequence, kept outside the model.

f32 keys and values, one array each for all layers (so the compiled decode step reaches every layer through one
argument): keys transposed, (n_layer, n_head_kv, head_dim, capacity), so a query's dot products with all keys
run along contiguous positions (SIMD across keys, no horizontal sums); values (n_layer, n_head_kv, capacity,
head_dim), so the weighted sum runs along contiguous head dims. Grown in steps as the sequence grows (a server
must not reserve the whole context window for every request), with the small protocol the engine needs:
length, reserve, write, advance, truncate (prefix reuse and rewinding), keys/values of a layer.
"""

from __future__ import annotations

import numpy as np

from engine.errors import ContextOverflow

_GROW_STEP = 256  # tokens; capacity grows to the next multiple, doubling for long sequences


class KVCache:
    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, max_tokens: int):
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.max_tokens = max_tokens
        self.length = 0  # tokens whose keys/values every layer holds
        self.k = np.empty((n_layer, n_head_kv, head_dim, 0), np.float32)  # keys, transposed
        self.v = np.empty((n_layer, n_head_kv, 0, head_dim), np.float32)

    @property
    def capacity(self) -> int:
        return self.v.shape[2]

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more tokens; refuse past max_tokens."""
        need = self.length + n_new
        if need > self.max_tokens:
            raise ContextOverflow(f"{need} tokens do not fit the context window of {self.max_tokens}")
        if need <= self.capacity:
            return
        cap = min(self.max_tokens, max(need, 2 * self.capacity, _GROW_STEP))
        k = np.empty((self.n_layer, self.n_head_kv, self.head_dim, cap), np.float32)
        v = np.empty((self.n_layer, self.n_head_kv, cap, self.head_dim), np.float32)
        k[..., : self.length] = self.k[..., : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v (T, Hkv, D) at positions length..length+T-1; return all keys/values as (L, Hkv, D) views."""
        end = self.length + k.shape[0]
        self.k[layer, :, :, self.length : end] = k.transpose(1, 2, 0)
        self.v[layer, :, self.length : end] = v.transpose(1, 0, 2)
        return self.keys(layer, end), self.values(layer, end)

    def keys(self, layer: int, n: int | None = None) -> np.ndarray:
        """The first n (default: length) keys of a layer, (n, Hkv, D), a view."""
        return self.k[layer, :, :, : self.length if n is None else n].transpose(2, 0, 1)

    def values(self, layer: int, n: int | None = None) -> np.ndarray:
        return self.v[layer, :, : self.length if n is None else n].transpose(1, 0, 2)

    def advance(self, n: int) -> None:
        """Commit n tokens written to every layer."""
        self.length += n

    def truncate(self, n: int) -> None:
        """Forget everything from position n on (keeps the storage)."""
        self.length = min(self.length, max(0, n))

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
