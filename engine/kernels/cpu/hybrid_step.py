"""A hybrid's layers inside the compiled decode step (decode_step.py): the gated DeltaNet layers of Qwen3.5
(models/deltanet.py is the prompt path's version) and its attention layers' output gate, as pieces the step's
worker runs between its phases.

A DeltaNet layer at one token: q|k|v and z from the step's first matvec phase (`attn_qkv`, `attn_gate` side
by side), alpha and beta from two tiny matrices (serial: `inputs`), then per sequence the convolution over
its state's last K-1 inputs, SiLU, L2-normed q and k, the decay and the write strength (`prepare`); the delta
rule per (sequence, value head) as parallel tasks (`delta_task`, recurrent.delta_token: the prompt path's
own arithmetic); the per-head RMSNorm gated by SiLU(z) (`gated_norm`). The states are each sequence's cache
arrays (`state["conv"]`, `state["ssm"]`, a row per recurrent layer), updated in place.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from engine.kernels.cpu import int8, recurrent, rowops
from engine.kernels.cpu.step_roles import OFFSET, ROW_BYTES, ROWS, TYPE

KIND, KV_SLOT, STATE_ROW = 0, 1, 2  # columns of kinds[l] (Recurrent): 0 attention, 1 DeltaNet, 2 LFM2's conv
K_HEADS, V_HEADS, V_DIM = 0, 1, 2  # dims: a DeltaNet's key heads, value heads, value head width


class Recurrent(NamedTuple):
    """A hybrid's tables, built once per model (tables()); stubs for a model without recurrent layers."""
    kinds: np.ndarray  # (L, 3) per layer [recurrent kind, KV cache slot, state row]
    conv_w: np.ndarray  # (R, C, K) the recurrent layers' conv weights
    ssm_a: np.ndarray  # (R, Hv)
    dt_bias: np.ndarray  # (R, Hv)
    ssm_norm: np.ndarray  # (R, D) the gated norm's weights
    dims: np.ndarray  # [Hk, Hv, D]
    gated: bool  # attention has an output gate (Qwen3.5)


class Hybrid(NamedTuple):
    """The step's hybrid tables with its buffers for one step over M sequences (decode_step.py builds it)."""
    kinds: np.ndarray
    conv_w: np.ndarray
    ssm_a: np.ndarray
    dt_bias: np.ndarray
    ssm_norm: np.ndarray
    dims: np.ndarray
    dq: np.ndarray  # (M, C) the convolution's output, q and k normed
    ab: np.ndarray  # (M, 2 Hv) [alpha | beta] logits
    gb: np.ndarray  # (M, 2 Hv) [decay | write strength]
    out: np.ndarray  # (M, Hv D) the delta rule's output, then the gated norm's
    gate: np.ndarray  # (M, H D) attention's output gate (width 0 without one)


@njit(cache=True)
def inputs(buf, entries, qh, h, ab, tier):
    """ab (M, 2 Hv) = [alpha | beta] rows (entries: the two matrices' mats rows), h quantized in qh."""
    xq8, xqn, xs8, xqk, xdk, xbk = qh
    start = np.int64(0)
    for i in range(entries.shape[0]):
        e = entries[i]
        int8.rows_into(e[TYPE], buf, e[OFFSET], e[ROW_BYTES], np.int64(0), e[ROWS], xq8, xs8, xqk, xdk, xbk, h, ab,
                       start, tier)
        start += e[ROWS]


@njit(cache=True)
def _silu(x):
    return x / (np.float32(1) + np.float32(math.exp(-x)))


@njit(cache=True)
def _l2_normalize(v, eps, scale):
    s = np.float32(0)
    for i in range(v.shape[0]):
        s += v[i] * v[i]
    inv = scale / max(np.float32(math.sqrt(s)), np.float32(eps))
    for i in range(v.shape[0]):
        v[i] *= inv


