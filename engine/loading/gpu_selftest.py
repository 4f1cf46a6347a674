"""The model-level self-test of a GPU backend: tiny checkpoints through the device's path and the CPU's.

A wrong kernel on hardware nobody here owns does not crash; it returns slightly wrong numbers. So before the first
model of a process goes resident on an adapter, two tiny random-weight checkpoints, built here from a fixed seed
(nothing to download, nothing on disk), run through the WebGPU pass and through the CPU's exact path:
- a dense Llama (SiLU, GQA, interleaved RoPE, a tied head) over a 300-token prompt (past 256 keys) and a decode
  step after it;
- a Gemma 3 (GELU-tanh, q/k norms, post norms, scaled embeddings, a sliding-window layer and a global one with
  their own RoPE bases, NeoX RoPE), whose second prompt runs as a batched decode of two sequences;
between them every matrix type the WebGPU kernels read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K), by the prompt kernel and the decode kernel.
Every position's logits must agree with the CPU's to cosine >= 0.995 and relative L2 <= 0.10, and be finite; the
result (status passed | failed, the worst figures beside the bars, the reason) is remembered per adapter for the
process, and a failure sends the model to the CPU (engine/loading/placement.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np

from engine.kernels.registry import load_backend
from engine.kernels.quant_types import GGMLType, QTensor
from engine.models import dense
from engine.models.registry import config_from_gguf

MIN_COSINE = 0.995
MAX_REL_L2 = 0.10
_RESULTS: dict[str, dict] = {}  # adapter name -> its result, once per process

_LLAMA_TYPES = {"attn_q": GGMLType.Q8_0, "attn_k": GGMLType.Q4_0, "attn_v": GGMLType.Q4_1,
                "attn_output": GGMLType.Q5_0, "ffn_gate": GGMLType.Q4_K, "ffn_up": GGMLType.Q6_K,
                "ffn_down": GGMLType.Q5_1}
_GEMMA_TYPES = {"attn_q": GGMLType.Q5_K, "attn_k": GGMLType.F16, "attn_v": GGMLType.Q8_0,
                "attn_output": GGMLType.Q6_K, "ffn_gate": GGMLType.F32, "ffn_up": GGMLType.BF16,
                "ffn_down": GGMLType.Q4_0}


class _MemoryTensors:
    """A TensorSource (models/weights.py) over arrays made here."""

    def __init__(self, tensors: dict[str, QTensor], vectors: dict[str, np.ndarray]):
        self.path, self.data = Path("selftest"), None
        self._tensors, self._vectors = tensors, vectors

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._vectors

    def tensor(self, name: str) -> QTensor:
        return self._tensors[name]

    def vector(self, name: str) -> np.ndarray:
        return self._vectors[name]


def _matrix(rng, name: str, rows: int, cols: int, t: GGMLType, std: float = 0.05) -> QTensor:
    if t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K):  # gguf cannot quantize K-quants: random blocks
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))][1]
        n = rows * cols // 256
        raw = rng.integers(0, 256, size=(n, block), dtype=np.uint8)
        if t == GGMLType.Q6_K:  # int8 scales at 192..207, f16 d last
            raw[:, 192:208] = rng.integers(-8, 9, size=(n, 16)).astype(np.int8).view(np.uint8)
            raw[:, 208:210] = np.full(n, 3 * std / 256, "<f2").view(np.uint8).reshape(n, 2)
        else:  # f16 d, f16 dmin first: weights within about +-3 std, centred near zero
            qmax = 15 if t == GGMLType.Q4_K else 31
            raw[:, 0:2] = np.full(n, 3 * std / (63 * qmax), "<f2").view(np.uint8).reshape(n, 2)
            raw[:, 2:4] = np.full(n, 3 * std / (63 * 2), "<f2").view(np.uint8).reshape(n, 2)
        return QTensor(name, t, (rows, cols), raw.reshape(rows, -1))
    w = rng.normal(0, std, (rows, cols)).astype(np.float32)
    raw = w if t == GGMLType.F32 else gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(t)))
    return QTensor(name, t, (rows, cols), np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1))


def _checkpoint(arch: str, seed: int):
    """(config, Weights, matrix names) of a tiny random model of arch (llama or gemma3)."""
    from engine.models.weights import Weights

    rng = np.random.default_rng(seed)
    gemma = arch == "gemma3"
    E, H, Hkv, D, F, L, V = 256, 4, 2, 64, 512, 2, 384
    meta = {"general.architecture": arch, f"{arch}.embedding_length": E, f"{arch}.block_count": L,
            f"{arch}.attention.head_count": H, f"{arch}.attention.head_count_kv": Hkv,
            f"{arch}.attention.key_length": D, f"{arch}.attention.value_length": D, f"{arch}.feed_forward_length": F,
            f"{arch}.context_length": 1024, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.rope.freq_base": 1e6 if gemma else 1e4}
    if gemma:  # layer 0 slides over 96 keys (RoPE base 1e4), layer 1 is global (1e6)
        meta.update({"gemma3.attention.sliding_window": 96, "gemma3.attention.sliding_window_pattern": [True, False],
                     "gemma3.rope.freq_base_swa": 1e4})
    config = config_from_gguf(meta, V)
    types = _GEMMA_TYPES if gemma else _LLAMA_TYPES
    shapes = {"attn_q": (H * D, E), "attn_k": (Hkv * D, E), "attn_v": (Hkv * D, E), "attn_output": (E, H * D),
              "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}
    tensors = {"token_embd.weight": _matrix(rng, "token_embd", V, E, GGMLType.Q8_0, 0.5 if not gemma else 0.05)}
    vectors = {"output_norm.weight": 1 + 0.1 * rng.standard_normal(E).astype(np.float32)}
    for i in range(L):
        for role, (rows, cols) in shapes.items():
            tensors[f"blk.{i}.{role}.weight"] = _matrix(rng, f"blk.{i}.{role}", rows, cols, types[role])
        norms = {"attn_norm": E, "ffn_norm": E}
        if gemma:
            norms.update(attn_q_norm=D, attn_k_norm=D, post_attention_norm=E, post_ffw_norm=E)
        for n, size in norms.items():
            vectors[f"blk.{i}.{n}.weight"] = (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)
    return config, Weights(_MemoryTensors(tensors, vectors)), [n[: -len(".weight")] for n in tensors]


def _compare(got: np.ndarray, want: np.ndarray) -> tuple[float, float, bool]:
    """(worst cosine, worst relative L2, all finite) over rows."""
    finite = bool(np.isfinite(got).all())
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1) + 1e-30)
    rel = np.linalg.norm(got - want, axis=1) / (np.linalg.norm(want, axis=1) + 1e-30)
    return float(np.nan_to_num(cos, nan=-1.0).min()), float(np.nan_to_num(rel, nan=np.inf).max()), finite


def _cases(make_resident):
    """(name, webgpu logits, cpu logits) of each checkpoint's checks."""
    cpu = load_backend("cpu", "exact", selftest=False)
    for arch, seed, tokens in (("llama", 11, 300), ("gemma3", 12, 40)):
        config, weights, names = _checkpoint(arch, seed)
        resident = make_resident(config, weights, names)
        cpu.prepare(config, weights, None)
        head = weights.tensor("output") if weights.has("output") else weights.tensor("token_embd")
        ids = np.random.default_rng(seed).integers(0, config.vocab_size, tokens)

        def cpu_rows(seq):
            cache = cpu.new_cache(config, len(seq))
            cache.reserve(len(seq))
            return cpu.matmul(dense.forward(config, weights, cpu, np.asarray(seq), cache), head)

        gcache = resident.new_cache(config, tokens + 1)
        gcache.reserve(tokens)
        got = resident.matmul(resident.forward(config, weights, resident, ids, gcache), head)
        yield f"{arch} prompt of {tokens}", got, cpu_rows(ids)
        if arch == "llama":  # a decode step after the prompt: the matrices through the decode kernel
            got = resident.decode([7], [gcache])
            yield f"{arch} decode after {tokens}", got, cpu_rows(np.append(ids, 7))[-1:]
        else:  # two sequences decoded together (rows of one batch, each on its own cache)
            other = resident.new_cache(config, tokens + 1)
            other.reserve(tokens - 1)
            resident.forward(config, weights, resident, ids[:-1], other)
            got = resident.decode([7, 9], [gcache, other])
            want = np.stack([cpu_rows(np.append(ids, 7))[-1], cpu_rows(np.append(ids[:-1], 9))[-1]])
            yield f"{arch} batched decode of 2", got, want


