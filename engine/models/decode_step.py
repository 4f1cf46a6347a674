"""The compiled decode step: one new token for each of M sequences through the whole model in one njit call.

Python glue per layer costs as much as the matvecs at decode (../shared/research/kernels.md, section 5), so a
decode step — norms, the int8 matvecs over the GGUF blocks in place, RoPE, the KV write, attention,
activations, residuals, the final norm and the output head — is one compiled function. Every weight is read
once per step whatever M is (the matvec reuses each row from L1 for the M activation vectors), which is what
lets concurrent generations decode together. Both supported families run through it, told apart by the flags
their modules declare (STEP_FLAGS: per-head q/k norms, post norms, GELU or SiLU; RoPE style from the config).

Prompts take the families' Python forward passes (dequantize per layer + BLAS sgemm); at one token the two
agree up to float summation order (tests/test_decode_step.py).

Weights are addressed as rows [byte offset, rows, row bytes, type] into the one buffer of the mapped file, so
no tuple of hundreds of arrays is unboxed on every call. A split model has no such buffer and decodes layer by
layer in Python instead (build() returns None).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from engine.cache.kv import KVCache
from engine.kernels import cpu, cpu_q8, glue, vmath
from engine.models.config import ModelConfig
from engine.models.weights import Weights

_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # rows of mats[l]
_NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm")  # rows of norms[l]
# iparams slots
_H, _HKV, _D, _ROPE_DIM, _QK_NORM, _POST_NORMS, _GELU, _NEOX = range(8)
_LEGACY_CODES = tuple(int(t) for t in cpu_q8.LEGACY_TYPES)
_K_CODES = tuple(int(t) for t in cpu_q8.K_TYPES)
_EMPTY_I8, _EMPTY_F32 = np.empty((0, 0), np.int8), np.empty((0, 0), np.float32)
_EMPTY_I16 = np.empty((0, 0, 0), np.int16)


# =========================================================================================================
# Compiled pieces (flat 1-D vectors with offsets: numba reshapes only contiguous arrays)
# =========================================================================================================


@njit(cache=True)
def _needs(mats):
    """Which activation quantizations the matrices of one group read: (legacy blocks, K super-blocks)."""
    legacy = False
    kq = False
    for i in range(mats.shape[0]):
        c = mats[i, 3]
        for t in _LEGACY_CODES:
            legacy |= c == t
        for t in _K_CODES:
            kq |= c == t
    return legacy, kq


@njit(cache=True)
def _matvec(buf, mats, x, n_chunks, tier):
    """x (M, K) @ W_i.T for the matrices mats (n, 4) of buf, side by side: (M, sum of rows), one parallel call."""
    M, K = x.shape
    legacy, kq = _needs(mats)
    xq8, xs8, xqk, xdk, xbk = _EMPTY_I8, _EMPTY_F32, _EMPTY_I8, _EMPTY_F32, _EMPTY_I16
    if legacy:
        xq8 = np.empty((M, K), np.int8)
        xs8 = np.empty((M, 2 * (K // 32)), np.float32)
        cpu_q8.quantize_legacy_into(x, xq8, xs8)
    if kq:
        xqk = np.empty((M, K), np.int8)
        xdk = np.empty((M, K // 256), np.float32)
        xbk = np.empty((M, K // 256, 24), np.int16)
        cpu_q8.quantize_k_into(x, xqk, xdk, xbk)
    rows = 0
    for i in range(mats.shape[0]):
        rows += mats[i, 1]
    out = np.empty((M, rows), np.float32)
    cpu_q8.matvec_buf_into(buf, mats, xq8, xs8, xqk, xdk, xbk, x, out, n_chunks, tier)
    return out


@njit(cache=True)
def _rope_tables(inv_freq, pos, rope_scale):
    """cos, sin (n_layer, M, rope_dim/2) f32 for each layer's frequencies at each sequence's position (angles in
    f64, as ops.rope_tables): once per step, not per head."""
    L, half = inv_freq.shape
    M = pos.shape[0]
    cos, sin = np.empty((L, M, half), np.float32), np.empty((L, M, half), np.float32)
    for layer in range(L):
        for m in range(M):
            p = np.float64(pos[m]) / rope_scale
            for i in range(half):
                ang = p * inv_freq[layer, i]
                cos[layer, m, i], sin[layer, m, i] = math.cos(ang), math.sin(ang)
    return cos, sin


@njit(cache=True, fastmath=True)
def _attend_part(qkv, q0, group, D, kf, k0, cap, vf, v0, n, scale, scores, acc, iscratch):
    """The group query heads at qkv[q0:] (sharing one kv head) over n cached positions: keys transposed at flat
    offset k0 of kf (one row of cap positions per head dim), values at v0 of vf (rows of D). For each head g:
    acc[g] (D,) = sum_j exp(s_j - max) v_j with s_j = q.k_j * scale; returns (max, sum of exp) per head, two
    (group,) arrays; scores (group, >= n) and iscratch (>= n) int32 are scratch. Every inner loop runs along
    contiguous memory with no horizontal sum, which is what LLVM vectorizes (row-by-row dot products were 10x
    slower)."""
    mx = np.empty(group, np.float32)
    total = np.zeros(group, np.float32)
    for g in range(group):
        s = scores[g, :n]
        s[:] = 0.0
        q = qkv[q0 + g * D : q0 + (g + 1) * D]
        d = 0
        while d + 4 <= D:  # four key rows per pass over s: a quarter of the loads and stores of s
            o = k0 + d * cap
            r0, r1, r2, r3 = kf[o : o + n], kf[o + cap : o + cap + n], kf[o + 2 * cap : o + 2 * cap + n], \
                kf[o + 3 * cap : o + 3 * cap + n]
            q_0, q_1, q_2, q_3 = q[d], q[d + 1], q[d + 2], q[d + 3]
            for j in range(n):
                s[j] += q_0 * r0[j] + q_1 * r1[j] + q_2 * r2[j] + q_3 * r3[j]
            d += 4
        for d in range(d, D):
            kr = kf[k0 + d * cap : k0 + d * cap + n]
            for j in range(n):
                s[j] += q[d] * kr[j]
        for j in range(n):
            s[j] *= scale
        m = s[0]
        for j in range(1, n):
            m = max(m, s[j])
        for j in range(n):
            s[j] -= m
        vmath.exp_inplace(s, iscratch)
        t = np.float32(0.0)
        for j in range(n):
            t += s[j]
        mx[g], total[g] = m, t
        a = acc[g]
        a[:] = 0.0
        j = 0
        while j + 4 <= n:  # four value rows per pass over a
            o = v0 + j * D
            r0, r1, r2, r3 = vf[o : o + D], vf[o + D : o + 2 * D], vf[o + 2 * D : o + 3 * D], vf[o + 3 * D : o + 4 * D]
            p0, p1, p2, p3 = s[j], s[j + 1], s[j + 2], s[j + 3]
            for d in range(D):
                a[d] += p0 * r0[d] + p1 * r1[d] + p2 * r2[d] + p3 * r3[d]
            j += 4
        for j in range(j, n):
            vr = vf[v0 + j * D : v0 + (j + 1) * D]
            for d in range(D):
                a[d] += s[j] * vr[d]
    return mx, total


@njit(cache=True)
def _attend_task(t, qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, n_split, part_max, part_sum, part_acc):
    """Work item t of _attend: one sequence, one kv head (its group of query heads), one key range."""
    m, kvh, sp = t // (Hkv * n_split), (t // n_split) % Hkv, t % n_split
    kc, vc = kcs[m], vcs[m]
    group = H // Hkv
    p = pos[m]
    first = max(0, p - window + 1) if window > 0 else 0
    n = p + 1 - first
    j0, j1 = sp * n // n_split, (sp + 1) * n // n_split
    if j0 == j1:
        return  # more ranges than keys: part_sum stays 0 and the merge skips it
    cap = kc.shape[3]
    k0 = ((layer * Hkv + kvh) * D) * cap + first + j0
    v0 = ((layer * Hkv + kvh) * cap + first + j0) * D
    acc = np.empty((group, D), np.float32)
    gmax, gsum = _attend_part(qkv[m], kvh * group * D, group, D, kc.reshape(-1), k0, cap, vc.reshape(-1), v0,
                              j1 - j0, scale, np.empty((group, j1 - j0), np.float32), acc, np.empty(j1 - j0, np.int32))
    for g in range(group):
        h = kvh * group + g
        part_max[m, h, sp] = gmax[g]
        part_sum[m, h, sp] = gsum[g]
        for d in range(D):
            part_acc[m, h, sp, d] = acc[g, d]


@njit(parallel=True, cache=True)
def _attend_tasks(n_tasks, qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, n_split, part_max, part_sum, part_acc):
    # Nothing but the loop: an array expression in a parallel=True body becomes a parallel region of its own,
    # launched once per iteration (that cost 45 us per layer).
    for t in prange(n_tasks):
        _attend_task(t, qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, n_split, part_max, part_sum, part_acc)


@njit(cache=True)
def _attend(qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, out, n_split):
    """Causal (sliding-window when window > 0) GQA attention of each sequence's one query per head over its
    cache: qkv (M, (H + 2 Hkv) D) holds the roped queries; out (M, H D).

    Work is split over (sequence, kv head, key range) so both threads stay busy whatever the head count
    (SmolLM2 has 3 kv heads, Gemma 1): each range gives a partial softmax (max, sum, weighted values), merged
    exactly afterwards as in flash-decoding."""
    M = qkv.shape[0]
    part_max = np.empty((M, H, n_split), np.float32)
    part_sum = np.zeros((M, H, n_split), np.float32)
    part_acc = np.empty((M, H, n_split, D), np.float32)
    _attend_tasks(M * Hkv * n_split, qkv, kcs, vcs, layer, pos, H, Hkv, D, window, scale, n_split, part_max,
                  part_sum, part_acc)
    for m in range(M):
        for h in range(H):
            mx = -np.inf
            for sp in range(n_split):
                if part_sum[m, h, sp] > 0:
                    mx = max(mx, part_max[m, h, sp])
            total = np.float32(0.0)
            o = out[m, h * D : (h + 1) * D]
            o[:] = 0.0
            for sp in range(n_split):
                if part_sum[m, h, sp] > 0:
                    w = np.float32(np.exp(part_max[m, h, sp] - mx))
                    total += w * part_sum[m, h, sp]
                    for d in range(D):
                        o[d] += w * part_acc[m, h, sp, d]
            for d in range(D):
                o[d] /= total


def _n_split(M: int, Hkv: int, longest: int, threads: int) -> int:
    """Key ranges per (sequence, kv head): about two tasks per thread, ranges of at least 64 keys."""
    return max(1, min(-(-2 * threads // (M * Hkv)), longest // 64))


@njit(cache=True)
def _add_normed(x, y, w, eps, post):
    """x += y, or x += rms_norm(y) * w with post norms (Gemma); row by row."""
    M, E = x.shape
    t = np.empty(E, np.float32)
    for m in range(M):
        if post:
            glue.rms_norm_into(y[m], 0, E, w, eps, t, 0)
            for i in range(E):
                x[m, i] += t[i]
        else:
            for i in range(E):
                x[m, i] += y[m, i]


@njit(cache=True)
def decode_step(buf, mats, head, norms, qk_norms, out_norm, inv_freq, windows, fparams, iparams, x, pos, kcs, vcs,
                n_chunks, n_split, tier):
    """x (M, E): the embedded new token of each sequence at positions pos (M,); kcs/vcs: each sequence's cache
    arrays (keys (n_layer, Hkv, D, capacity), values (n_layer, Hkv, capacity, D); capacity > pos), written at
    pos. Returns the head's logits (M, head rows).
    n_chunks: row ranges per matvec; n_split: key ranges per attention head (parallel work items)."""
    M, E = x.shape
    H, Hkv, D = iparams[_H], iparams[_HKV], iparams[_D]
    qk_norm, post = iparams[_QK_NORM] != 0, iparams[_POST_NORMS] != 0
    gelu, neox = iparams[_GELU] != 0, iparams[_NEOX] != 0
    eps, scale, rope_scale = fparams[0], np.float32(fparams[1]), fparams[2]
    a = np.empty((M, H * D), np.float32)
    cos, sin = _rope_tables(inv_freq, pos, rope_scale)
    for layer in range(mats.shape[0]):
        h = glue.rms_norm_rows(x, norms[layer, 0], eps)
        qkv = _matvec(buf, mats[layer, 0:3], h, n_chunks, tier)  # (M, (H + 2 Hkv) D)
        for m in range(M):
            row = qkv[m]
            for hd in range(H + Hkv):  # queries then keys: per-head norm, then RoPE
                o = hd * D
                if qk_norm:
                    glue.rms_norm_into(row, o, D, qk_norms[layer, 0 if hd < H else 1], eps, row, o)
                glue.rope_into(row, o, cos[layer, m], sin[layer, m], neox)
            kc, vc = kcs[m], vcs[m]
            for kh in range(Hkv):
                for d in range(D):
                    kc[layer, kh, d, pos[m]] = row[(H + kh) * D + d]  # keys transposed (cache/kv.py)
                    vc[layer, kh, pos[m], d] = row[(H + Hkv + kh) * D + d]
        _attend(qkv, kcs, vcs, layer, pos, H, Hkv, D, windows[layer], scale, a, n_split)
        _add_normed(x, _matvec(buf, mats[layer, 3:4], a, n_chunks, tier), norms[layer, 2], eps, post)
        h = glue.rms_norm_rows(x, norms[layer, 1], eps)
        gu = _matvec(buf, mats[layer, 4:6], h, n_chunks, tier)  # (M, 2F): [gate | up]
        F = gu.shape[1] // 2
        g = glue.act_mul(gu[:, :F], gu[:, F:], gelu)
        _add_normed(x, _matvec(buf, mats[layer, 6:7], g, n_chunks, tier), norms[layer, 3], eps, post)
    return _matvec(buf, head, glue.rms_norm_rows(x, out_norm, eps), n_chunks, tier)


# =========================================================================================================
# Python side: the tables, built once per model
# =========================================================================================================


class DecodeStep:
    """Callable (ids (M,), caches) -> raw head logits (M, head rows); appends one token to each cache."""

    def __init__(self, cfg: ModelConfig, w: Weights, flags: dict, buf: np.ndarray, tier: str | None = None):
        self.buf = buf
        E, D, L = cfg.n_embd, cfg.head_dim, cfg.n_layer
        self.mats = np.array([[self._entry(w, f"blk.{i}.{r}") for r in _ROLES] for i in range(L)], np.int64)
        self.head = np.array([self._entry(w, "output" if w.has("output") else "token_embd")], np.int64)
        self.norms = np.zeros((L, len(_NORMS), E), np.float32)
        self.qk_norms = np.zeros((L, 2, D), np.float32)
        for i in range(L):
            for j, n in enumerate(_NORMS):
                if w.has(f"blk.{i}.{n}"):
                    self.norms[i, j] = w.vector(f"blk.{i}.{n}")
            if flags["qk_norm"]:
                self.qk_norms[i] = [w.vector(f"blk.{i}.attn_q_norm"), w.vector(f"blk.{i}.attn_k_norm")]
        self.out_norm = w.vector("output_norm")
        factors = w.optional_vector("rope_freqs")
        self.inv_freq = np.empty((L, cfg.rope_dim // 2), np.float64)
        for i in range(L):  # as ops.rope_tables
            inv = 1.0 / (cfg.layer_rope_base[i] ** (np.arange(0, cfg.rope_dim, 2, dtype=np.float64) / cfg.rope_dim))
            self.inv_freq[i] = inv / factors.astype(np.float64) if factors is not None else inv
        self.windows = np.array(cfg.layer_window, np.int64)
        self.fparams = np.array([cfg.rms_eps, cfg.attn_scale, cfg.rope_scaling.factor], np.float64)
        self.iparams = np.array([cfg.n_head, cfg.n_head_kv, D, cfg.rope_dim, flags["qk_norm"], flags["post_norms"],
                                 flags["act"] == "gelu_tanh", cfg.rope_style == "neox"], np.int64)
        self.embd = w.tensor("token_embd")
        self.embed_scale = np.float32(cfg.embed_scale)
        self.tier = cpu_q8.tier_token(tier)

    def _entry(self, w: Weights, name: str) -> list[int]:
        t = w.tensor(name)
        off = t.raw.__array_interface__["data"][0] - self.buf.__array_interface__["data"][0]
        if not 0 <= off <= self.buf.size - t.raw.nbytes or not t.raw.flags.c_contiguous:
            raise ValueError(f"{name} does not lie in the model buffer")
        return [off, t.rows, t.raw.shape[1], int(t.ggml_type)]

    def __call__(self, ids, caches: list[KVCache]) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) != len(caches) or not len(ids):
            raise ValueError(f"{len(ids)} tokens for {len(caches)} sequences")
        x = cpu.dequantize_rows_into(self.embd.raw, self.embd.ggml_type, ids,
                                     np.empty((len(ids), self.embd.cols), np.float32))
        x *= self.embed_scale
        for c in caches:
            c.reserve(1)
        pos = np.array([c.length for c in caches], np.int64)
        threads = numba.get_num_threads()
        n_split = _n_split(len(caches), int(self.iparams[_HKV]), int(pos.max()) + 1, threads)
        logits = decode_step(self.buf, self.mats, self.head, self.norms, self.qk_norms, self.out_norm, self.inv_freq,
                             self.windows, self.fparams, self.iparams, x, pos, tuple(c.k for c in caches),
                             tuple(c.v for c in caches), 4 * threads, n_split, self.tier)
        for c in caches:
            c.advance(1)
        return logits


def build(cfg: ModelConfig, w: Weights, flags: dict | None, tier: str | None = None) -> DecodeStep | None:
    """The compiled step for this model, or None where it cannot run: a split model (no single buffer) or a
    family without STEP_FLAGS."""
    buf = w.buffer()
    if buf is None or flags is None:
        return None
    return DecodeStep(cfg, w, flags, buf, tier)
