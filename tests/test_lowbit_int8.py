"""The integer kernels of Q2_K and Q3_K (engine/kernels/cpu/kquant_low.py, through int8.py) against numpy: per
super-block integer dots exactly, float results within 1e-5 relative of the float64 product of the reference-
dequantized weights and the dequantized int8 activations; on random blocks and on the quant kit's tensors (files
llama.cpp quantized), for every code tier this CPU runs.

The integer oracle goes through reference.py alone: a block whose f16 d is set to 1 (dmin to 0) dequantizes to
scale * quant per weight, exact small integers, so its dot with the int8 activations is the kernel's scaled integer
sum; Q2_K's min term is the dot of the block with d = 0, dmin = -1 (each weight its group's min).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.kernels import reference
from engine.kernels.cpu import int8
from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType, row_bytes
from tests.conftest import QUANT_KIT, QUANT_KIT_MISSING
from tests.test_q8_kernels import TIER_PARAMS, _assert_close, _inputs, _ref_quantize_k

G = GGMLType
LOWK = [G.Q2_K, G.Q3_K]
IDS = [t.name for t in LOWK]
F16_FIELDS = {G.Q2_K: (80, 82), G.Q3_K: (108,)}  # byte offsets of d (and Q2_K's dmin) in a block


def _random_blocks(t: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes with finite f16 scales (both signs, some zeros and subnormals): every quant and scale pattern."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, BLOCK_GEOMETRY[t][1]), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        d = rng.uniform(-0.2, 0.2, raw.shape[:2]).astype(np.float16)
        d[rng.random(d.shape) < 0.05] = 0
        d[rng.random(d.shape) < 0.05] = np.float16(3e-6)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return raw.reshape(rows, -1)


def _with_f16(raw: np.ndarray, t: GGMLType, values) -> np.ndarray:
    b = raw.reshape(raw.shape[0], -1, BLOCK_GEOMETRY[t][1]).copy()
    for off, v in zip(F16_FIELDS[t], values):
        b[:, :, off:off + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
    return b.reshape(raw.shape)


def _ref_integer_dots(raw: np.ndarray, t: GGMLType, K: int, x: np.ndarray) -> np.ndarray:
    """int8.integer_dots' (M, rows, K/256, 2) from reference.dequantize_raw of blocks with d = 1 (dmin = 0)."""
    xq = _ref_quantize_k(x)[0].astype(np.int64)
    M, rows, nsb = x.shape[0], raw.shape[0], K // 256

    def dots(fields):
        w = reference.dequantize_raw(_with_f16(raw, t, fields), t, K)
        assert np.array_equal(w, np.round(w)) and np.abs(w).max() <= 128  # exact small integers
        return (w.astype(np.int64).reshape(1, rows, nsb, 256) * xq.reshape(M, 1, nsb, 256)).sum(-1)

    if t == G.Q2_K:
        return np.stack([dots((1.0, 0.0)), dots((0.0, -1.0))], axis=-1)
    return np.stack([dots((1.0,)), np.zeros((M, rows, nsb), np.int64)], axis=-1)


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", LOWK, ids=IDS)
def test_integer_dots_match_reference(t, tier):
    for seed, (rows, K, M) in enumerate([(9, 256, 2), (5, 768, 3), (3, 512, 1)]):
        raw = np.random.default_rng(seed).integers(0, 256, (rows, row_bytes(t, K)), dtype=np.uint8)  # any bytes
        x = _inputs(M, K, seed)
        got = int8.integer_dots((raw, t), int8.quantize(x, [t]), tier=tier)
        want = _ref_integer_dots(raw, t, K, x)
        assert got.dtype == np.int32 and got.shape == want.shape == (M, rows, K // 256, 2)
        np.testing.assert_array_equal(got, want, err_msg=f"{t.name} K={K}")


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", LOWK, ids=IDS)
def test_matvec_matches_reference(t, tier):
    for M in range(1, 6):
        for seed, (rows, K) in enumerate([(37, 512), (5, 768), (6, 256)]):
            raw = _random_blocks(t, rows, K, 10 * M + seed)
            qin = int8.quantize(_inputs(M, K, seed), [t])
            _assert_close(int8.matvec([(raw, t)], qin, tier=tier), int8.dequantized_input(qin, t),
                          reference.dequantize_raw(raw, t, K))


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", LOWK, ids=IDS)
def test_rows_give_each_vector_its_own_result_bit_for_bit(t, tier):
    # Vectors meet a row four, two, then one at a time (kquant_low.rows_*): each vector's result is its result alone.
    raw = _random_blocks(t, 11, 512, seed=3)
    x = _inputs(9, 512, seed=4)
    alone = np.concatenate([int8.matvec([(raw, t)], int8.quantize(x[m:m + 1], [t]), tier=tier) for m in range(9)])
    for M in range(1, 10):
        got = int8.matvec([(raw, t)], int8.quantize(x[:M], [t]), tier=tier)
        np.testing.assert_array_equal(got.view(np.uint32), alone[:M].view(np.uint32), err_msg=f"M={M}")


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_fused_matvec_mixes_lowbit_and_base_types(tier):
    # One input for several types, in one call (up to three matrices: _matvec_of's closure) and more (three at a
    # time, int8.matvec); the base types' results unchanged by the low-bit ones beside them.
    K = 512
    ws = [(_random_blocks(G.Q2_K, 7, K, 1), G.Q2_K), (_random_blocks(G.Q3_K, 5, K, 2), G.Q3_K),
          (np.random.default_rng(3).integers(0, 256, (4, row_bytes(G.Q8_0, K)), dtype=np.uint8), G.Q8_0)]
    ws[2][0].reshape(4, -1, 34)[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite d
    x = _inputs(3, K, seed=5)
    for group in (ws, ws[1:] + ws + ws[:1]):
        qin = int8.quantize(x, [t for _, t in group])
        out = int8.matvec(group, qin, tier=tier)
        col = 0
        for raw, t in group:
            _assert_close(out[:, col:col + raw.shape[0]], int8.dequantized_input(qin, t),
                          reference.dequantize_raw(raw, t, K))
            np.testing.assert_array_equal(out[:, col:col + raw.shape[0]], int8.matvec([(raw, t)], qin, tier=tier))
            col += raw.shape[0]


# ---------------------------------------------------------------------------------------------------------
# Whole tensors of real files: testdata/make_quant_kit.py's llama.cpp quantizations of the family kit
# ---------------------------------------------------------------------------------------------------------


def _kit_tensors() -> list[tuple[str, GGMLType, np.ndarray]]:
    """(name, type, raw (rows, row_bytes)) of every distinct (type, shape) of Q2_K / Q3_K in the quant kit."""
    paths = sorted(QUANT_KIT.glob("*.gguf")) if QUANT_KIT.is_dir() else []
    if not paths:
        pytest.skip(QUANT_KIT_MISSING)
    seen, out = set(), []
    for path in paths:
        for tensor in gguf.GGUFReader(path).tensors:
            code = int(tensor.tensor_type)
            if code not in (int(G.Q2_K), int(G.Q3_K)) or len(tensor.shape) != 2:
                continue
            t, cols = GGMLType(code), int(tensor.shape[0])  # GGUF lists the row length first
            if (t, tuple(tensor.shape)) in seen:
                continue
            seen.add((t, tuple(tensor.shape)))
            out.append((f"{path.name}: {tensor.name}", t, np.asarray(tensor.data).reshape(-1, row_bytes(t, cols))))
    return out


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_quant_kit_tensors(tier):
    tensors = _kit_tensors()
    assert {t for _, t, _ in tensors} == set(LOWK), "the kit holds no tensor of one of the types"
    rng = np.random.default_rng(7)
    for name, t, raw in tensors:
        raw = np.ascontiguousarray(raw[:96])
        K = raw.shape[1] // BLOCK_GEOMETRY[t][1] * 256
        x = rng.standard_normal((3, K)).astype(np.float32)
        qin = int8.quantize(x, [t])
        np.testing.assert_array_equal(int8.integer_dots((raw, t), qin, tier=tier), _ref_integer_dots(raw, t, K, x),
                                      err_msg=name)
        got = int8.matvec([(raw, t)], qin, tier=tier)
        wf = reference.dequantize_raw(raw, t, K)
        _assert_close(got, int8.dequantized_input(qin, t), wf)
        # against exact f32 activations the int8 ones cost ~0.5 % (as in llama.cpp): a sanity bound
        exact = x.astype(np.float64) @ wf.T.astype(np.float64)
        assert np.linalg.norm(got - exact) <= 0.02 * np.linalg.norm(exact), name
