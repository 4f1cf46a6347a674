"""The int8 kernels of the lattice types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (engine/kernels/cpu/
lattice.py for the decode matvec, gemm8_lattice.py for the prompt GEMM) against numpy, as tests/test_iquant_int8.py
holds the other low-bit types: integer dot products exactly on entirely random blocks, float results within 1e-5
relative of the float64 product of the reference's weights (reference_lattice.py, itself bit for bit gguf's) and
the dequantized int8 activations, for 1 to 5 vectors and on every code tier this CPU runs; the GEMM's largest
levels against the largest inputs; then real tensors of the quant kit's lattice mixes (llama.cpp's files).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import reference
from engine.kernels.cpu import gemm8, int8
from engine.kernels.quant_types import BLOCK_GEOMETRY, LATTICE_TYPES, STEP_TYPES, GGMLType, QTensor
from testdata import make_fixtures
from tests.test_gemm8 import _type_tiers, assert_exact_against_extreme_inputs
from tests.test_iquant_int8 import _kit_matrices, check_real_tensors
from tests.test_q8_kernels import TIER_PARAMS, _assert_close, _ids, _inputs

G = GGMLType
TYPES = sorted(LATTICE_TYPES)
# w = d f ls q with q an integer (lattice.py): 1 / f per type
INV_F = {G.IQ2_XXS: 8, G.IQ2_XS: 8, G.IQ2_S: 8, G.IQ3_XXS: 4, G.IQ3_S: 1, G.IQ1_S: 8, G.IQ1_M: 8}


def _blocks(t: GGMLType, rows: int, cols: int, seed: int, d: float | None = None) -> np.ndarray:
    """Random blocks; with d, every block's f16 d set to it (IQ1_M: the top nibbles of its scale words)."""
    rng = np.random.default_rng(seed)
    if d is None:
        return make_fixtures.random_weight(rng, rows, cols, t)
    raw = rng.integers(0, 256, size=(rows, cols // 256 * BLOCK_GEOMETRY[t][1]), dtype=np.uint8)
    blocks = raw.reshape(-1, BLOCK_GEOMETRY[t][1])
    bits = int(np.float16(d).view(np.uint16))
    if t == G.IQ1_M:
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)
    else:
        blocks[:, 0:2] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    return raw


def _ref_integer_dots(raw: np.ndarray, t: GGMLType, K: int, xq: np.ndarray) -> np.ndarray:
    """[sum_g ls_g sum(q x)_g, 0] per super-block: with d = 1 the reference's weights are f ls q exactly."""
    unit = raw.copy()
    other = _blocks(t, raw.shape[0], K, 0, d=1.0).reshape(-1, BLOCK_GEOMETRY[t][1])
    blocks = unit.reshape(-1, BLOCK_GEOMETRY[t][1])
    if t == G.IQ1_M:
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (other[:, 49 + 2 * i] & 0xF0)
    else:
        blocks[:, 0:2] = other[:, 0:2]
    ls_q = reference.dequantize_raw(unit, t, K).astype(np.float64) * INV_F[t]
    assert np.array_equal(ls_q, np.rint(ls_q))
    rows, M, nsb = raw.shape[0], xq.shape[0], K // 256
    dots = (ls_q.reshape(1, rows, nsb, 256) * xq.astype(np.float64).reshape(M, 1, nsb, 256)).sum(-1)
    return np.stack([dots, np.zeros_like(dots)], axis=-1).astype(np.int64)


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_integer_dots_match_reference(t, tier):
    for seed, K in enumerate((256, 768)):
        raw = _blocks(t, 9, K, seed, d=0.5)  # (any d: the integer dots never read it)
        qin = int8.quantize(_inputs(3, K, seed), [t])
        got = int8.integer_dots((raw, t), qin, tier=tier)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, _ref_integer_dots(raw, t, K, qin.xqk), err_msg=f"{t.name} K={K}")


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_matvec_matches_reference(t, tier):
    for M in range(1, 6):
        for seed, K in enumerate((256, 768)):
            rows = 5 + 4 * seed + M
            raw = _blocks(t, rows, K, seed + 10 * M)
            qin = int8.quantize(_inputs(M, K, seed), [t])
            w = reference.dequantize_raw(raw, t, K)
            assert np.isfinite(w).all() and np.abs(w).max() > 0
            _assert_close(int8.matvec([(raw, t)], qin, tier=tier), int8.dequantized_input(qin, t), w)


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_rows_give_each_vector_its_own_result_bit_for_bit(t, tier):
    K = 512
    raw = _blocks(t, 11, K, seed=3)
    x = _inputs(7, K, seed=4)
    alone = np.concatenate([int8.matvec([(raw, t)], int8.quantize(x[m:m + 1], [t]), tier=tier) for m in range(7)])
    for M in (2, 4, 7):
        got = int8.matvec([(raw, t)], int8.quantize(x[:M], [t]), tier=tier)
        np.testing.assert_array_equal(got.view(np.uint32), alone[:M].view(np.uint32), err_msg=f"M={M}")


def test_they_stay_out_of_the_shared_decode_step():
    for t in TYPES:
        assert t not in int8.LEGACY_TYPES | int8.K_TYPES | STEP_TYPES and t in int8.LOWBIT_K


# The GEMM's largest levels (u = q + c up to 2 c) against inputs at +-127: the 256-bit form sums u8 x s8 pairs in
# int16 over one group (IQ2_*, IQ3_XXS) or four (IQ3_S, IQ1_*) before widening. Grid points with the largest
# magnitudes, every sign positive, every group scale 15.
LARGEST = {G.IQ2_XS: lambda b: (b[:, 2:66].view("<u2").__setitem__(slice(None), 511), b[:, 66:74].fill(0xFF)),
           G.IQ2_S: lambda b: (b[:, 2:34].fill(0xFF), b[:, 34:66].fill(0), b[:, 66:82].fill(0xFF)),
           G.IQ3_XXS: lambda b: (b[:, 2:66].fill(135), b[:, 66:98].view("<u4").__setitem__(slice(None), 0xF0000000))}


@pytest.mark.parametrize("t,tier", _type_tiers(LARGEST))
def test_the_largest_levels_against_the_largest_inputs_do_not_overflow(t, tier):
    rows, K = 9, 512
    raw = _blocks(t, rows, K, seed=5).copy()
    LARGEST[t](raw.reshape(-1, BLOCK_GEOMETRY[t][1]))
    assert_exact_against_extreme_inputs(QTensor("w", t, (rows, K), raw), tier)


# ---------------------------------------------------------------------------------------------------------
# Real tensors: every (type, shape) of the quant kit's lattice mixes (llama.cpp's quantizer), their first rows
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kit_matrices() -> list[QTensor]:
    out = _kit_matrices(TYPES)
    assert {w.ggml_type for w in out} == set(TYPES)
    return out


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_real_tensors(kit_matrices, tier):
    check_real_tensors(kit_matrices, tier, lambda w, x, qin: _ref_integer_dots(w.raw, w.ggml_type, w.cols, qin.xqk))