@njit(cache=True)
def prepare(qkvz, ab, conv_state, conv_w, ssm_a, dt_bias, Hk, Hv, D, eps, dq, gb):
    """One sequence: dq (C,) = SiLU(conv(state, q|k|v)) with q, k L2-normed (q times 1/sqrt(D)); the state
    shifted by one input; gb (2 Hv,) = [decay g | beta]. qkvz: [q|k|v (C) | z], ab: [alpha | beta] logits."""
    C, K = conv_w.shape
    for c in range(C):
        acc = np.float32(0)
        for i in range(K - 1):
            acc += conv_state[i, c] * conv_w[c, i]
        acc += qkvz[c] * conv_w[c, K - 1]
        dq[c] = _silu(acc)
        for i in range(K - 2):
            conv_state[i, c] = conv_state[i + 1, c]
        if K > 1:
            conv_state[K - 2, c] = qkvz[c]
    for j in range(2 * Hk):  # q heads, then k heads
        _l2_normalize(dq[j * D : (j + 1) * D], eps, np.float32(1 / math.sqrt(D)) if j < Hk else np.float32(1))
    for h in range(Hv):
        a = ab[h] + dt_bias[h]
        softplus = a if a > 20 else np.float32(math.log1p(math.exp(a)))
        gb[h] = ssm_a[h] * softplus
        gb[Hv + h] = np.float32(1) / (np.float32(1) + np.float32(math.exp(-ab[Hv + h])))


@njit(cache=True)
def delta_task(t, Hk, Hv, D, dq, gb, ssms, row, out):
    """Task t of the delta-rule phase: sequence t // Hv, value head t % Hv (key head h % Hk): out (M, Hv D)."""
    m, h = t // Hv, t % Hv
    kq = 2 * Hk * D
    q = dq[m, (h % Hk) * D : (h % Hk + 1) * D]
    k = dq[m, (Hk + h % Hk) * D : (Hk + h % Hk + 1) * D]
    v = dq[m, kq + h * D : kq + (h + 1) * D]
    mem, delta = np.empty(D, np.float32), np.empty(D, np.float32)
    recurrent.delta_token(q, k, v, gb[m, h], gb[m, Hv + h], ssms[m][row, h], out[m, h * D : (h + 1) * D], mem, delta)


@njit(cache=True)
def gated_norm(o, qkvz, C, Hv, D, norm_w, eps, out):
    """out (M, Hv D) = RMSNorm of each head of o by norm_w, times SiLU(z), z = qkvz[:, C:]."""
    for m in range(o.shape[0]):
        for h in range(Hv):
            rowops.rms_norm_into(o[m], h * D, D, norm_w, eps, out[m], h * D)
            for d in range(D):
                out[m, h * D + d] *= _silu(qkvz[m, C + h * D + d])


@njit(cache=True)
def split_gate(qkv, gate, H, D):
    """Attention with an output gate (Qwen3.5): q rows come as [q_h | gate_h] per head. Moves the gates to
    gate (M, H D) and closes the row up to [q | k | v] as the step's RoPE and attention read it."""
    M, W = qkv.shape
    for m in range(M):
        row = qkv[m]
        for h in range(H):
            for d in range(D):
                gate[m, h * D + d] = row[(2 * h + 1) * D + d]
        for h in range(1, H):  # q heads to their place, in order (each moves left)
            for d in range(D):
                row[h * D + d] = row[2 * h * D + d]
        for j in range(2 * H * D, W):  # k | v after them
            row[j - H * D] = row[j]


@njit(cache=True)
def apply_gate(a, gate):
    """a *= sigmoid(gate), the attention output's gate."""
    for m in range(a.shape[0]):
        for i in range(a.shape[1]):
            a[m, i] /= np.float32(1) + np.float32(math.exp(-gate[m, i]))


@njit(cache=True)
def recurrent_inputs(buf, entries, qh, h, qkv, hyb, convs, row, eps, tier):
    """The serial phase before the delta rule: alpha and beta, then every sequence's convolution (convs: its
    state arrays), norms, decay and write strength (prepare). hyb: the step's Hybrid."""
    inputs(buf, entries, qh, h, hyb.ab, tier)
    dims = hyb.dims
    for m in range(qkv.shape[0]):
        prepare(qkv[m], hyb.ab[m], convs[m][row], hyb.conv_w[row], hyb.ssm_a[row], hyb.dt_bias[row], dims[K_HEADS],
                dims[V_HEADS], dims[V_DIM], eps, hyb.dq[m], hyb.gb[m])


