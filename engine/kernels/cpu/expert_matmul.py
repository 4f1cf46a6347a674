"""A MoE layer's experts over a prompt chunk on the fast path: every chosen expert's rows against all the chunk's
tokens that chose it, in one compiled call per stacked tensor (gate, up, down), on plain threads.

The chunk's (token, expert) pairs come grouped by expert (group i: input rows starts[i]..starts[i+1], all for
expert experts[i]). Each thread takes the same share of every expert's rows, so the work is balanced however the
tokens spread over experts, and each weight row is read once per call for all of its tokens. Before it, a MoE
prompt made a Python call (and a quantization, a gather, a scatter) per expert: a 64-token tile of a 128-expert
model routes its 512 pairs to ~80 experts, ~1,000 calls a layer.

Activations are quantized once per call (int8, as the int8 matvec and llama.cpp's mul_mat_id do); a row's result
depends only on that row and the expert's weights, never on which other rows share its group, so a prompt's numbers
do not depend on how it was cut into chunks (Backend.prompt_tile), and moe.py groups a whole chunk at once: more
tokens per expert, so more of them go through the K-quant rows' four-vector form (kquant.py).
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np
from numba import njit

from engine.kernels.quant_types import QTensor
from engine.kernels.cpu import int8, plain_threads


@njit(nogil=True, cache=True)
def _grouped_into(raw, code, rb, per_expert, experts, starts, xq8, xs8, xqk, xdk, xbk, x, out, col, tier, n_chunks,
                  ch):
    """This chunk's share (rows lo..hi of each expert's per_expert) of group i's expert against group i's inputs,
    into out[group rows, col + row]."""
    lo, hi = ch * per_expert // n_chunks, (ch + 1) * per_expert // n_chunks
    for i in range(experts.shape[0]):
        p0, p1 = starts[i], starts[i + 1]
        base = np.int64(experts[i]) * per_expert
        int8.rows_into(code, raw, np.int64(0), rb, base + lo, base + hi, xq8[p0:p1], xs8[p0:p1], xqk[p0:p1],
                       xdk[p0:p1], xbk[p0:p1], x[p0:p1], out[p0:p1], np.int64(col) - base, tier)


def usable(stack: QTensor) -> bool:
    """Whether the grouped kernel takes this stacked expert tensor: quantized (float experts stay on the exact
    path's sgemm, as the int8 kernels leave them) in a type of int8.rows_into's run-time dispatch (the low-bit
    ones take the per-expert matvec, whose kernels compile per type)."""
    return stack.ggml_type in int8.LEGACY_TYPES | int8.K_TYPES


def expert_matmul(x: np.ndarray, experts: np.ndarray, starts: np.ndarray, stacks: Sequence[QTensor],
                  n_expert: int, tier: str) -> list[np.ndarray]:
    """For each stacked tensor (n_expert matrices one under another, all with x's columns), (P, rows per expert):
    each row of x (P, cols) times the matrix of its group's expert. Groups as the module says."""
    x = np.ascontiguousarray(x, np.float32)
    P = x.shape[0]
    p = int8.prepare(stacks)
    qin = int8.quantize(x, p)
    widths = [s.rows // n_expert for s in stacks]
    out = np.empty((P, sum(widths)), np.float32)
    experts = np.ascontiguousarray(experts, np.int64)
    starts = np.ascontiguousarray(starts, np.int64)
    tok = int8.tier_token(tier)
    col = 0
    for raw, code, per_expert in zip(p.raws, p.codes, widths):
        n_chunks = max(1, min(per_expert, numba.get_num_threads()))
        args = (raw.reshape(-1), code, raw.shape[1], per_expert, experts, starts, qin.xq8, qin.xs8, qin.xqk, qin.xdk,
                qin.xbk, qin.x, out, col, tok, n_chunks)
        plain_threads.split(_grouped_into, args, n_chunks)
        col += per_expert
    ends = np.cumsum(widths).tolist()
    return [out[:, a:b] for a, b in zip([0] + ends[:-1], ends)]
