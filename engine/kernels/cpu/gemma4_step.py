"""Gemma 4's layers inside the compiled decode step (decode_step.py): layers whose head width, KV-head count
and MLP width differ, KV sharing, the V-norm, per-layer embeddings (PLE) and the per-layer output scale.

The step's attention kernels run on one head width and KV-head count, the widest (the cache is laid out so):
a narrower layer's queries and keys are widened with zeros (zero dims add nothing to a dot product) and its KV
heads replicated to the most KV heads when written (query head h then finds its own KV head), and the merged
output is narrowed back before the output matrix. Prompts (models/gemma4.py) write the cache the same way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from engine.kernels.cpu import attention, dequant, ops, rowops
from engine.kernels.cpu.step_roles import OFFSET, ROW_BYTES, TYPE

# columns of shp[l] (Layers): the layer's head width, KV heads, RoPE pairs, MLP width (an expert's in a MoE layer),
# flags, and whether its queries are widened to the step's head width
HEAD_DIM, KV_HEADS, ROPE_PAIRS, MLP_WIDTH, FLAGS, WIDE = range(6)
VNORM, K_EQ_V, SHARED, END = 1, 2, 4, 8  # flags per layer (shp[layer, FLAGS])


class Layers(NamedTuple):
    """Per-layer widths and Gemma 4's tables, built once per model (tables())."""
    shp: np.ndarray  # (L, 6) per layer [HEAD_DIM, KV_HEADS, ROPE_PAIRS, MLP_WIDTH, FLAGS, WIDE]
    scales: np.ndarray  # (L,) output scales (1 but in Gemma 4)
    ple_norm: np.ndarray  # (P,) the per-layer embeddings' projection norm
    ple_table: np.ndarray  # the per-layer token table's entry (a mats row)
    ple_proj: np.ndarray  # the per-layer projection's entry, (1, 5), or (0, 5): no per-layer embeddings


class LayerBuffers(NamedTuple):
    """The step's per-layer tables with its buffers for one step over M sequences (decode_step.py builds it):
    Gemma 4's, and the MLP's, flat, viewed at each layer's width."""
    shp: np.ndarray
    scales: np.ndarray
    ple_norm: np.ndarray
    q_wide: np.ndarray  # (M, H D) a narrower layer's queries widened
    a_narrow: np.ndarray  # (M H D,) the attention output narrowed back to the layer's width
    ple: np.ndarray  # (M, L P) the per-layer inputs
    ple_mix: np.ndarray  # (M, L P) the projection of the embeddings
    ple_gate: np.ndarray  # (M, P) a layer's inp_gate output
    ple_act: np.ndarray  # (M, P) GELU(gate) * the layer's input
    ple_out: np.ndarray  # (M, E) its projection back
    ones: np.ndarray  # (D,) the V-norm's weights
    gate_up: np.ndarray  # (J 2F,) the MLP's [gate | up]
    act: np.ndarray  # (J F,) its activation
    ple_proj: np.ndarray  # the per-layer projection's entry, (1, 5) or (0, 5)


