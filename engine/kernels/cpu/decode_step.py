"""The compiled decode step: one new token for each of M sequences through the whole model in one njit call.

Python glue per layer costs as much as the matvecs at decode (docs/design-log.md, "The CPU kernel measurements",
4), so a decode step — norms, the int8 matvecs over the GGUF blocks in place, RoPE, the KV write, attention,
activations, residuals, the final norm and the output head — is one compiled function. Every weight is read
once per step whatever M is (the matvec reuses each row from L1 for the M activation vectors), which is what
lets concurrent generations decode together. Every family runs through it, told apart by its step flags
(models/dense.step_flags: q/k/v biases, per-head q/k norms, post norms, the activation, a MoE MLP) and its
tables: MoE layers (moe_step.py), recurrent layers (hybrid_step.py: Qwen3.5's DeltaNet, LFM2's convolutions),
per-layer widths, KV sharing and per-layer embeddings (gemma4_step.py). Which tensor each slot reads:
step_roles.py (the slots' names: mats[layer, FFN_DOWN]); the matvec phases and input quantization: step_matvec.py.
The step's groups of tables and buffers are named tuples (moe_step.Moe, hybrid_step.Hybrid, gemma4_step.Layers,
...), read by field; they are defined at module level, so numba's on-disk cache keys and pickles their types.

The step is one parallel region: every thread walks the same phases of every layer (_worker), claiming matvec
row ranges and attention tasks from shared counters and waiting only for the phase before (atomics.py);
small serial phases run on whichever thread claims them (docs/design-log.md has the measurements).

Prompts take the families' forward passes over the backend's ops (dequantize per layer + BLAS sgemm); at one
token the two agree up to float summation order (tests/test_decode_step.py). The CPU backend (backend.py)
builds the step at load (step_tables.build: the tables it reads, built once per model) and runs it as its
`decode`. A model holding low-bit types (quant_types.LOWBIT_TYPES) runs a variant of this step compiled with its
types added to the type dispatches (step_variants.py), so that no other model compiles their kernels.

Weights are addressed as rows [byte offset, rows, row bytes, type, packed offset] into the one buffer of the
mapped file and the one buffer of packed copies (packed.py: the 4- and 5-bit legacy types, 8 rows interleaved,
2.4x faster per thread; layout.pack at load), so no tuple of hundreds of arrays is unboxed on every call. A split
model has no such buffer and decodes layer by layer instead (step_tables.build returns None).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from engine.kernels.cpu import atomics, attention, dequant, gemma4_step, hybrid_step, moe_step, packed, rowops
from engine.kernels.cpu.gemma4_step import FLAGS, HEAD_DIM, KV_HEADS, MLP_WIDTH, ROPE_PAIRS, WIDE, LayerBuffers
from engine.kernels.cpu.hybrid_step import K_HEADS, KIND, KV_SLOT, STATE_ROW, V_DIM, V_HEADS, Hybrid
from engine.kernels.cpu.moe_step import Moe, Shared
from engine.kernels.cpu.step_matvec import flat_quant, matvec_phase, quant_buffers, quant_view, quantize_input
from engine.kernels.cpu.step_roles import (ATTN_NORM, ATTN_OUT, ATTN_Q, ATTN_V, FFN_DOWN, FFN_GATE, FFN_NORM,
                                           FFN_ROUTER, FFN_UP, PACKED, PLE_GATE, PLE_PROJ, POST_ATTN_NORM,
                                           POST_FFN_NORM, POST_NORM, ROWS, SHEXP_DOWN, SHEXP_GATE, SHEXP_ROUTER,
                                           SHEXP_UP, SSM_ALPHA, SSM_BETA, TYPE)


# iparams slots
_H, _HKV, _D, _ROPE_DIM, _QK_NORM, _POST_NORMS, _GELU, _NEOX, _QKV_BIAS, _N_EXPERT, _N_USED = range(11)
# fparams slots
_EPS, _ATTN_SCALE, _ROPE_FACTOR, _SOFTCAP, _ROPE_ATTN_FACTOR = range(5)


class Biases(NamedTuple):
    """gpt-oss's biases and attention sinks (step_tables.py); placeholders of width 1 otherwise (the kernels test
    the width)."""
    sinks: np.ndarray  # (L, H), -inf: none
    o_bias: np.ndarray  # (L, E) the attention output's
    router: np.ndarray  # (L, n_expert)
    gate_up: np.ndarray  # (L, n_expert, 2F) the experts' gate|up
    down: np.ndarray  # (L, n_expert, E) the experts' down


# =========================================================================================================
# Compiled pieces (flat 1-D vectors with offsets: numba reshapes only contiguous arrays)
# =========================================================================================================


@njit(cache=True)
def _add_normed(x, y, w, eps, post):
    """x += y, or x += rms_norm(y) * w with post norms (Gemma); row by row."""
    M, E = x.shape
    t = np.empty(E, np.float32)
    for m in range(M):
        if post:
            rowops.rms_norm_into(y[m], 0, E, w, eps, t, 0)
            for i in range(E):
                x[m, i] += t[i]
        else:
            for i in range(E):
                x[m, i] += y[m, i]


@njit(cache=True)
def _norm_rows_into(x, w, eps, out):
    for m in range(x.shape[0]):
        rowops.rms_norm_into(x[m], 0, x.shape[1], w, eps, out[m], 0)


@njit(cache=True)
def _qk_rope_kv(qkv, kcs, vcs, layer, slot, pos, qk_norms, qkv_bias, cos, sin, H, Hkv, D, qk_norm, bias, neox, eps):
    """The q/k/v biases (Qwen2), per-head q/k norms (Gemma, Qwen3), RoPE on queries and keys, then the keys and
    values into each cache at pos (its `slot`: the layer's place among those that keep keys)."""
    for m in range(qkv.shape[0]):
        row = qkv[m]
        if bias:
            for j in range(row.shape[0]):
                row[j] += qkv_bias[layer, j]
        for hd in range(H + Hkv):  # queries then keys: per-head norm, then RoPE
            o = hd * D
            if qk_norm:
                rowops.rms_norm_into(row, o, D, qk_norms[layer, 0 if hd < H else 1], eps, row, o)
            rowops.rope_into(row, o, cos[layer, m], sin[layer, m], neox)
        kc, vc = kcs[m], vcs[m]
        for kh in range(Hkv):
            for d in range(D):
                kc[slot, kh, pos[m] // attention.TILE, d, pos[m] % attention.TILE] = attention.kv_value(
                    row[(H + kh) * D + d], kc)
                vc[slot, kh, pos[m], d] = attention.kv_value(row[(H + Hkv + kh) * D + d], vc)


@njit(cache=True)
def _act_into(gu, out, gelu, c0, c1):
    """Columns [c0, c1) of out (M, F) = act(gate) * up, gu (M, 2F) holding [gate | up]."""
    F = out.shape[1]
    t, scratch = np.empty(c1 - c0, np.float32), np.empty(c1 - c0, np.int32)
    for m in range(gu.shape[0]):
        row = gu[m]
        rowops.act_mul_row(row[c0:c1], row[F + c0 : F + c1], out[m, c0:c1], t, scratch, gelu)


@njit(cache=True)
def _act_tasks(F, n_workers):
    """Column ranges the activation phase splits into: one per thread, at 256-column boundaries (where the K
    quantization's super-blocks and the legacy pairs both end), or the whole width where F is not a multiple."""
    return n_workers if F % 256 == 0 and F // 256 >= n_workers else 1


# Row ranges per thread in a matvec phase. Claimed dynamically, few long ranges stream best; one spare each
# lets a thread that finishes early take over. Same-process A/B (ms per step, 1 / 2 / 4 ranges per thread):
# SmolLM2 4.41 / 4.59 / 4.70, Gemma-3 9.54 / 9.65 / 9.68.
ROW_RANGES_PER_THREAD = 2
PHASES_PER_LAYER = 17  # the most serial and parallel phases a layer has in _worker (the counters it needs)


@njit(cache=True)
def _worker(ctr, buf, pbuf, mats, head, norms, qk_norms, qkv_bias, out_norm, cos, sin, windows, fparams, iparams,
            pos, kcs, vcs, x, h, qkv, a, o, dn, logits, qe, qa, qff, part_max, part_sum, part_acc, n_chunks,
            splits, tier, n_workers, moe, biases, hyb, qar, convs, ssms, shared, qfs, g4, qaf, qp):
    """What every thread of the step's one parallel region runs: the phases of each layer in order. A serial
    phase (norms, RoPE, the KV write, the attention merge, quantizing the next input) is run by whichever
    thread claims it first; a parallel one (matvec row ranges, attention tasks, the MLP activation's column
    ranges) by all, task by task. Each waits for the phase before it (atomics.py). Which thread runs
    what never changes a result."""
    M, E = x.shape
    col0 = np.int64(0)  # not a literal 0: _quantize would compile a variant of its own for it
    H, Hkv, D = iparams[_H], iparams[_HKV], iparams[_D]
    qk_norm, post = iparams[_QK_NORM] != 0, iparams[_POST_NORMS] != 0
    gelu, clamped = iparams[_GELU] == 1, iparams[_GELU] == 2  # the activation: SiLU, GELU, gpt-oss's clamped SwiGLU
    neox, bias = iparams[_NEOX] != 0, iparams[_QKV_BIAS] != 0
    eps, scale, softcap = fparams[_EPS], np.float32(fparams[_ATTN_SCALE]), np.float32(fparams[_SOFTCAP])
    n_layer = mats.shape[0]
    n_tasks = M * Hkv * part_max.shape[2]  # (sequence, kv head, key range); splits[m] ranges of sequence m
    n_expert, chosen, weight, rl, dn_jobs = moe.n_expert, moe.chosen, moe.weight, moe.logits, moe.down
    sinks, o_bias = biases.sinks, biases.o_bias  # gpt-oss's; placeholders of width 1 otherwise
    kinds, dims, ar, gate = hyb.kinds, hyb.dims, hyb.out, hyb.gate  # Qwen3.5's, LFM2's (hybrid_step.py)
    # per-layer widths and Gemma 4's (gemma4_step.py); MLP buffers flat, viewed at each layer's widths
    shp, qw, anf, ones, guf, gf, pmp = g4.shp, g4.q_wide, g4.a_narrow, g4.ones, g4.gate_up, g4.act, g4.ple_proj
    P = g4.ple_gate.shape[1]
    J = chosen.shape[0] * chosen.shape[1] if n_expert else M  # MLP jobs: a sequence's k experts, or its MLP
    p = 0
    if P:  # per-layer embeddings: the projection of the embeddings, before the first layer
        if atomics.claim(ctr, p) == 0:
            quantize_input(pmp, x, qe, col0, E)
            atomics.finish(ctr, p)
        p = atomics.next_phase(ctr, p, 1)
        p = matvec_phase(ctr, p, buf, pbuf, pmp, qe, x, g4.ple_mix, n_chunks, tier)
        if atomics.claim(ctr, p) == 0:
            gemma4_step.ple_combine(g4.ple_mix, g4.ple, g4.ple_norm, P, eps, np.float32(1 / np.sqrt(np.float32(E))))
            atomics.finish(ctr, p)
        p = atomics.next_phase(ctr, p, 1)
    gus, gs, dns = shared.gate_up, shared.act, shared.down  # a shared expert's (Qwen3.5-MoE), width 0 without one
    for layer in range(n_layer + 1):
        if atomics.claim(ctr, p) == 0:
            if layer > 0 and not shp[layer - 1, FLAGS] & gemma4_step.END:  # the previous layer's MLP output
                _add_normed(x, dn, norms[layer - 1, POST_FFN_NORM], eps, post)
            if layer < n_layer:
                _norm_rows_into(x, norms[layer, ATTN_NORM], eps, h)
                quantize_input(mats[layer, ATTN_Q : ATTN_V + 1], h, qe, col0, E)
                quantize_input(mats[layer, SSM_ALPHA : SSM_BETA + 1], h, qe, col0, E)  # a DeltaNet layer's
            else:
                _norm_rows_into(x, out_norm, eps, h)
                quantize_input(head, h, qe, col0, E)
            atomics.finish(ctr, p)
        p = atomics.next_phase(ctr, p, 1)
        if layer == n_layer:
            break
        p = matvec_phase(ctr, p, buf, pbuf, mats[layer, ATTN_Q : ATTN_V + 1], qe, h, qkv, n_chunks, tier)
        recur, slot, row = kinds[layer, KIND] != 0, kinds[layer, KV_SLOT], kinds[layer, STATE_ROW]
        conv_block = kinds[layer, KIND] == 2  # LFM2's: no delta rule, no gated norm
        Dl, wide = shp[layer, HEAD_DIM], shp[layer, WIDE] != 0  # Gemma 4: queries widened into qw for attention
        if atomics.claim(ctr, p) == 0:
            if wide:
                gemma4_step.prepare(qkv, qw, kcs, vcs, slot, layer, pos, qk_norms, cos, sin, H, Dl,
                                    shp[layer, KV_HEADS], shp[layer, ROPE_PAIRS], D, Hkv,
                                    shp[layer, FLAGS], ones, eps)
                part_sum[:] = 0.0
            elif conv_block:
                hybrid_step.short_conv(qkv, convs, row, hyb.conv_w[row], ar)
            elif recur:
                hybrid_step.recurrent_inputs(buf, mats[layer, SSM_ALPHA : SSM_BETA + 1], qe, h, qkv, hyb, convs, row,
                                             eps, tier)
            else:
                if gate.shape[1]:
                    hybrid_step.split_gate(qkv, gate, H, D)
                _qk_rope_kv(qkv, kcs, vcs, layer, slot, pos, qk_norms, qkv_bias, cos, sin, H, Hkv, D, qk_norm, bias,
                            neox, eps)
                part_sum[:] = 0.0  # a key range left empty keeps 0: the merge skips it
            atomics.finish(ctr, p)
        p = atomics.next_phase(ctr, p, 1)
        n_mix = 0 if conv_block else M * dims[V_HEADS] if recur else n_tasks
        queries = qw if wide else qkv
        while True:  # attention tasks, or a DeltaNet layer's delta rule per (sequence, value head)
            t = atomics.claim(ctr, p)
            if t >= n_mix:
                break
            if recur:
                hybrid_step.delta_task(t, dims[K_HEADS], dims[V_HEADS], dims[V_DIM], hyb.dq, hyb.gb, ssms,
                                       row, ar)
            else:
                attention.task(t, queries, kcs, vcs, slot, pos, H, Hkv, D, windows[layer], scale, softcap, splits,
                               part_max, part_sum, part_acc)
            atomics.finish(ctr, p)
        p = atomics.next_phase(ctr, p, n_mix)
        if atomics.claim(ctr, p) == 0:
            if recur:
                if not conv_block:
                    hybrid_step.gated_norm(ar, qkv, hyb.dq.shape[1], dims[V_HEADS], dims[V_DIM], hyb.ssm_norm[row],
                                           eps, ar)
                quantize_input(mats[layer, ATTN_OUT : ATTN_OUT + 1], ar, qar, col0, ar.shape[1])
            else:
                attention.merge(part_max, part_sum, part_acc, sinks[layer], a)
                if gate.shape[1]:
                    hybrid_step.apply_gate(a, gate)
                if wide:
                    gemma4_step.narrow(a, anf[: M * H * Dl].reshape((M, H * Dl)), H, D, Dl)
                    quantize_input(mats[layer, ATTN_OUT : ATTN_OUT + 1], anf[: M * H * Dl].reshape((M, H * Dl)),
                                   quant_view(qaf, M, H * Dl), col0, H * Dl)
                else:
                    quantize_input(mats[layer, ATTN_OUT : ATTN_OUT + 1], a, qa, col0, a.shape[1])
            atomics.finish(ctr, p)
        p = atomics.next_phase(ctr, p, 1)
        if recur:
            p = matvec_phase(ctr, p, buf, pbuf, mats[layer, ATTN_OUT : ATTN_OUT + 1], qar, ar, o, n_chunks, tier)
        elif wide:
            p = matvec_phase(ctr, p, buf, pbuf, mats[layer, ATTN_OUT : ATTN_OUT + 1], quant_view(qaf, M, H * Dl),
                             anf[: M * H * Dl].reshape((M, H * Dl)), o, n_chunks, tier)
        else:
            p = matvec_phase(ctr, p, buf, pbuf, mats[layer, ATTN_OUT : ATTN_OUT + 1], qa, a, o, n_chunks, tier)
        if atomics.claim(ctr, p) == 0:
            if o_bias.shape[1] > 1:
                o += o_bias[layer]
            _add_normed(x, o, norms[layer, POST_ATTN_NORM], eps, post)
            _norm_rows_into(x, norms[layer, FFN_NORM], eps, h)
            quantize_input(mats[layer, FFN_GATE : FFN_ROUTER + 1], h, qe, col0, E)
            quantize_input(mats[layer, SHEXP_GATE : SHEXP_ROUTER + 1], h, qe, col0, E)  # a shared expert's
            atomics.finish(ctr, p)
        p = atomics.next_phase(ctr, p, 1)
        F = shp[layer, MLP_WIDTH]  # this layer's MLP width (an expert's in a MoE layer): the buffers viewed at it
        gu, g, qf = guf[: J * 2 * F].reshape((J, 2 * F)), gf[: J * F].reshape((J, F)), quant_view(qff, J, F)
        if n_expert:  # the router (both threads: 1 MB of f32 per layer in Qwen3-30B-A3B), the top-k; the chosen
            # experts' gate|up, activation, down, their weighted sum
            p = matvec_phase(ctr, p, buf, pbuf, mats[layer, FFN_ROUTER : FFN_ROUTER + 1], qe, h, rl, n_chunks, tier)
            if atomics.claim(ctr, p) == 0:
                moe_step.route(rl, biases.router, layer, chosen.shape[1], chosen, weight)
                atomics.finish(ctr, p)
            p = atomics.next_phase(ctr, p, 1)
            p = moe_step.gate_up_phase(ctr, p, buf, mats[layer, FFN_GATE], mats[layer, FFN_UP], chosen, qe, h, gu,
                                       moe.n_up, tier)
            if atomics.claim(ctr, p) == 0:
                moe_step.activate(gu, chosen, biases.gate_up, layer, clamped, gelu, g)
                quantize_input(mats[layer, FFN_DOWN : FFN_DOWN + 1], g, qf, col0, F)
                atomics.finish(ctr, p)
            p = atomics.next_phase(ctr, p, 1)
            p = moe_step.down_phase(ctr, p, buf, mats[layer, FFN_DOWN], chosen, qf, g, dn_jobs, moe.n_down, tier)
            if gs.shape[1]:  # the shared expert: gate|up, activation, down (as a dense MLP)
                p = matvec_phase(ctr, p, buf, pbuf, mats[layer, SHEXP_GATE : SHEXP_UP + 1], qe, h, gus, n_chunks, tier)
                if atomics.claim(ctr, p) == 0:
                    _act_into(gus, gs, gelu, col0, gs.shape[1])
                    quantize_input(mats[layer, SHEXP_DOWN : SHEXP_DOWN + 1], gs, qfs, col0, gs.shape[1])
                    atomics.finish(ctr, p)
                p = atomics.next_phase(ctr, p, 1)
                p = matvec_phase(ctr, p, buf, pbuf, mats[layer, SHEXP_DOWN : SHEXP_DOWN + 1], qfs, gs, dns, n_chunks,
                                 tier)
            if atomics.claim(ctr, p) == 0:
                moe_step.weighted_sum(dn_jobs, chosen, weight, biases.down, layer, dn)
                if gs.shape[1]:
                    hybrid_step.shared_expert_gate(buf, mats[layer, SHEXP_ROUTER], qe, h, shared.gate, tier)
                    hybrid_step.add_shared(dn, dns, shared.gate)
                atomics.finish(ctr, p)
            p = atomics.next_phase(ctr, p, 1)
            continue
        p = matvec_phase(ctr, p, buf, pbuf, mats[layer, FFN_GATE : FFN_UP + 1], qe, h, gu, n_chunks, tier)  # [gate|up]
        n_act = _act_tasks(F, n_workers)
        while True:  # the activation and its quantization, column ranges in parallel
            t = atomics.claim(ctr, p)
            if t >= n_act:
                break
            c0, c1 = t * (F // 256) // n_act * 256, (t + 1) * (F // 256) // n_act * 256
            if n_act == 1:
                c0, c1 = col0, F
            _act_into(gu, g, gelu, c0, c1)
            quantize_input(mats[layer, FFN_DOWN : FFN_DOWN + 1], g, qf, c0, c1)
            atomics.finish(ctr, p)
        p = atomics.next_phase(ctr, p, n_act)
        p = matvec_phase(ctr, p, buf, pbuf, mats[layer, FFN_DOWN : FFN_DOWN + 1], qf, g, dn, n_chunks, tier)
        if shp[layer, FLAGS] & gemma4_step.END:  # Gemma 4: the MLP's output in now, the PLE block, the output scale
            p = _layer_end(ctr, p, buf, pbuf, mats[layer], layer, x, dn, norms, eps, post, g4, qe, qp, n_chunks, tier)
    matvec_phase(ctr, p, buf, pbuf, head, qe, h, logits, n_chunks, tier)


@njit(cache=True)
def _layer_end(ctr, p, buf, pbuf, mats, layer, x, dn, norms, eps, post, g4, qe, qp, n_chunks, tier):
    """Gemma 4's end of a layer: x += post-norm(MLP); with per-layer embeddings x += post_norm(proj(GELU(inp_gate
    x) * this layer's input)); then x *= the layer's output scale. Returns the next phase."""
    pg, pgo, pp, scales = g4.ple_gate, g4.ple_act, g4.ple_out, g4.scales
    P, E, col0 = pg.shape[1], x.shape[1], np.int64(0)
    if atomics.claim(ctr, p) == 0:
        _add_normed(x, dn, norms[layer, POST_FFN_NORM], eps, post)
        if P:
            quantize_input(mats[PLE_GATE : PLE_GATE + 1], x, qe, col0, E)
        else:
            gemma4_step.add_scaled(x, pp[:, :0], norms[layer, POST_NORM], eps, scales[layer])
        atomics.finish(ctr, p)
    p = atomics.next_phase(ctr, p, 1)
    if not P:
        return p
    p = matvec_phase(ctr, p, buf, pbuf, mats[PLE_GATE : PLE_GATE + 1], qe, x, pg, n_chunks, tier)
    if atomics.claim(ctr, p) == 0:
        gemma4_step.ple_gate(pg, g4.ple, layer, P, pgo)
        quantize_input(mats[PLE_PROJ : PLE_PROJ + 1], pgo, qp, col0, P)
        atomics.finish(ctr, p)
    p = atomics.next_phase(ctr, p, 1)
    p = matvec_phase(ctr, p, buf, pbuf, mats[PLE_PROJ : PLE_PROJ + 1], qp, pgo, pp, n_chunks, tier)
    if atomics.claim(ctr, p) == 0:
        gemma4_step.add_scaled(x, pp, norms[layer, POST_NORM], eps, scales[layer])
        atomics.finish(ctr, p)
    return atomics.next_phase(ctr, p, 1)


@njit(cache=True)
def _rows(mats):
    r = 0
    for i in range(mats.shape[0]):
        r += mats[i, ROWS]
    return r


@njit(cache=True)
def _embed(table, pbuf, entry, ids, scale, x):
    """x (M, E) = the embedding rows ids of the table (its GGUF rows (rows, row bytes), at entry as mats rows)
    times scale: from its packed copy where that holds the row (as packed.embed_rows, bit for bit), else from
    the table itself (a GGUF row as the prompt path reads it: the same compiled decoder, no second one)."""
    rows, code, poff = entry[ROWS], entry[TYPE], entry[PACKED]
    E = x.shape[1]
    group = np.empty((packed.ROWS, E), np.float32)
    for m in range(ids.shape[0]):
        t = ids[m]
        if t < 0 or t >= rows:
            raise IndexError("a token id lies outside the embedding table")
        if poff >= 0 and t < rows // packed.ROWS * packed.ROWS:
            packed.dequantize_into(pbuf[poff:], code, t // packed.ROWS, t // packed.ROWS + 1, E, group)
            r = t % packed.ROWS
            for i in range(E):
                x[m, i] = group[r, i] * scale
        else:
            dequant.dequant_row(table[t], code, x[m])
            for i in range(E):
                x[m, i] *= scale


@njit(parallel=True, cache=True, nogil=True)
def decode_step(buf, pbuf, mats, head, table, embd, embed_scale, norms, qk_norms, qkv_bias, out_norm, inv_freq,
                windows, fparams, iparams, ids, pos, kcs, vcs, n_chunks, n_split, tier, n_workers, biases, rec, convs,
                ssms, layers):
    """The new tokens ids (M,) of M sequences at positions pos (M,) through the model; kcs/vcs: each sequence's
    cache arrays (keys (n_layer, Hkv, tiles, D, 16), values (n_layer, Hkv, capacity, D); capacity > pos),
    written at pos. Returns the head's logits (M, head rows).
    n_chunks: row ranges per matvec; n_split: key ranges per attention head (0: attention.n_split's, per sequence);
    n_workers: threads of the parallel region. Everything from the embedding lookup on is compiled, in one
    function, not a chain of calls (docs/design-log.md: the cold interpreter between steps; compile time)."""
    M = ids.shape[0]
    E = norms.shape[2]
    H, Hkv, D = iparams[_H], iparams[_HKV], iparams[_D]
    x = np.empty((M, E), np.float32)
    _embed(table, pbuf, embd, ids, embed_scale, x)
    splits = np.full(M, max(n_split, 1), np.int64)
    if n_split <= 0:
        for m in range(M):
            splits[m] = attention.n_split(Hkv, pos[m] + 1, n_workers)
        n_split = splits.max()
    n_expert, k = iparams[_N_EXPERT], max(iparams[_N_USED], 1)
    J = M * k if n_expert else M  # MLP jobs: a sequence's k experts, or its dense MLP
    shp, pmp = layers.shp, layers.ple_proj  # per-layer widths and flags, Gemma 4's tables (gemma4_step.Layers)
    F = 0
    for layer in range(mats.shape[0]):
        F = max(F, shp[layer, MLP_WIDTH])
    cos, sin = rowops.rope_tables_at(inv_freq, pos, fparams[_ROPE_FACTOR], fparams[_ROPE_ATTN_FACTOR])
    h = np.empty((M, E), np.float32)
    width = 0
    for layer in range(mats.shape[0]):  # a hybrid's layers differ: the widest
        width = max(width, _rows(mats[layer, ATTN_Q : ATTN_V + 1]))
    qkv = np.empty((M, width), np.float32)
    a = np.empty((M, H * D), np.float32)
    o = np.empty((M, _rows(mats[0, ATTN_OUT : ATTN_OUT + 1])), np.float32)
    dn = np.empty((M, E), np.float32)
    logits = np.empty((M, _rows(head)), np.float32)
    qe, qa, qff = quant_buffers(M, E), quant_buffers(M, H * D), flat_quant(J * F)
    P = layers.ple_norm.shape[0] if pmp.shape[0] else 0
    ple = np.empty((M, _rows(pmp)), np.float32)
    if P:
        gemma4_step.ple_tokens(buf, layers.ple_table, ids, np.float32(np.sqrt(np.float32(P))), ple)
    g4 = LayerBuffers(shp=shp, scales=layers.scales, ple_norm=layers.ple_norm, q_wide=np.empty((M, H * D), np.float32),
                      a_narrow=np.empty(M * H * D, np.float32), ple=ple, ple_mix=np.empty((M, _rows(pmp)), np.float32),
                      ple_gate=np.empty((M, P), np.float32), ple_act=np.empty((M, P), np.float32),
                      ple_out=np.empty((M, E), np.float32), ones=np.ones(D, np.float32),
                      gate_up=np.empty(J * 2 * F, np.float32), act=np.empty(J * F, np.float32), ple_proj=pmp)
    moe = Moe(n_expert=n_expert, chosen=np.zeros((M, k), np.int64), weight=np.empty((M, k), np.float32),
              logits=np.empty((M, max(n_expert, 1)), np.float32), down=np.empty((J, E), np.float32),
              n_up=moe_step.job_chunks(2 * F, J, n_workers), n_down=moe_step.job_chunks(E, J, n_workers))
    dims = rec.dims  # a hybrid's tables (hybrid_step.Recurrent), else stubs
    C, Hv, Ds = rec.conv_w.shape[1], dims[V_HEADS], dims[V_DIM]
    hyb = Hybrid(kinds=rec.kinds, conv_w=rec.conv_w, ssm_a=rec.ssm_a, dt_bias=rec.dt_bias, ssm_norm=rec.ssm_norm,
                 dims=dims, dq=np.empty((M, C), np.float32), ab=np.empty((M, 2 * Hv), np.float32),
                 gb=np.empty((M, 2 * Hv), np.float32), out=np.empty((M, Hv * Ds), np.float32),
                 gate=np.empty((M, H * D if rec.gated else 0), np.float32))
    qar = quant_buffers(M, Hv * Ds)  # (no tuple inside the tuples the parallel region gets: numba refuses it)
    Fs = _rows(mats[0, SHEXP_GATE : SHEXP_GATE + 1])  # a shared expert's width (Qwen3.5-MoE), 0: none
    shared = Shared(gate_up=np.empty((M, 2 * Fs), np.float32), act=np.empty((M, Fs), np.float32),
                    down=np.empty((M, E), np.float32), gate=np.empty((M, 1), np.float32))
    qfs = quant_buffers(M, Fs)
    part_max = np.empty((M, H, n_split), np.float32)
    part_sum = np.empty((M, H, n_split), np.float32)  # zeroed by each layer's serial phase before attention
    part_acc = np.empty((M, H, n_split, D), np.float32)
    # the last layer's serial phase, the head; 3 for the per-layer embeddings before the first layer
    ctr = atomics.counters(PHASES_PER_LAYER * mats.shape[0] + 5)
    qaf, qp = flat_quant(M * H * D), quant_buffers(M, P)
    for w in prange(n_workers):  # nothing else in the parallel body (see attention._tasks)
        _worker(ctr, buf, pbuf, mats, head, norms, qk_norms, qkv_bias, out_norm, cos, sin, windows, fparams, iparams,
                pos, kcs, vcs, x, h, qkv, a, o, dn, logits, qe, qa, qff, part_max, part_sum, part_acc, n_chunks,
                splits, tier, n_workers, moe, biases, hyb, qar, convs, ssms, shared, qfs, g4, qaf, qp)
    return logits
