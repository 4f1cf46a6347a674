"""The WebGPU backend: a dense model resident on a wgpu device (kernels/backend.py's interface).

Every matrix goes to the device once, as its GGUF blocks (matvec.py), with the norms and biases; each sequence's
keys and values live there too (kv_cache.py). A forward pass, a prompt chunk's or a decode step's, is one plan
(program.py): embeddings (looked up on the host: a few rows of the table) go up, every layer's ops run back to back
on the device, and one read brings back the final hidden states (a prompt) or the head's logits (a decode step). A
decode step of M sequences runs their M rows through each matrix together; each sequence's attention reads its own
cache. A decode step's plan is recorded once per batch (the same caches, the same buffers) and replayed: where
each sequence starts and the RoPE tables are written into buffers the plan binds.

What it runs: the decoder-only families of models/dense.py without experts, attention sinks or output gates
(llama, qwen2, qwen3, phi3, gemma2, gemma3): RMSNorm, q/k norms, post norms, q/k/v biases, fused q|k|v and
gate|up matrices, RoPE (NeoX or interleaved, per-layer bases, frequency divisors), GQA with per-layer sliding
windows and soft-capped scores, SiLU or GELU-tanh gates. `unsupported` says why another model is not.
Activations in f32 (as the CPU's exact path), the KV cache in f16 where the adapter has shader-f16 (as the CPU's
default cache); the tables of RoPE are computed on the host in f64 as the CPU's are.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.kernels import reference
from engine.kernels.backend import frequency_divisors
from engine.kernels.cpu.ops import rope_tables
from engine.kernels.quant_types import QTensor
from engine.kernels.webgpu.kv_cache import WebGPUKVCache
from engine.kernels.webgpu.matvec import TYPES
from engine.kernels.webgpu.program import Gpu, Plan, params
from engine.kernels.webgpu.shaders import MAX_HEAD_DIM

DENSE_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
_PLANNED_ROWS = 16  # passes of at most this many rows (decode steps) keep their plans and buffers
_MAX_PLANS = 8


def unsupported(config, weights, matrices: Sequence[str]) -> str | None:
    """Why the WebGPU pass cannot run this model (None: it can)."""
    if config.arch not in DENSE_ARCHS or config.n_expert or config.attn_sinks or config.attn_output_gate:
        return (f"the WebGPU pass runs the dense families ({', '.join(DENSE_ARCHS)}) so far; this model is "
                f"{config.arch}{' with experts' if config.n_expert else ''}")
    if config.head_dim > MAX_HEAD_DIM or config.head_dim % 2:
        return f"head dimension {config.head_dim}: the WebGPU attention takes even ones up to {MAX_HEAD_DIM}"
    tied = not weights.has("output")
    for name in matrices:
        t = weights.tensor(name)
        if t.ggml_type not in TYPES and (name != "token_embd" or tied):  # the table is read on the host
            return f"{name} is {t.ggml_type.name}, a type the WebGPU kernels do not read yet"
    return None


class WebGPUResident:
    name = "webgpu"
    path = "exact"  # f32 activations, as the CPU's exact path
    stepped_down: frozenset[int] = frozenset()
    code_tier = "wgsl"
    prompt_tile = 64

    def __init__(self, gpu: Gpu, adapter_name: str):
        self.gpu, self.adapter_name = gpu, adapter_name
        self.config = self.weights = None
        self._vectors: dict[str, object] = {}
        self._scratch: dict[int, dict] = {}
        self._plans: dict[tuple, Plan] = {}  # decode steps' recorded passes, by rows, head and the caches' buffers

    def describe(self) -> str:
        kv = "f16" if self.gpu.kv_f16 else "f32"
        return f"webgpu on {self.adapter_name} (model resident, f32 activations, {kv} KV cache)"

    # --- layouts and the decode step ------------------------------------------------------------------------

    def prepare(self, config, weights, step_flags=None, matrices: Sequence[str] = ()) -> None:
        """Every matrix the pass reads and every norm and bias go to the device now (a load that cannot fit fails
        here, not mid-request)."""
        self.config, self.weights = config, weights
        for name in matrices:
            if name != "token_embd" or not weights.has("output"):  # the table is read on the device as the head
                self.gpu.matrices.upload(weights.tensor(name))
        for i in range(config.n_layer):
            for name in self._layer_vectors(i):
                self._vector(name)
        self._vector("output_norm.weight")

    def _layer_vectors(self, i: int) -> list[str]:
        cfg, blk = self.config, f"blk.{i}."
        names = [blk + "attn_norm.weight", blk + "ffn_norm.weight"]
        names += [blk + n + ".weight" for n in ("attn_q_norm", "attn_k_norm") if cfg.qk_norm]
        names += [blk + n + ".weight" for n in ("post_attention_norm", "post_ffw_norm") if cfg.post_norms]
        names += [blk + n + ".bias" for n in ("attn_q", "attn_k", "attn_v") if cfg.qkv_bias]
        return names + ([blk + "attn_output.bias"] if cfg.attn_out_bias else [])

    def _vector(self, full_name: str):
        buf = self._vectors.get(full_name)
        if buf is None:
            stem, kind = full_name.rsplit(".", 1)
            w = self.weights
            values = w.vector(stem) if kind == "weight" else w.bias(stem)
            buf = self._vectors[full_name] = self.gpu.upload(np.asarray(values, np.float32))
        return buf

    def new_cache(self, config, max_tokens: int) -> WebGPUKVCache:
        return WebGPUKVCache(self.gpu, len(config.kv_layers), config.n_head_kv, config.head_dim, max_tokens)

    has_decode_step = True
    has_run_step = False  # one token per sequence a step (engine/generation/speculation.py does not draft here)

    def decode(self, ids, caches: Sequence[WebGPUKVCache]) -> np.ndarray:
        """One token per sequence through the model and the head, in one recording: raw logits (M, head rows)."""
        for c in caches:
            c.reserve(1)
        return self._run(np.asarray(ids, np.int64), [(c, m, 1) for m, c in enumerate(caches)], head=True)

    def forward(self, cfg, w, be, ids: np.ndarray, cache: WebGPUKVCache) -> np.ndarray:
        """A prompt chunk (models/family.py's ForwardFn): ids appended to cache; final-normed hidden (T, n_embd)."""
        return self._run(np.asarray(ids, np.int64), [(cache, 0, len(ids))], head=False)

    def end_prompt(self) -> None:
        self._scratch = {t: s for t, s in self._scratch.items() if t <= _PLANNED_ROWS}  # a prompt's activations go

    def end_sequences(self) -> None:
        self._plans.clear()  # they hold the finished sequences' caches

    # --- ops a caller may still ask for (the head of a prompt's last rows) ------------------------------------

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        """x @ W.T on the device, in runs of rows whose output fits one binding (a prompt's logits over Gemma's
        262,144-row head: 128 rows per run on a 128 MiB limit)."""
        per = max(1, self.gpu.matrices.max_binding_bytes // (4 * w.rows))
        if len(x) <= per:
            return self.gpu.matrices.matmul(x, w)
        return np.concatenate([self.gpu.matrices.matmul(x[r : r + per], w) for r in range(0, len(x), per)])

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        return [self.matmul(x, w) for w in ws]

    def embed(self, w: QTensor, ids) -> np.ndarray:
        return reference.embed_rows(w, ids)

    # --- the pass ---------------------------------------------------------------------------------------------

    def _buffers(self, T: int) -> dict:
        """Activation buffers for T rows (kept for the next pass of as many rows: a decode step's M)."""
        s = self._scratch.get(T)
        if s is None:
            cfg, b = self.config, self.gpu.buffer
            H, Hkv, D, E = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_embd
            s = {"x": b(T * E * 4), "h": b(T * E * 4), "q": b(T * H * D * 4), "q2": b(T * H * D * 4),
                 "k": b(T * Hkv * D * 4), "k2": b(T * Hkv * D * 4), "v": b(T * Hkv * D * 4),
                 "att": b(T * H * D * 4), "o": b(T * E * 4), "g": b(T * cfg.n_ff * 4), "starts": b(T * 4),
                 "rope": {bs: b(T * cfg.rope_dim * 4) for bs in set(zip(cfg.layer_rope_base, cfg.layer_rope_scale))}}
            if cfg.fused_qkv:
                s["qkv"] = b(T * (H + 2 * Hkv) * D * 4)
            if cfg.fused_gate_up:
                s["gu"] = b(T * 2 * cfg.n_ff * 4)
            else:
                s["gate"], s["up"] = b(T * cfg.n_ff * 4), b(T * cfg.n_ff * 4)
            self._scratch[T] = s
        return s

    def _head(self) -> QTensor:
        w = self.weights
        return w.tensor("output") if w.has("output") else w.tensor("token_embd")

    def _write_rope_tables(self, buf: dict, positions: np.ndarray) -> None:
        """cos|sin (T, 2, rope_dim/2) of the rows' positions, one table per (base, linear factor) the layers use."""
        cfg = self.config
        divisors = frequency_divisors(cfg, self.weights)
        for (base, scale), table in buf["rope"].items():
            cos, sin = rope_tables(positions, cfg.rope_dim, base, scale, divisors, cfg.rope_attn_factor)
            self.gpu.write(table, np.stack([cos, sin], axis=1))

    def _run(self, ids: np.ndarray, seqs: list[tuple[WebGPUKVCache, int, int]], head: bool) -> np.ndarray:
        """ids' rows through the model: seqs (cache, first row, rows) say which rows belong to which sequence
        (each cache already reserved); every cache advances by its rows. Returns the head's raw output (head) or
        the final-normed hidden states."""
        cfg, w, T = self.config, self.weights, len(ids)
        buf = self._buffers(T)
        x = reference.embed_rows(w.tensor("token_embd"), ids).astype(np.float32)
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        self.gpu.write(buf["x"], x)
        self.gpu.write(buf["starts"], np.array([c.length for c, _, _ in seqs], np.uint32))
        self._write_rope_tables(buf, np.concatenate([np.arange(c.length, c.length + n) for c, _, n in seqs]))
        key = (T, head, tuple((c.serial, row0, n) for c, row0, n in seqs))
        plan = self._plans.get(key) or self._record(buf, T, seqs, head)
        if T <= _PLANNED_ROWS:
            if len(self._plans) >= _MAX_PLANS and key not in self._plans:
                self._plans.clear()
            self._plans[key] = plan
        plan.run()
        if head:
            rows = self._head().rows
            result = self.gpu.read(buf["logits"], T * rows).reshape(T, rows)
        else:
            result = self.gpu.read(buf["h"], T * cfg.n_embd).reshape(T, cfg.n_embd)
        for cache, _, n in seqs:
            cache.advance(n)
        return result

    def _record(self, buf: dict, T: int, seqs, head: bool) -> Plan:
        """The pass's dispatches over buf's buffers and the sequences' caches."""
        cfg = self.config
        plan = Plan(self.gpu)
        for i in range(cfg.n_layer):
            table = buf["rope"][cfg.layer_rope_base[i], cfg.layer_rope_scale[i]]
            self._attention_block(plan, buf, i, T, seqs, table)
            self._mlp_block(plan, buf, i, T)
        self._norm(plan, buf["x"], "output_norm.weight", buf["h"], T, cfg.n_embd)
        if head:
            out = self._head()
            if buf.get("logits") is None:
                buf["logits"] = self.gpu.buffer(T * out.rows * 4)
            plan.matmul(buf["h"], buf["logits"], T, out)
        return plan

    def _norm(self, rec: Plan, src, weight: str, dst, rows: int, n: int, accumulate: bool = False) -> None:
        rec.dispatch("rms_norm", [src, self._vector(weight), dst], params(n, float(self.config.rms_eps),
                                                                          int(accumulate)), (rows, 1))

    def _add(self, rec: Plan, x, y, count: int, n: int) -> None:
        rec.elementwise("add", [x, y], params(count, n), count)

    def _attention_block(self, rec: Plan, buf: dict, i: int, T: int, seqs, table) -> None:
        cfg, w, blk = self.config, self.weights, f"blk.{i}."
        H, Hkv, D, E = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_embd
        self._norm(rec, buf["x"], blk + "attn_norm.weight", buf["h"], T, E)
        q, k, v = buf["q"], buf["k"], buf["v"]
        if cfg.fused_qkv:  # one matrix: q rows, then k, then v
            width = (H + 2 * Hkv) * D
            rec.matmul(buf["h"], buf["qkv"], T, w.tensor(blk + "attn_qkv"))
            for dst, n, off in ((q, H * D, 0), (k, Hkv * D, H * D), (v, Hkv * D, (H + Hkv) * D)):
                rec.elementwise("columns", [buf["qkv"], dst], params(T, n, width, off), T * n)
        else:
            for dst, name in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")):
                rec.matmul(buf["h"], dst, T, w.tensor(blk + name))
        if cfg.qkv_bias:
            for dst, name, n in ((q, "attn_q", H * D), (k, "attn_k", Hkv * D), (v, "attn_v", Hkv * D)):
                self._add(rec, dst, self._vector(blk + name + ".bias"), T * n, n)
        if cfg.qk_norm:  # per head, over D
            self._norm(rec, q, blk + "attn_q_norm.weight", buf["q2"], T * H, D)
            self._norm(rec, k, blk + "attn_k_norm.weight", buf["k2"], T * Hkv, D)
            q, k = buf["q2"], buf["k2"]
        half = cfg.rope_dim // 2
        for x, heads in ((q, H), (k, Hkv)):
            rec.elementwise("rope", [x, table], params(T, heads, D, half, int(cfg.rope_style == "neox")),
                            T * heads * half)
        slot = cfg.kv_slot.get(i, i)
        for seq, (cache, row0, n) in enumerate(seqs):
            for src, dst in ((k, cache.k[slot]), (v, cache.v[slot])):
                rec.elementwise("kv_store", [src, dst, buf["starts"]], params(row0, seq, n, Hkv * D),
                                n * Hkv * D // 2)
            rec.dispatch("attention", [q, cache.k[slot], cache.v[slot], buf["att"], buf["starts"]],
                         params(row0, seq, H, Hkv, D, cfg.layer_window[i], float(cfg.attn_scale),
                                float(cfg.attn_softcap or 0.0)), (H, n))
        rec.matmul(buf["att"], buf["o"], T, w.tensor(blk + "attn_output"))
        if cfg.attn_out_bias:
            self._add(rec, buf["o"], self._vector(blk + "attn_output.bias"), T * E, E)
        if cfg.post_norms:
            self._norm(rec, buf["o"], blk + "post_attention_norm.weight", buf["x"], T, E, accumulate=True)
        else:
            self._add(rec, buf["x"], buf["o"], T * E, T * E)

    def _mlp_block(self, rec: Plan, buf: dict, i: int, T: int) -> None:
        cfg, w, blk = self.config, self.weights, f"blk.{i}."
        E, F = cfg.n_embd, cfg.n_ff
        self._norm(rec, buf["x"], blk + "ffn_norm.weight", buf["h"], T, E)
        gelu = int(cfg.act == "gelu_tanh")
        if cfg.fused_gate_up:  # ffn_up: the gate's rows, then the up's
            rec.matmul(buf["h"], buf["gu"], T, w.tensor(blk + "ffn_up"))
            rec.elementwise("act_mul", [buf["gu"], buf["gu"], buf["g"]], params(T, F, 2 * F, 2 * F, F, gelu), T * F)
        else:
            rec.matmul(buf["h"], buf["gate"], T, w.tensor(blk + "ffn_gate"))
            rec.matmul(buf["h"], buf["up"], T, w.tensor(blk + "ffn_up"))
            rec.elementwise("act_mul", [buf["gate"], buf["up"], buf["g"]], params(T, F, F, F, 0, gelu), T * F)
        rec.matmul(buf["g"], buf["o"], T, w.tensor(blk + "ffn_down"))
        if cfg.post_norms:
            self._norm(rec, buf["o"], blk + "post_ffw_norm.weight", buf["x"], T, E, accumulate=True)
        else:
            self._add(rec, buf["x"], buf["o"], T * E, T * E)