@njit(cache=True)
def prepare(qkv, qw, kcs, vcs, slot, layer, pos, qk_norms, cos, sin, H, Dl, Hkvl, pairs, D, Hkv, flags, ones, eps):
    """One layer's queries and keys at their own width Dl: per-head norms, NeoX RoPE on `pairs` pairs, V-norm;
    queries widened into qw (M, H D); keys and values (unless the layer shares an earlier one's) written at
    pos into the cache's slot, widened and with each KV head repeated Hkv / Hkvl times."""
    rep = Hkv // Hkvl
    k_off, v_off = H * Dl, H * Dl + Hkvl * Dl
    raw = np.empty(Hkvl * Dl, np.float32)
    for m in range(qkv.shape[0]):
        row = qkv[m]
        c, s = cos[layer, m, :pairs], sin[layer, m, :pairs]
        for h in range(H):
            rowops.rms_norm_into(row, h * Dl, Dl, qk_norms[layer, 0], eps, row, h * Dl)
            rowops.rope_into(row, h * Dl, c, s, True)
            for d in range(D):
                qw[m, h * D + d] = row[h * Dl + d] if d < Dl else np.float32(0)
        if flags & SHARED:
            continue
        if flags & K_EQ_V:  # no value matrix: the values are the keys before their norm and RoPE
            raw[:] = row[k_off : k_off + Hkvl * Dl]
        else:
            raw[:] = row[v_off : v_off + Hkvl * Dl]
        for kh in range(Hkvl):
            rowops.rms_norm_into(row, k_off + kh * Dl, Dl, qk_norms[layer, 1], eps, row, k_off + kh * Dl)
            rowops.rope_into(row, k_off + kh * Dl, c, s, True)
            if flags & VNORM:
                rowops.rms_norm_into(raw, kh * Dl, Dl, ones, eps, raw, kh * Dl)
        kc, vc, p = kcs[m], vcs[m], pos[m]
        for slot_head in range(Hkv):
            kh = slot_head // rep
            for d in range(D):
                kv = row[k_off + kh * Dl + d] if d < Dl else np.float32(0)
                vv = raw[kh * Dl + d] if d < Dl else np.float32(0)
                kc[slot, slot_head, p // attention.TILE, d, p % attention.TILE] = attention.kv_value(kv, kc)
                vc[slot, slot_head, p, d] = attention.kv_value(vv, vc)


@njit(cache=True)
def narrow(a, an, H, D, Dl):
    """an (M, H Dl) = each head's first Dl dims of a (M, H D)."""
    for m in range(a.shape[0]):
        for h in range(H):
            for d in range(Dl):
                an[m, h * Dl + d] = a[m, h * D + d]


@njit(cache=True)
def ple_tokens(buf, entry, ids, scale, out):
    """out (M, L P) = the per-layer token embeddings of ids (rows of a stored table) times scale."""
    rb, code = entry[ROW_BYTES], entry[TYPE]
    for m in range(ids.shape[0]):
        o = entry[OFFSET] + ids[m] * rb
        dequant.dequant_row(buf[o : o + rb], code, out[m])
        for i in range(out.shape[1]):
            out[m, i] *= scale


@njit(cache=True)
def ple_combine(proj, tokens, norm_w, P, eps, proj_scale):
    """tokens (M, L P) becomes the per-layer inputs: (rms_norm(proj * proj_scale) per P-slice + tokens) / sqrt(2)."""
    M, LP = tokens.shape
    t = np.empty(P, np.float32)
    half = np.float32(1 / math.sqrt(2))
    for m in range(M):
        for s0 in range(0, LP, P):
            for i in range(P):
                t[i] = proj[m, s0 + i] * proj_scale
            rowops.rms_norm_into(t, 0, P, norm_w, eps, t, 0)
            for i in range(P):
                tokens[m, s0 + i] = (t[i] + tokens[m, s0 + i]) * half


@njit(cache=True)
def ple_gate(gate, ple, layer, P, out):
    """out (M, P) = GELU(gate) * this layer's per-layer input."""
    t, scratch = np.empty(P, np.float32), np.empty(P, np.int32)
    for m in range(gate.shape[0]):
        rowops.act_mul_row(gate[m], ple[m, layer * P : (layer + 1) * P], out[m], t, scratch, True)


@njit(cache=True)
def add_scaled(x, y, w, eps, scale):
    """x = (x + rms_norm(y) * w) * scale (the PLE output's norm, then the layer's output scale); y None-like
    (0 columns): x *= scale only."""
    M, E = x.shape
    t = np.empty(E, np.float32)
    for m in range(M):
        if y.shape[1]:
            rowops.rms_norm_into(y[m], 0, E, w, eps, t, 0)
            for i in range(E):
                x[m, i] += t[i]
        for i in range(E):
            x[m, i] *= scale


def tables(cfg, w, flags: dict, entry) -> Layers:
    """The step's per-layer tables (Layers). Uniform models get their one width on every row and no flags.
    entry(w, name): a matrix's mats row."""
    L, gemma4 = cfg.n_layer, bool(cfg.layer_head_dim)
    shp = np.zeros((L, 6), np.int64)
    for i in range(L):
        shp[i, HEAD_DIM : MLP_WIDTH + 1] = (cfg.layer_head_dim[i] if gemma4 else cfg.head_dim,
                      cfg.layer_kv_heads[i] if gemma4 else cfg.n_head_kv,
                      (cfg.layer_rope_dim[i] if gemma4 else cfg.rope_dim) // 2, _mlp_width(cfg, w, flags, i))
        if gemma4:
            source = cfg.layer_kv_source[i]
            shp[i, FLAGS] = (VNORM | END | (SHARED if source != i else 0)
                         | (K_EQ_V if source == i and not w.has(f"blk.{i}.attn_v") else 0))
            shp[i, WIDE] = 1
    scales = np.ones(L, np.float32)
    if gemma4:
        scales[:] = [w.vector(f"blk.{i}.layer_output_scale")[0] for i in range(L)]
    if cfg.per_layer_embd:
        return Layers(shp, scales, w.vector("per_layer_proj_norm"),
                      np.array(entry(w, "per_layer_token_embd"), np.int64),
                      np.array([entry(w, "per_layer_model_proj")], np.int64))
    return Layers(shp, scales, np.ones(1, np.float32), np.zeros(5, np.int64), np.zeros((0, 5), np.int64))


def _mlp_width(cfg, w, flags: dict, i: int) -> int:
    """Layer i's MLP width (an expert's in a MoE layer), from its matrices."""
    if flags.get("moe"):
        return w.tensor(f"blk.{i}.ffn_gate_exps").rows // cfg.n_expert
    if flags.get("fused_gate_up"):  # phi3: gate and up rows in one matrix
        return w.tensor(f"blk.{i}.ffn_up").rows // 2
    return w.tensor(f"blk.{i}.ffn_gate").rows


def frequencies(cfg, w) -> np.ndarray:
    """Per layer its rotary frequencies (L, most pairs): a sliding layer's base over its own dims, a global
    layer's divided by `rope_freqs` (proportional RoPE); rows padded with zeros past a layer's pairs."""
    divisors = w.optional_vector("rope_freqs")
    rows = [ops.inv_freq(d, base, divisors if window == 0 else None)
            for d, base, window in zip(cfg.layer_rope_dim, cfg.layer_rope_base, cfg.layer_window)]
    out = np.zeros((len(rows), max(len(r) for r in rows)), np.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
