"""The CPU backend's KV cache of one sequence, kept outside the model (kernels/backend.py's KVCache).

Keys and values in f32 (the exact path) or f16 (the fast path, as llama.cpp's default cache: half the memory and
half the bytes each decoded token's attention reads; stored as IEEE half bits in uint16 arrays, which the
compiled kernels widen in registers), one array each for all layers (so the compiled decode step reaches every
layer through one argument): keys in tiles of 16 positions, (n_layer, n_head_kv, tiles, head_dim, 16), so a
query's dot products run along contiguous positions (SIMD across keys, no horizontal sums) and a tile is one
contiguous block; values (n_layer, n_head_kv, capacity, head_dim), so the weighted sum runs along contiguous
head dims. Grown in steps as the sequence grows (a server must not reserve the whole context window for every
request), with the small protocol the engine needs: length, reserve, write, advance, truncate (prefix reuse
and rewinding), keys/values of a layer.

A hybrid model's sequence also carries recurrent state (`state`: f32 arrays by name, e.g. a gated DeltaNet's
convolution inputs and delta-rule matrices, a row per recurrent layer): it holds the whole prefix in a fixed size
and cannot be rewound, so going back means restoring a copy taken there (`snapshot` / `restore`; a prefix cache
keeps such copies at the positions it may resume from). Its keys and values are kept for the attention layers
only (`write`'s layer is the cache slot: models/config.py kv_layers).
"""

from __future__ import annotations

import numpy as np

from engine.errors import ContextOverflow
from engine.kernels.cpu import attention

DTYPES = ("f32", "f16")

_GROW_STEP = 256  # tokens; capacity grows to the next multiple, doubling for long sequences


class KVCache:
    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, max_tokens: int, dtype: str = "f32",
                 states: tuple[tuple[str, tuple[int, ...]], ...] = ()):
        if dtype not in DTYPES:
            raise ValueError(f"KV cache dtype must be one of {DTYPES}, got {dtype!r}")
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.max_tokens = max_tokens
        self.dtype = dtype
        self._store = np.float32 if dtype == "f32" else np.uint16
        self.length = 0  # tokens whose keys/values every layer holds
        self.k = np.empty((n_layer, n_head_kv, 0, head_dim, attention.TILE), self._store)  # keys, in tiles
        self.v = np.empty((n_layer, n_head_kv, 0, head_dim), self._store)
        self.state = {name: np.zeros(shape, np.float32) for name, shape in states}  # at position length

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
        tiles = -(-cap // attention.TILE)
        k = np.empty((self.n_layer, self.n_head_kv, tiles, self.head_dim, attention.TILE), self._store)
        v = np.empty((self.n_layer, self.n_head_kv, cap, self.head_dim), self._store)
        k[:, :, : self.k.shape[2]] = self.k
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v (T, Hkv, D) f32 at positions length..length+T-1; return all keys/values of the layer as
        (L, Hkv, D) f32 (as stored: f16 values come back rounded)."""
        T, end = k.shape[0], self.length + k.shape[0]
        attention.store_keys(np.ascontiguousarray(k, np.float32), self.k, layer, self.length)
        if self.dtype == "f32":
            self.v[layer, :, self.length : end] = v.transpose(1, 0, 2)
        else:
            H, D, cap = self.n_head_kv, self.head_dim, self.capacity
            vt = np.ascontiguousarray(v.transpose(1, 0, 2), np.float32).reshape(-1)  # (Hkv, T, D)
            attention.to_halves(vt, 0, T * D, self.v.reshape(-1), (layer * H * cap + self.length) * D, cap * D, H,
                                T * D)
        return self.keys(layer, end), self.values(layer, end)

    def keys(self, layer: int, n: int | None = None) -> np.ndarray:
        """The first n (default: length) keys of a layer, (n, Hkv, D) f32 (a copy)."""
        n = self.length if n is None else n
        out = np.empty((n, self.n_head_kv, self.head_dim), np.float32)
        attention.load_keys(self.k, layer, out)
        return out

    def values(self, layer: int, n: int | None = None) -> np.ndarray:
        n = self.length if n is None else n
        if self.dtype == "f32":
            return self.v[layer, :, :n].transpose(1, 0, 2)
        H, D, cap = self.n_head_kv, self.head_dim, self.capacity
        out = np.empty((H, n, D), np.float32)
        attention.from_halves(self.v.reshape(-1), layer * H * cap * D, cap * D, out.reshape(-1), 0, n * D, H, n * D)
        return out.transpose(1, 0, 2)

    def advance(self, n: int) -> None:
        """Commit n tokens written to every layer."""
        self.length += n

    def truncate(self, n: int) -> None:
        """Forget everything from position n on (keeps the storage). A recurrent state can only go back to the
        start (zeroed); elsewhere restore a snapshot."""
        n = min(self.length, max(0, n))
        if self.state and n != self.length:
            if n:
                raise ValueError(f"a recurrent state cannot be rewound to position {n}: restore a snapshot taken there")
            for a in self.state.values():
                a[:] = 0
        self.length = n

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """What restore() needs to bring this sequence back to where it is now: its length and a copy of its
        recurrent state (keys and values are positional: truncating them suffices)."""
        return self.length, {name: a.copy() for name, a in self.state.items()}

    def restore(self, snap: tuple[int, dict[str, np.ndarray]]) -> None:
        """Back to a snapshot of this sequence taken at a position it still holds."""
        length, state = snap
        if length > self.length:
            raise ValueError(f"snapshot at {length} is past the cache's {self.length} positions")
        self.length = length
        for name, a in state.items():
            self.state[name][:] = a

    def fork(self, length: int | None = None) -> KVCache:
        """A new sequence that starts where this one is (a copy: keys, values, recurrent state), to continue on its
        own: the n answers of one prompt, which is evaluated once. With length: its first length positions only
        (a warm session's prefix, which stays in the pool); a recurrent state is then to be restored from a
        snapshot taken there."""
        n = self.length if length is None else min(length, self.length)
        twin = KVCache(self.n_layer, self.n_head_kv, self.head_dim, self.max_tokens, self.dtype)
        # as much room as this one has (a reused session's may hold more than its new request's max_tokens)
        twin.reserve(min(self.capacity, self.max_tokens) if length is None else n)
        tiles = -(-n // attention.TILE)
        twin.k[:, :, :tiles] = self.k[:, :, :tiles]
        twin.v[:, :, :n] = self.v[:, :, :n]
        twin.length = n
        twin.state = {name: a.copy() for name, a in self.state.items()}
        return twin

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + sum(a.nbytes for a in self.state.values())
