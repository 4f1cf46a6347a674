"""The MoE MLP inside the compiled decode step (decode_step.py): top-k of the router's logits (the router is
one of the step's matvec phases), the chosen experts' matvecs, the weighted sum; run by the step's threads as
phases of its one parallel region (atomics.py).

Each of the M sequences' k chosen experts is a job: its gate and up rows (expert e's rows e F..(e+1) F of the
stacked `ffn_gate_exps` / `ffn_up_exps`) against that sequence's input, then its down rows against the job's
activation. Only chosen experts' rows are read (a Qwen3-30B-A3B token reads 8 of 128 experts: 1/16 of the
expert weights). Jobs split into row ranges claimed by whichever thread is free. Expert stacks are read in
their GGUF blocks (never packed: a stack's rows are addressed per expert).

Rows: mats entries as decode_step's: [byte offset, rows (all experts), row bytes, type code, packed offset].
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from engine.kernels.cpu import atomics, int8, rowops
from engine.kernels.cpu.step_roles import OFFSET, ROW_BYTES, TYPE

SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # gpt-oss's clamped SwiGLU (as models/moe.py)


class Moe(NamedTuple):
    """A MoE MLP's buffers in the step (decode_step.py builds them per step; n_expert 0: a dense model's stubs)."""
    n_expert: int
    chosen: np.ndarray  # (M, k) each sequence's chosen experts
    weight: np.ndarray  # (M, k) their weights
    logits: np.ndarray  # (M, n_expert) the router's
    down: np.ndarray  # (M k, E) each job's down output
    n_up: int  # row ranges per job of the gate|up phase
    n_down: int  # of the down phase


class Shared(NamedTuple):
    """A shared expert's buffers (Qwen3.5-MoE; width 0 without one)."""
    gate_up: np.ndarray  # (M, 2 Fs)
    act: np.ndarray  # (M, Fs)
    down: np.ndarray  # (M, E)
    gate: np.ndarray  # (M, 1) its gate's logit


@njit(cache=True)
def route(logits, bias, layer, k, chosen, weight):
    """Per sequence, after the router's bias (gpt-oss; bias[layer] (n_expert,), else (L, 1)): the k largest
    logits (ties to the lower expert id, as the prompt path's stable sort) and their softmax (= the softmax over
    all experts renormalized over the chosen)."""
    M, n = logits.shape
    for m in range(M):
        row = logits[m]
        if bias.shape[1] > 1:
            row += bias[layer]
        for j in range(k):
            best = -1
            for e in range(n):
                taken = False
                for i in range(j):
                    taken |= chosen[m, i] == e
                if not taken and (best < 0 or row[e] > row[best]):
                    best = e
            chosen[m, j] = best
        top = row[chosen[m, 0]]
        total = 0.0
        for j in range(k):
            weight[m, j] = math.exp(np.float64(row[chosen[m, j]]) - np.float64(top))
            total += weight[m, j]
        for j in range(k):
            weight[m, j] /= total


@njit(cache=True)
def _job_rows(buf, entry, e, per_expert, x_row, q, out_row, out_off, r0, r1, tier):
    """Rows [r0, r1) of expert e's matrix in a stacked entry, for one input (its quantizations q, row slices
    of one sequence or job), into out_row[0, out_off + r]."""
    xq8, xqn, xs8, xqk, xdk, xbk = q
    base = np.int64(e) * per_expert
    int8.rows_into(entry[TYPE], buf, entry[OFFSET], entry[ROW_BYTES], base + r0, base + r1, xq8, xs8, xqk, xdk, xbk,
                   x_row, out_row, np.int64(out_off) - base, tier)


@njit(cache=True)
def _slice(q, i):
    """The quantizations of input row i alone (the 1-row views a job reads)."""
    xq8, xqn, xs8, xqk, xdk, xbk = q
    return (xq8[i : i + 1], xqn[i : i + 1], xs8[i : i + 1], xqk[i : i + 1], xdk[i : i + 1], xbk[i : i + 1])


@njit(cache=True)
def gate_up_phase(ctr, phase, buf, gate, up, chosen, qh, h, gu, n_chunks, tier):
    """gu (M k, 2F) = [gate | up] rows of job (m, j)'s expert against h[m] (quantized in qh): M k n_chunks tasks."""
    M, k = chosen.shape
    F = gu.shape[1] // 2
    n_tasks = M * k * n_chunks
    while True:
        t = atomics.claim(ctr, phase)
        if t >= n_tasks:
            break
        job, ch = t // n_chunks, t % n_chunks
        m, e = job // k, chosen[job // k, job % k]
        lo, hi = ch * 2 * F // n_chunks, (ch + 1) * 2 * F // n_chunks
        q, x, out = _slice(qh, m), h[m : m + 1], gu[job : job + 1]
        if lo < F:
            _job_rows(buf, gate, e, F, x, q, out, 0, lo, min(hi, F), tier)
        if hi > F:
            _job_rows(buf, up, e, F, x, q, out, F, max(lo, F) - F, hi - F, tier)
        atomics.finish(ctr, phase)
    return atomics.next_phase(ctr, phase, n_tasks)


