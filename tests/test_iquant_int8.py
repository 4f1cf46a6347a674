"""The int8 matvec of the low-bit types IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 (engine/kernels/cpu/iquant.py, ternary.py,
driven by int8.py) against numpy references written here, as tests/test_q8_kernels.py does for the other types:
per-block integer dot products exactly (every bit pattern of the blocks), float results within 1e-5 relative of
the float64 product of the dequantized weights (reference.py) and the dequantized int8 activations, for 1 to 5
activation vectors, on every code tier this CPU runs; then real tensors of the quant kit (llama.cpp's files).
"""

from __future__ import annotations

import re

import gguf
import numba
import numpy as np
import pytest

from engine.kernels import reference
from engine.kernels.cpu import int8, ir, step_variants
from engine.kernels.quant_types import BLOCK_GEOMETRY, STEP_TYPES, GGMLType, QTensor, row_bytes
from tests.conftest import QUANT_KIT, QUANT_KIT_MISSING
from tests.test_q8_kernels import TIER_PARAMS, _assert_close, _ids, _inputs, _ref_quantize, _ref_quantize_k

G = GGMLType
TYPES = [G.IQ4_NL, G.IQ4_XS, G.TQ1_0, G.TQ2_0]
D_OFFSET = {G.IQ4_NL: 0, G.IQ4_XS: 0, G.TQ1_0: 52, G.TQ2_0: 64}  # each block's f16 d
LEVELS = reference.IQ4_NL_VALUES.astype(np.int64)  # llama.cpp's kvalues_iq4nl


# ---------------------------------------------------------------------------------------------------------
# numpy references: the stored integers of the weights and the integer dot products
# ---------------------------------------------------------------------------------------------------------


def _nibbles(qs):
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _ternary_digits(raw, t: GGMLType, K: int) -> np.ndarray:
    """(rows, K) int64 digits u (weight = d (u - 1)), decoded here from ggml's block layouts."""
    rows, nsb = raw.shape[0], K // 256
    b = raw.reshape(rows, nsb, -1).astype(np.int64)
    if t == G.TQ2_0:  # qs[64]: 2-bit field j of byte l of half h is weight 128h + 32j + l
        qs = b[..., :64].reshape(rows, nsb, 2, 1, 32)
        return ((qs >> (2 * np.arange(4))[:, None]) & 3).reshape(rows, K)

    def digits(q, k):  # digit t of byte l: ((q * 3^t mod 256) * 3) >> 8, ordered (t, l)
        m = (q[..., None, :] * (3 ** np.arange(k))[:, None]) % 256
        return ((m * 3) >> 8).reshape(rows, nsb, -1)

    return np.concatenate([digits(b[..., :32], 5), digits(b[..., 32:48], 5), digits(b[..., 48:52], 4)],
                          axis=-1).reshape(rows, K)