def run(adapter_name: str, make_resident) -> dict:
    """The self-test on an adapter, once per process: make_resident(config, weights, matrix names) -> a prepared
    WebGPU backend on it. Returns the result (status passed | failed, worst figures, bars, elapsed_ms, reason)."""
    if adapter_name in _RESULTS:
        return _RESULTS[adapter_name]
    t0 = time.perf_counter()
    worst_cos, worst_rel, reason = 1.0, 0.0, ""
    try:
        for name, got, want in _cases(make_resident):
            cos, rel, finite = _compare(got, want)
            worst_cos, worst_rel = min(worst_cos, cos), max(worst_rel, rel)
            if not finite:
                reason = reason or f"{name}: non-finite logits"
            elif cos < MIN_COSINE or rel > MAX_REL_L2:
                reason = reason or (f"{name}: cosine {cos:.4f} (bar {MIN_COSINE}), "
                                    f"relative L2 {rel:.4f} (bar {MAX_REL_L2})")
    except Exception as e:  # a shader that fails to compile or run on this adapter is a failed self-test too
        reason = f"{type(e).__name__}: {e}"
    result = {"backend": "webgpu", "adapter": adapter_name, "status": "failed" if reason else "passed",
              "worst_cosine": round(worst_cos, 6), "worst_rel_l2": round(worst_rel, 6),
              "bars": {"cosine": MIN_COSINE, "rel_l2": MAX_REL_L2},
              "elapsed_ms": round(1000 * (time.perf_counter() - t0), 1), **({"reason": reason} if reason else {})}
    _RESULTS[adapter_name] = result
    return result