@njit(cache=True)
def down_phase(ctr, phase, buf, down, chosen, qg, g, dn_jobs, n_chunks, tier):
    """dn_jobs (M k, E) = down rows of job (m, j)'s expert against its activation g[job] (quantized in qg)."""
    M, k = chosen.shape
    E = dn_jobs.shape[1]
    n_tasks = M * k * n_chunks
    while True:
        t = atomics.claim(ctr, phase)
        if t >= n_tasks:
            break
        job, ch = t // n_chunks, t % n_chunks
        e = chosen[job // k, job % k]
        _job_rows(buf, down, e, E, g[job : job + 1], _slice(qg, job), dn_jobs[job : job + 1], 0,
                  ch * E // n_chunks, (ch + 1) * E // n_chunks, tier)
        atomics.finish(ctr, phase)
    return atomics.next_phase(ctr, phase, n_tasks)


@njit(cache=True)
def activate(gu, chosen, bias, layer, clamped, gelu, g):
    """g (J, F) = the jobs' activations of gu (J, 2F) = [gate | up]: with expert biases (gpt-oss: bias[layer, e]
    (2F,) added first) and gpt-oss's clamped SwiGLU, or SiLU / GELU."""
    M, k = chosen.shape
    F = g.shape[1]
    t, scratch = np.empty(F, np.float32), np.empty(F, np.int32)
    for job in range(gu.shape[0]):
        row = gu[job]
        if bias.shape[1] > 1:
            e = chosen[job // k, job % k]
            for i in range(2 * F):
                row[i] += bias[layer, e, i]
        if clamped:
            for i in range(F):
                a = min(row[i], np.float32(SWIGLU_LIMIT))
                u = min(max(row[F + i], np.float32(-SWIGLU_LIMIT)), np.float32(SWIGLU_LIMIT))
                g[job, i] = (u + np.float32(1)) * a / (np.float32(1) + np.float32(math.exp(-SWIGLU_ALPHA * a)))
        else:
            rowops.act_mul_row(row[:F], row[F:], g[job], t, scratch, gelu)


@njit(cache=True)
def weighted_sum(dn_jobs, chosen, weight, bias, layer, dn):
    """dn (M, E) = sum over j of weight[m, j] * (dn_jobs[m k + j] + the expert's down bias, where it has one)."""
    M, k = weight.shape
    for m in range(M):
        dn[m, :] = 0.0
        for j in range(k):
            w = weight[m, j]
            row = dn_jobs[m * k + j]
            e = chosen[m, j]
            for i in range(dn.shape[1]):
                dn[m, i] += w * (row[i] + (bias[layer, e, i] if bias.shape[1] > 1 else np.float32(0)))


@njit(cache=True)
def job_chunks(rows, jobs, threads):
    """Row ranges per job: about two tasks per thread over all jobs, ranges of at least 256 rows."""
    return max(1, min(-(-2 * threads // jobs), rows // 256))


def bias_tables(cfg, w, flags: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The router's bias (L, n_expert) and the experts' gate|up (L, n_expert, 2F) and down (L, n_expert, E)
    biases of a family that has them (gpt-oss); (L, 1[, 1]) zeros otherwise (the kernels test the width)."""
    L = cfg.n_layer
    if not (flags.get("moe") and cfg.expert_biases):
        return np.zeros((L, 1), np.float32), np.zeros((L, 1, 1), np.float32), np.zeros((L, 1, 1), np.float32)
    n = cfg.n_expert
    router = np.stack([w.bias(f"blk.{i}.ffn_gate_inp") for i in range(L)])
    gate_up = np.stack([np.concatenate([w.bias(f"blk.{i}.ffn_gate_exps").reshape(n, -1),
                                        w.bias(f"blk.{i}.ffn_up_exps").reshape(n, -1)], axis=1) for i in range(L)])
    down = np.stack([w.bias(f"blk.{i}.ffn_down_exps").reshape(n, -1) for i in range(L)])
    return router.astype(np.float32), gate_up.astype(np.float32), down.astype(np.float32)