@njit(cache=True)
def shared_expert_gate(buf, entry, qh, h, sg, tier):
    """sg (M, 1) = the shared expert's gate logit (`ffn_gate_inp_shexp`, one row)."""
    xq8, xqn, xs8, xqk, xdk, xbk = qh
    int8.rows_into(entry[TYPE], buf, entry[OFFSET], entry[ROW_BYTES], np.int64(0), entry[ROWS], xq8, xs8, xqk, xdk,
                   xbk, h, sg, np.int64(0), tier)


@njit(cache=True)
def add_shared(dn, dns, sg):
    """dn += sigmoid(sg) * dns: the shared expert's output, scaled by its gate."""
    for m in range(dn.shape[0]):
        s = np.float32(1) / (np.float32(1) + np.float32(math.exp(-sg[m, 0])))
        for i in range(dn.shape[1]):
            dn[m, i] += s * dns[m, i]


_NO_CONV, _NO_SSM = np.zeros((1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32)


def tables(cfg, w) -> Recurrent:
    """The step's hybrid tables, built once (Recurrent). Stubs for a model without recurrent layers (every layer its
    own slot)."""
    L, s = cfg.n_layer, cfg.deltanet
    slot, row = cfg.kv_slot, cfg.state_row
    rows = sorted(row, key=row.get)
    kind = 2 if cfg.shortconv_kernel else 1  # a recurrent layer's kind: DeltaNet 1, LFM2's short conv 2
    kinds = np.array([[kind * (i in row), slot.get(i, 0), row.get(i, 0)] for i in range(L)], np.int64)
    gated = bool(cfg.attn_output_gate)
    if cfg.shortconv_kernel:  # (C, K) taps per layer; dims [0, 1, E]: its output is one "head" of n_embd
        conv = np.stack([w.vector(f"blk.{i}.shortconv.conv").reshape(cfg.n_embd, -1) for i in rows])
        z = np.zeros((1, 1), np.float32)
        return Recurrent(kinds, conv.astype(np.float32), z, z, z, np.array([0, 1, cfg.n_embd], np.int64), gated)
    if s is None:
        z = np.zeros((1, 1), np.float32)
        return Recurrent(kinds, _NO_CONV, z, z, z, np.zeros(3, np.int64), gated)
    conv = np.stack([w.vector(f"blk.{i}.ssm_conv1d").reshape(s.conv_channels, s.conv_kernel) for i in rows])
    ssm_a = np.stack([w.parameter(f"blk.{i}.ssm_a") for i in rows])
    dt = np.stack([w.bias(f"blk.{i}.ssm_dt") for i in rows])
    norm = np.stack([w.vector(f"blk.{i}.ssm_norm") for i in rows])
    dims = np.array([s.k_heads, s.v_heads, s.head_v_dim], np.int64)
    return Recurrent(kinds, conv.astype(np.float32), ssm_a, dt, norm, dims, gated)


def states(caches) -> tuple[list, list]:
    """Each sequence's recurrent state arrays (conv, ssm), updated in place by the step; stubs without them."""
    return [c.state.get("conv", _NO_CONV) for c in caches], [c.state.get("ssm", _NO_SSM) for c in caches]


@njit(cache=True)
def short_conv(bcx, convs, row, conv_w, out):
    """LFM2's convolution block at one token, every sequence: bcx (M, 3E) = [B | C | x]; out (M, E) =
    C * conv(state, B * x); each sequence's state (convs[m][row], (K-1, E)) shifted by that input."""
    E, K = conv_w.shape
    for m in range(bcx.shape[0]):
        state = convs[m][row]
        for c in range(E):
            bx = bcx[m, c] * bcx[m, 2 * E + c]
            acc = bx * conv_w[c, K - 1]
            for i in range(K - 1):
                acc += state[i, c] * conv_w[c, i]
            for i in range(K - 2):
                state[i, c] = state[i + 1, c]
            if K > 1:
                state[K - 2, c] = bx
            out[m, c] = bcx[m, E + c] * acc