def _ref_integer_dots(raw, t: GGMLType, K: int, x: np.ndarray) -> np.ndarray:
    """What int8.integer_dots must return, from x (M, K) f32 through the reference quantizers."""
    rows, M = raw.shape[0], x.shape[0]
    if t == G.IQ4_NL:  # per block sum(v x), v the nibble's level
        xq = _ref_quantize(x, 32)[0].astype(np.int64).reshape(M, 1, K // 32, 32)
        v = LEVELS[_nibbles(raw.reshape(rows, K // 32, 18)[..., 2:])]
        return (v[None] * xq).sum(-1)
    xq, _, s32, _ = _ref_quantize_k(x)
    nsb = K // 256
    xq = xq.astype(np.int64).reshape(M, 1, nsb, 256)
    if t == G.IQ4_XS:  # [sum_s ls_s sum(v x)_s, 0]; ls = 6-bit scale - 32
        b = raw.reshape(rows, nsb, 136)
        high = (b[..., 2].astype(np.int64) | (b[..., 3].astype(np.int64) << 8))[..., None] >> (2 * np.arange(8)) & 3
        low = np.stack([b[..., 4:8] & 15, b[..., 4:8] >> 4], axis=-1).reshape(rows, nsb, 8)
        ls = (low | (high << 4)) - 32
        v = LEVELS[_nibbles(b[..., 8:].reshape(rows, nsb, 8, 16))]
        dots = (v[None] * xq.reshape(M, 1, nsb, 8, 32)).sum(-1)
        return np.stack([(ls[None] * dots).sum(-1), np.zeros((M, rows, nsb), np.int64)], axis=-1)
    u = _ternary_digits(raw, t, K).reshape(1, rows, nsb, 256)  # [sum(u x), bsum]
    bsum = np.broadcast_to(s32.sum(-1)[:, None], (M, rows, nsb))
    return np.stack([(u * xq).sum(-1), bsum], axis=-1)


def _random_blocks(t: GGMLType, rows: int, cols: int, seed: int, finite=True) -> np.ndarray:
    """Random bytes; with finite, every block's f16 d a finite value of either sign over three decades."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, row_bytes(t, cols)), dtype=np.uint8)
    if finite:
        blocks = raw.reshape(rows, -1, BLOCK_GEOMETRY[t][1])
        d = (rng.choice([-1, 1], blocks.shape[:2]) * 10.0 ** rng.uniform(-3, 0, blocks.shape[:2])).astype(np.float16)
        o = D_OFFSET[t]
        blocks[..., o:o + 2] = d[..., None].view(np.uint8)
    return raw


def _cols(t: GGMLType) -> list[int]:
    return [32, 64, 96, 160, 576] if t == G.IQ4_NL else [256, 768]  # IQ4_NL: odd block counts too


# ---------------------------------------------------------------------------------------------------------
# Integer dot products: exactly equal, on entirely random blocks
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_integer_dots_match_reference(t, tier):
    for seed, K in enumerate(_cols(t)):
        raw = _random_blocks(t, 9, K, seed, finite=False)
        x = _inputs(3, K, seed)
        got = int8.integer_dots((raw, t), int8.quantize(x, [t]), tier=tier)
        want = _ref_integer_dots(raw, t, K, x)
        assert got.dtype == np.int32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want, err_msg=f"{t.name} K={K}")


def test_ternary_digits_agree_with_the_reference_decoder():
    # The oracle above decodes the digits itself, every byte (TQ1_0's 243..255 and TQ2_0's 3 included) as the
    # reference does.
    for t in (G.TQ1_0, G.TQ2_0):
        raw = _random_blocks(t, 4, 512, seed=1)
        b = raw.reshape(4, 2, -1)
        d = reference.dequantize_raw(raw, t, 512).reshape(4, 2, 256)
        scale = b[..., D_OFFSET[t]:D_OFFSET[t] + 2].copy().view(np.float16).astype(np.float32)
        np.testing.assert_array_equal(d, scale * (_ternary_digits(raw, t, 512).reshape(4, 2, 256) - 1))


# ---------------------------------------------------------------------------------------------------------
# Float results: within 1e-5 relative of the exact product of the quantized operands
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_matvec_matches_reference(t, tier):
    for M in range(1, 6):
        for seed, K in enumerate(_cols(t)):
            rows = 5 + 4 * seed + M
            raw = _random_blocks(t, rows, K, seed + 10 * M)
            qin = int8.quantize(_inputs(M, K, seed), [t])
            w = reference.dequantize_raw(raw, t, K)
            assert np.isfinite(w).all()
            _assert_close(int8.matvec([(raw, t)], qin, tier=tier), int8.dequantized_input(qin, t), w)


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", TYPES, ids=_ids(TYPES))
def test_rows_give_each_vector_its_own_result_bit_for_bit(t, tier):
    # Super-block rows meet the vectors four, then two, then one at a time: each vector's result is its own alone.
    K = _cols(t)[-1]
    raw = _random_blocks(t, 11, K, seed=3)
    x = _inputs(9, K, seed=4)
    alone = np.concatenate([int8.matvec([(raw, t)], int8.quantize(x[m:m + 1], [t]), tier=tier) for m in range(9)])
    for M in range(1, 10):
        got = int8.matvec([(raw, t)], int8.quantize(x[:M], [t]), tier=tier)
        np.testing.assert_array_equal(got.view(np.uint32), alone[:M].view(np.uint32), err_msg=f"M={M}")


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_fused_matvec_mixes_low_bit_and_other_types(tier):
    # One input, matrices of every activation form: three per call (each combination compiled with its types),
    # and more than three (groups of three: the run-time dispatch has no low-bit kernels).
    from testdata import make_fixtures

    rng = np.random.default_rng(8)
    ws = [(_random_blocks(t, rows, 512, seed), t) for seed, (t, rows) in
          enumerate([(G.IQ4_NL, 9), (G.TQ1_0, 4), (G.IQ4_XS, 7), (G.TQ2_0, 3)])]
    ws.append((make_fixtures.random_weight(rng, 6, 512, G.Q4_K), G.Q4_K))
    x = _inputs(3, 512, seed=9)
    qin = int8.quantize(x, [t for _, t in ws])
    for group in (ws[:3], ws[2:], ws):
        out = int8.matvec(group, qin, tier=tier)
        col = 0
        for raw, t in group:
            np.testing.assert_array_equal(out[:, col:col + raw.shape[0]], int8.matvec([(raw, t)], qin, tier=tier))
            _assert_close(out[:, col:col + raw.shape[0]], int8.dequantized_input(qin, t),
                          reference.dequantize_raw(raw, t, 512))
            col += raw.shape[0]


def test_the_decode_step_sees_none_of_them():
    # The compiled decode step dispatches on int8.rows_into at run time and sizes its inputs from LEGACY_TYPES and
    # K_TYPES: the low-bit types stay out of both (they compile per combination only), and out of STEP_TYPES.
    for t in TYPES:
        assert t not in int8.LEGACY_TYPES | int8.K_TYPES | STEP_TYPES
    assert set(TYPES) <= int8.LOWBIT_LEGACY | int8.LOWBIT_K


@pytest.mark.parametrize("t", [G.Q4_K, G.IQ4_XS, G.IQ3_S], ids=["Q4_K", "IQ4_XS", "IQ3_S"])
def test_a_constant_code_compiles_its_own_kernel_only(t):
    code = int(t)

    @numba.njit(cache=False)
    def one(raw, rb, xq8, xs8, xqk, xdk, xbk, x, out, tier):
        int8.rows_of_code(code, raw, np.int64(0), rb, 0, 2, xq8, xs8, xqk, xdk, xbk, x, out, np.int64(0), tier)

    raw = np.zeros(2 * row_bytes(t, 256), np.uint8)
    qin = int8.quantize(np.ones((1, 256), np.float32), [t])
    one(raw, row_bytes(t, 256), *qin[1:], qin.x, np.zeros((1, 2), np.float32), ir.tier_token())
    called = set(re.findall(r"rows_(?:q\d_\d|q\d_k|mxfp4|iq4_nl|iq4_xs|iq[123]_(?:xxs|xs|s|m)|tq\d_0|f16|bf16|f32)",
                            "".join(one.inspect_llvm(s) for s in one.signatures)))
    assert called == {f"rows_{t.name.lower()}"}


# ---------------------------------------------------------------------------------------------------------
# Real tensors: every (type, shape) of the quant kit's files (llama.cpp's quantizer), their first rows
# ---------------------------------------------------------------------------------------------------------


def _kit_matrices(types=TYPES, max_rows=64) -> list[QTensor]:
    """The first rows of one tensor per (type, row length) of `types` in the quant kit's files."""
    if not QUANT_KIT.is_dir() or not any(QUANT_KIT.glob("*.gguf")):
        pytest.skip(QUANT_KIT_MISSING)
    seen, out = set(), []
    for path in sorted(QUANT_KIT.glob("*.gguf")):
        for tensor in gguf.GGUFReader(path).tensors:
            code, cols = int(tensor.tensor_type), int(tensor.shape[0])  # GGUF lists the row length first
            if code not in {int(t) for t in types} or (code, cols) in seen:
                continue
            seen.add((code, cols))
            t = G(code)
            raw = np.ascontiguousarray(np.asarray(tensor.data).reshape(-1, row_bytes(t, cols))[:max_rows])
            out.append(QTensor(f"{path.name}:{tensor.name}", t, (raw.shape[0], cols), raw))
    return out


@pytest.fixture(scope="module")
def kit_matrices() -> list[QTensor]:
    out = _kit_matrices()
    assert {w.ggml_type for w in out} == set(TYPES)
    return out


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_real_tensors(kit_matrices, tier):
    check_real_tensors(kit_matrices, tier, lambda w, x, qin: _ref_integer_dots(w.raw, w.ggml_type, w.cols, x))


def check_real_tensors(matrices: list[QTensor], tier, ref_dots) -> None:
    """Each matrix against two random inputs: integer dots exactly ref_dots(w, x, qin)'s, the float result within
    1e-5 of the float64 product of the quantized operands."""
    rng = np.random.default_rng(10)
    for w in matrices:
        x = rng.standard_normal((2, w.cols)).astype(np.float32)
        qin = int8.quantize(x, [w.ggml_type])
        np.testing.assert_array_equal(int8.integer_dots(w, qin, tier=tier), ref_dots(w, x, qin), err_msg=w.name)
        got = int8.matvec([w], qin, tier=tier)
        wf = reference.dequantize(w)
        _assert_close(got, int8.dequantized_input(qin, w.ggml_type), wf)
        # Against exact f32 activations the int8 ones cost ~0.5 % (as in llama.cpp): a sanity bound.
        exact = x.astype(np.float64) @ wf.T.astype(np.float64)
        assert np.linalg.norm(got - exact) <= 0.02 * np.linalg.norm(exact), w.name


def test_a_step_variant_compiles_its_own_low_bit_kernels_only():
    # step_variants.rows_with / row_with: the step's dispatches plus one model's low-bit types (a Q3_K_M
    # file's), the other low-bit kernels pruned (the base types go through rows_into / dequant_row, called).
    code = int(G.Q3_K)
    # compiled here from their Python functions: numba's cache (which an earlier test may have filled with these
    # very variants) returns code that cannot be inspected
    rows, row = (numba.njit(f((code,)).py_func) for f in (step_variants.rows_with, step_variants.row_with))
    raw = np.zeros(2 * row_bytes(G.Q3_K, 256), np.uint8)
    qin = int8.quantize(np.ones((1, 256), np.float32), [G.Q3_K])
    rows(code, raw, np.int64(0), raw.size // 2, np.int64(0), np.int64(2), *qin[1:], qin.x, np.zeros((1, 2), np.float32),
         np.int64(0), ir.tier_token())
    row(raw[: raw.size // 2], code, np.zeros(256, np.float32))
    lowbit = r"(?:q2_k|q3_k|iq4_nl|iq4_xs|tq\d_0|iq[123]_(?:xxs|xs|s|m))"
    for f, pattern in ((rows, r"rows_" + lowbit), (row, r"_row_" + lowbit)):
        called = set(re.findall(pattern, "".join(f.inspect_llvm(s) for s in f.signatures)))
        assert called == {pattern.split("(")[0] + "q3_k"}, called
