"""The backend interface: everything a model family's forward pass and Model's two steps ask of the hardware.

A family file (models/llama.py, ...) describes its computation once in these ops and its flags; it imports nothing
from a backend package. A backend owns what is specific to its hardware:
- the weight layout it wants (`prepare`, once at load: e.g. the CPU's row-interleaved copies of 4/5-bit blocks),
- the KV cache and its layout (`new_cache`),
- the compiled decode step, where it has one (`decode`; `has_decode_step`),
- the ops: matmul over stored blocks, embedding lookup, norms, RoPE, attention, gated activations.
Arrays in and out are float32 numpy arrays (T = tokens, H = query heads, Hkv = key/value heads, D = head dim).

Backends: engine/kernels/cpu/ (numba), in two configurations: "fast" (int8 activations at decode, an f16 KV
cache, the compiled one-token step; the default) and "exact" (f32 throughout, weights dequantized per use).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from engine.kernels.quant_types import QTensor

PATHS = ("fast", "exact")
# Every backend's prompt_tile. A prompt's rows are computed in tiles of this many, at absolute positions
# (multiples of it): a BLAS may give a row other numbers in a call of another shape (OpenBLAS's Haswell sgemm
# does: per-row results change with the row count and the row's place in the call), so every sgemm call of a
# prompt covers one tile, and a row's numbers never depend on how its prompt was cut into chunks, as long as the
# cuts fall on tile boundaries. That is what makes a reused prompt prefix (engine/sessions/pool.py) give the
# numbers a cold prefill gives. Equal to the CPU's ops.ATTN_BLOCK, whose query blocks fall on the same boundaries.
PROMPT_TILE = 64


# What a backend reads of the model it serves. engine.models passes its ModelConfig and Weights; they are named
# here as protocols because the kernels sit below the models and never import them.
class ModelConfig(Protocol):
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_dim: int
    rope_style: str  # "interleaved" (adjacent pairs) or "neox" (half split)
    rope_scaling: Any  # .factor: positions are divided by it
    rope_factors: str  # the tensor of frequency divisors, where the file has it
    rope_attn_factor: float  # cos and sin are multiplied by it (LongRoPE, YaRN)
    rope_divisors: tuple[float, ...]  # frequency divisors the config implies (YaRN), in place of rope_factors
    layer_window: tuple[int, ...]  # per layer: sliding window, 0 = global
    layer_rope_base: tuple[float, ...]  # per layer
    layer_rope_scale: tuple[float, ...]  # per layer: its linear factor (positions are divided by it)
    attn_scale: float
    attn_softcap: float
    embed_scale: float
    kv_layers: tuple[int, ...]  # the layers that keep keys and values (a hybrid's attention layers), cache order
    state_shapes: tuple[tuple[str, tuple[int, ...]], ...]  # recurrent state per sequence: (name, shape) f32
    kv_slot: dict[int, int]  # layer -> the cache slot it attends to
    state_row: dict[int, int]  # recurrent layer -> its row of the state arrays


class Weights(Protocol):
    """Matrices by GGUF name (`blk.3.attn_q`) as QTensors over the stored blocks, small vectors as f32."""

    def has(self, name: str) -> bool: ...

    def tensor(self, name: str) -> QTensor: ...

    def vector(self, name: str) -> np.ndarray: ...

    def optional_vector(self, name: str) -> np.ndarray | None: ...

    def buffer(self) -> np.ndarray | None:
        """The one uint8 buffer every tensor views (the mapped file), or None (a split model)."""

    def replace(self, name: str, tensor: QTensor) -> None:
        """Hand out tensor for name from now on (the backend's own layout of the same weights)."""

    def advise(self, raw: np.ndarray, advice: int | None) -> None:
        """madvise the mapped pages under raw (best effort)."""


class KVCache(Protocol):
    """The keys and values of one sequence, kept outside the model, in the backend's layout."""

    length: int  # positions every layer holds
    max_tokens: int  # the most it may ever hold (the context window)
    state: dict[str, np.ndarray]  # recurrent state at position length (config.state_shapes), updated in place

    def reserve(self, n_new: int) -> None:
        """Room for n_new more positions; ContextOverflow past max_tokens."""

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v (T, Hkv, D) at positions length..; all keys and values of the layer, (L, Hkv, D) each."""

    def advance(self, n: int) -> None:
        """Commit n positions written to every layer."""

    def truncate(self, n: int) -> None:
        """Forget positions n.. (rewinding, prefix reuse); with recurrent state only back to 0."""

    def snapshot(self) -> Any:
        """What restore() needs to come back to this position (recurrent state is copied)."""

    def restore(self, snap: Any) -> None:
        """Back to a snapshot's position, which the cache must still hold."""

    def fork(self, length: int | None = None) -> KVCache:
        """A copy that continues on its own from this position (the n answers of one prompt), or from position
        length (its first positions only; recurrent state: restore a snapshot taken there)."""

    def nbytes(self) -> int: ...


def frequency_divisors(config: ModelConfig, weights: Weights) -> np.ndarray | None:
    """What the rotary frequencies are divided by: the config's own (YaRN), the file's tensor (llama3's
    `rope_freqs`, LongRoPE's factors), or None."""
    if config.rope_divisors:
        return np.asarray(config.rope_divisors, np.float32)
    return weights.optional_vector(config.rope_factors)


@runtime_checkable
class Backend(Protocol):
    name: str  # the hardware: "cpu"
    path: str  # the configuration: "fast" or "exact"
    stepped_down: frozenset[int]  # GGML type codes whose fast kernels the self-test found wrong (reference tier)
    # Which code computes the numbers (the CPU's ISA tier: "avx2", "vnni"...): a warm session stored by another
    # tier's kernels holds other numbers and is not reused (engine/sessions/disk.py).
    code_tier: str
    # A prompt's rows get the same numbers however the prompt is cut into chunks, when the cuts fall on multiples
    # of this many positions (a reused prefix ends on one: engine/sessions/pool.py). An op that groups a chunk's rows
    # (MoE routing) groups them tile by tile, unless its kernel computes each row on its own (the CPU backend's
    # takes_experts).
    prompt_tile: int

    def describe(self) -> str:
        """One line for logs: the configuration and the kernels behind it."""

    # --- layouts and the decode step, set up once per model ---
    def prepare(self, config: ModelConfig, weights: Weights, step_flags: dict | None,
                matrices: Sequence[str] = ()) -> None:
        """Lay the weights out as this backend wants them, self-test the kernels the named `matrices` run (where
        the loader asked for a self-test) and build its decode step (step_flags: what the family's step needs to
        know; None: no compiled step, decode runs the forward pass one token at a time). A step compiling
        elsewhere (load_backend's background_compile) makes has_decode_step False until then."""

    def new_cache(self, config: ModelConfig, max_tokens: int) -> KVCache: ...

    @property
    def has_decode_step(self) -> bool: ...

    def decode(self, ids: np.ndarray, caches: Sequence[KVCache]) -> np.ndarray:
        """One new token per sequence through the whole model: raw head output (M, head rows); each cache
        grows by one."""

    @property
    def has_run_step(self) -> bool:
        """decode_runs works (where has_decode_step does): several tokens of one sequence in one step."""

    def decode_runs(self, runs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> np.ndarray:
        """Several new tokens per sequence (runs[m] after caches[m]'s end) through the decode step, each row the
        numbers a step of that one token gives: raw head output (sum of the runs' lengths, head rows)."""

    def end_prompt(self) -> None:
        """A prompt is done: let go of its scratch memory."""

    def end_sequences(self) -> None:
        """No sequence is decoding now: let go of anything the decode step keeps of the last ones."""

    # --- ops of a forward pass ---
    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        """x (T, cols) -> x @ W.T, (T, rows)."""

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        """[x @ W.T for W in ws]: matrices with the same cols that read one input (q|k|v, gate|up)."""

    def embed(self, w: QTensor, ids) -> np.ndarray:
        """Rows ids of w, (len(ids), cols)."""

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """x (..., n) * rsqrt(mean(x^2) + eps) * weight (n,)."""

    def rope_tables(self, positions: np.ndarray, rope_dim: int, base: float, scale: float = 1.0,
                    freq_factors: np.ndarray | None = None, attn_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (T, rope_dim/2) for absolute positions (frequencies divided by freq_factors, both tables
        times attn_factor)."""

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
        """x (T, heads, D) rotated by position (a new array); style "neox" (half split) or "interleaved"."""

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float, window: int = 0,
                  softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
        """Causal (optionally sliding-window) grouped-query attention: q (T, H, D) at positions pos0.., k, v
        (L, Hkv, D) at 0..L-1 -> (T, H, D); sinks (H,): a logit per head in each softmax's denominator."""

    def act_mul(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
        """act(gate) * up, (T, F); act "silu" or "gelu_tanh"."""

    def causal_conv(self, x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> np.ndarray:
        """Depthwise causal convolution of x (T, C) by weight (C, K) after state (K-1, C), which becomes the
        last K-1 inputs."""

    def delta_rule(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                   state: np.ndarray) -> np.ndarray:
        """The gated delta rule (kernels/cpu/recurrent.py) over T tokens from state (Hv, Dk, Dv), updated in
        place: (T, Hv, Dv)."""
