"""Integer kernels (engine/kernels/cpu/int8.py) and the "cpu-q8" backend against numpy references written here:
activation quantization bit for bit, per-block integer dot products exactly, float results within 1e-5 relative
of the float64 product of the dequantized weights (reference.py) and the dequantized int8 activations.
Every code tier this CPU can run is tested (generic = the fallback); tiers it cannot run are reported as skipped.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from engine.formats.gguf import GGUFFile
from engine.kernels import reference
from engine.kernels.cpu import gemm8, int8, ir, quantize
from engine.kernels.cpu.matmul import Q8_MATVEC_MAX_T, Int8Kernels, MatmulKernels, kernels_for
from engine.kernels.quant_types import STEP_TYPES, GGMLType, QTensor, row_bytes
from tests.conftest import in_kit
from testdata import make_fixtures

G = GGMLType
LEGACY = [G.Q4_0, G.Q4_1, G.Q5_0, G.Q5_1, G.Q8_0, G.MXFP4]  # MXFP4: 32-weight blocks too
KQUANT = [G.Q4_K, G.Q5_K, G.Q6_K]
FLOATS = [G.F32, G.F16, G.BF16]
TIER_PARAMS = [pytest.param(t, marks=pytest.mark.skipif(t not in ir.available_tiers(),
                                                        reason=f"this CPU cannot run the {t} kernels"))
               for t in ir.TIERS]


def _ids(ts):
    return [t.name for t in ts]


# ---------------------------------------------------------------------------------------------------------
# numpy references: activation quantization and integer dot products
# ---------------------------------------------------------------------------------------------------------


def _ref_quantize(x: np.ndarray, block: int):
    """x (M, K) f32 -> q (M, K) int8 natural order, d (M, K/block) f32: d = amax/127, q = rint(x * (1/d))."""
    M, K = x.shape
    b = x.reshape(M, K // block, block)
    d = np.abs(b).max(axis=-1) / np.float32(127.0)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, np.float32(1.0)), np.float32(0.0))
    q = np.rint(b * inv[..., None].astype(np.float32))
    return q.astype(np.int8).reshape(M, K), d.astype(np.float32)


def _ref_quantize_legacy(x):
    q, d = _ref_quantize(x, 32)
    xsum = d * q.reshape(*d.shape, 32).sum(axis=-1, dtype=np.int32).astype(np.float32)
    return q, d, xsum


def _ref_quantize_k(x):
    q, d = _ref_quantize(x, 256)
    M, K = x.shape
    s16 = q.reshape(M, K // 256, 16, 16).sum(axis=-1, dtype=np.int32)
    s32 = q.reshape(M, K // 256, 8, 32).sum(axis=-1, dtype=np.int32)
    return q, d, s32, s16


def _nibbles(qs):
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


# ggml's kvalues_mxfp4: the E2M1 values doubled
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)


def _ref_legacy_quants(raw, t: GGMLType, K: int) -> np.ndarray:
    """The stored integer of every weight (rows, K) int64: unsigned 4/5-bit quants, signed q for Q8_0, for
    MXFP4 its code's doubled E2M1 value + 12 (kept unsigned by the kernels, as Q4_0's nibble with its - 8)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, K // 32, -1)
    if t == G.Q8_0:
        q = b[..., 2:34].view(np.int8)
    elif t == G.MXFP4:  # u8 e | 16 bytes of codes, nibbles as Q4_0
        q = MXFP4_VALUES[_nibbles(b[..., 1:17])] + 12
    else:
        qs, qh = {G.Q4_0: (2, None), G.Q4_1: (4, None), G.Q5_0: (6, 2), G.Q5_1: (8, 4)}[t]
        q = _nibbles(b[..., qs:qs + 16])
        if qh is not None:  # bit j of the little-endian u32 is the fifth bit of weight j
            q = q | (np.unpackbits(b[..., qh:qh + 4], axis=-1, bitorder="little") << 4)
    return q.astype(np.int64).reshape(rows, K)


def _ref_integer_dots(raw, t: GGMLType, K: int, x: np.ndarray) -> np.ndarray:
    """What int8.integer_dots must return, from x (M, K) f32 through the reference quantizers."""
    rows, M = raw.shape[0], x.shape[0]
    if t in LEGACY:
        xq = _ref_quantize_legacy(x)[0].astype(np.int64).reshape(M, 1, K // 32, 32)
        return (_ref_legacy_quants(raw, t, K).reshape(1, rows, K // 32, 32) * xq).sum(-1)
    xq, _, s32, s16 = _ref_quantize_k(x)
    nsb = K // 256
    xq = xq.astype(np.int64).reshape(M, 1, nsb, 256)
    b = raw.reshape(rows, nsb, -1)
    if t == G.Q6_K:  # ql[128] | qh[64] | i8 scales[16] | f16 d; see reference._q6_k for the weight order
        ql, qh = b[..., 0:128].reshape(rows, nsb, 2, 64), b[..., 128:192].reshape(rows, nsb, 2, 1, 32)
        low = _nibbles(ql).reshape(rows, nsb, 2, 4, 32)
        high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = (low | (high << 4)).astype(np.int64).reshape(1, rows, nsb, 16, 16)
        sc = b[..., 192:208].view(np.int8).astype(np.int64).reshape(1, rows, nsb, 16)
        dots = (q * xq.reshape(M, 1, nsb, 16, 16)).sum(-1) - 32 * s16.astype(np.int64)[:, None]
        return np.stack([(sc * dots).sum(-1), np.zeros((M, rows, nsb), np.int64)], axis=-1)
    sc, m = reference.k_scale_min(b[..., 4:16].reshape(-1, 12))
    sc, m = sc.astype(np.int64).reshape(1, rows, nsb, 8), m.astype(np.int64).reshape(1, rows, nsb, 8)
    qs = 16 if t == G.Q4_K else 48
    q = _nibbles(b[..., qs:qs + 128].reshape(rows, nsb, 4, 32)).reshape(rows, nsb, 8, 32).astype(np.int64)
    if t == G.Q5_K:  # bit s of qh[l] is the fifth bit of weight l of sub-block s
        qh = b[..., 16:48].reshape(rows, nsb, 1, 32)
        q |= ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1).astype(np.int64) << 4
    dots = (q[None] * xq.reshape(M, 1, nsb, 8, 32)).sum(-1)
    return np.stack([(sc * dots).sum(-1), (m * s32.astype(np.int64)[:, None]).sum(-1)], axis=-1)


def _assert_close(got, x, w, rtol=1e-5):
    """got ~ x @ w.T within rtol of the sum of |terms| each output adds (f32 summation-order rounding)."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want, scale = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    err = np.abs(got.astype(np.float64) - want)
    assert got.shape == want.shape and got.dtype == np.float32
    worst = np.unravel_index(np.argmax(err - rtol * scale), err.shape)
    assert np.all(err <= rtol * scale), f"at {worst}: got {got[worst]}, want {want[worst]} (scale {scale[worst]})"


def _sane(t: GGMLType, rows: int, cols: int, seed: int) -> QTensor:
    raw = make_fixtures.random_weight(np.random.default_rng(seed), rows, cols, t)
    return QTensor(f"random.{t.name}", t, (rows, cols), raw)


def _random_bytes(t: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(rows, row_bytes(t, cols)), dtype=np.uint8)


def _inputs(M: int, K: int, seed: int) -> np.ndarray:
    """Activations with blocks of very different sizes, an all-zero block and exact rounding ties."""
    rng = np.random.default_rng(seed)
    size = rng.choice(np.array([0.01, 1.0, 30.0], np.float32), size=(M, K // 32, 1))
    x = (rng.standard_normal((M, K // 32, 32)).astype(np.float32) * size).reshape(M, K)
    x[0, :32] = 0.0
    if K >= 64:  # amax 127 makes the scale exactly 1: the halves are ties (rint rounds them to even)
        x[-1, 32:64] = np.r_[127.0, np.arange(31) - 15.5].astype(np.float32)
    return x


# ---------------------------------------------------------------------------------------------------------
# Activation quantization: bit for bit
# ---------------------------------------------------------------------------------------------------------


def test_legacy_order_interleaves_pairs_of_blocks():
    order = quantize.legacy_x_order(96)  # a pair, then an odd last block in natural order
    want = np.r_[0:16, 32:48, 16:32, 48:64, 64:96]
    np.testing.assert_array_equal(order, want)
    assert sorted(quantize.legacy_x_order(640)) == list(range(640))


@pytest.mark.parametrize("M,K", [(1, 32), (3, 96), (2, 576), (1, 1536)])
def test_quantize_legacy_matches_reference(M, K):
    x = _inputs(M, K, seed=K)
    qin = int8.quantize(x)
    q, d, xsum = _ref_quantize_legacy(x)
    np.testing.assert_array_equal(qin.xq8, q[:, quantize.legacy_x_order(K)])
    np.testing.assert_array_equal(qin.xs8.reshape(M, -1, 2)[..., 0].view(np.uint32), d.view(np.uint32))
    np.testing.assert_array_equal(qin.xs8.reshape(M, -1, 2)[..., 1].view(np.uint32), xsum.view(np.uint32))
    assert (q[0, :32] == 0).all() and d[0, 0] == 0  # the all-zero block
    assert K == 32 or np.abs(q.astype(np.int32)).max() == 127
    assert qin.xqk.size == 0  # not asked for


@pytest.mark.parametrize("M,K", [(1, 256), (3, 768), (2, 2048)])
def test_quantize_k_matches_reference(M, K):
    x = _inputs(M, K, seed=K + 1)
    qin = int8.quantize(x, [G.Q4_K])
    q, d, s32, s16 = _ref_quantize_k(x)
    np.testing.assert_array_equal(qin.xqk, q)
    np.testing.assert_array_equal(qin.xdk.view(np.uint32), d.view(np.uint32))
    np.testing.assert_array_equal(qin.xbk[..., :8], s32)
    np.testing.assert_array_equal(qin.xbk[..., 8:], s16)
    assert qin.xq8.size == 0


def test_quantize_refuses_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        int8.quantize(np.ones((1, 40), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        int8.quantize(np.ones((1, 96), np.float32), [G.Q6_K])
    assert int8.quantize(np.ones(64, np.float32)).shape == (1, 64)  # a single vector is (1, K)


# ---------------------------------------------------------------------------------------------------------
# Integer dot products: exactly equal, on entirely random blocks (every bit pattern, q = -128 included)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", LEGACY + KQUANT, ids=_ids(LEGACY + KQUANT))
def test_integer_dots_match_reference(t, tier):
    for seed, K in enumerate([256, 768] if t in KQUANT else [32, 64, 96, 160, 576]):
        raw = _random_bytes(t, 9, K, seed)
        x = _inputs(2, K, seed)
        got = int8.integer_dots((raw, t), int8.quantize(x, [t]), tier=tier)
        want = _ref_integer_dots(raw, t, K, x)
        assert got.dtype == np.int32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want, err_msg=f"{t.name} K={K}")


# ---------------------------------------------------------------------------------------------------------
# Float results: within 1e-5 relative of the exact product of the quantized operands
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", LEGACY + KQUANT + FLOATS, ids=_ids(LEGACY + KQUANT + FLOATS))
def test_matvec_matches_reference(t, tier):
    for seed, (rows, K, M) in enumerate([(37, 512, 1), (5, 768, 3), (6, 512, 7)] if t in KQUANT else
                                        [(37, 96, 1), (5, 32, 2), (13, 576, 3), (8, 640, 1)]):
        w = _sane(t, rows, K, seed)
        qin = int8.quantize(_inputs(M, K, seed), [t])
        _assert_close(int8.matvec([w], qin, tier=tier), int8.dequantized_input(qin, t), reference.dequantize(w))


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("t", KQUANT, ids=_ids(KQUANT))
def test_kquant_rows_give_each_vector_its_own_result_bit_for_bit(t, tier):
    # K-quant rows meet the vectors four, then two, then one at a time (kquant.rows_*): for every count the results
    # are each vector's as if it came alone.
    w = _sane(t, 11, 512, seed=3)
    x = _inputs(9, 512, seed=4)
    alone = np.concatenate([int8.matvec([w], int8.quantize(x[m:m + 1], [t]), tier=tier) for m in range(9)])
    for M in range(1, 10):
        got = int8.matvec([w], int8.quantize(x[:M], [t]), tier=tier)
        np.testing.assert_array_equal(got.view(np.uint32), alone[:M].view(np.uint32), err_msg=f"M={M}")


def test_matvec_detects_a_changed_weight():
    # The tolerance sees one weight's lowest bit change (the tests above can fail).
    w = _sane(G.Q4_1, 8, 64, seed=5)
    qin = int8.quantize(np.ones((1, 64), np.float32))
    got = int8.matvec([w], qin)
    bumped = w.raw.copy()
    bumped[3, 4] ^= 1  # row 3, first block's first quant byte
    with pytest.raises(AssertionError):
        _assert_close(got, int8.dequantized_input(qin, G.Q4_1), reference.dequantize_raw(bumped, G.Q4_1, 64))


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_fused_matvec_over_mixed_types_shares_one_input(tier):
    # q|k|v-style fusion with the types mixed as in Gemma's Q4_K_M (legacy, K-quant and float in one call).
    ws = [_sane(t, rows, 512, seed) for seed, (t, rows) in
          enumerate([(G.Q5_0, 40), (G.Q8_0, 8), (G.Q4_K, 24), (G.Q6_K, 3), (G.F16, 5), (G.Q4_1, 1)])]
    x = _inputs(2, 512, seed=11)
    qin = int8.quantize(x, [w.ggml_type for w in ws])
    out = np.full((2, sum(w.rows for w in ws)), np.nan, np.float32)
    assert int8.matvec(ws, qin, out, tier=tier) is out
    col = 0
    for w in ws:
        _assert_close(out[:, col:col + w.rows], int8.dequantized_input(qin, w.ggml_type), reference.dequantize(w))
        col += w.rows


def test_matvec_checks_its_arguments():
    w = _sane(G.Q4_K, 4, 256, seed=1)
    with pytest.raises(ValueError, match="not quantized for Q4_K"):
        int8.matvec([w], int8.quantize(np.ones((1, 256), np.float32)))
    with pytest.raises(ValueError, match="input has 512 columns, the weights 256"):
        int8.matvec([w], int8.quantize(np.ones((1, 512), np.float32), [G.Q4_K]))
    with pytest.raises(ValueError, match="rows of 256"):  # matrices of one group share their columns
        int8.prepare([w, _sane(G.Q8_0, 4, 512, seed=2)])
    with pytest.raises(ValueError, match="rows of"):
        int8.prepare([(np.zeros((2, 21), np.uint8), G.Q4_1)])  # not whole blocks
    with pytest.raises(NotImplementedError, match="Q8_K"):  # a type with no kernel (GGML type 15)
        int8.matvec([(np.zeros((2, 292), np.uint8), 15)], int8.quantize(np.ones((1, 256), np.float32)))
    with pytest.raises(ValueError, match="out must be"):
        int8.matvec([w], int8.quantize(np.ones((1, 256), np.float32), [G.Q4_K]), np.empty((1, 5), np.float32))


# ---------------------------------------------------------------------------------------------------------
# Tiers
# ---------------------------------------------------------------------------------------------------------


def test_tiers_are_chosen_from_cpu_features_and_can_be_forced(monkeypatch):
    assert ir.available_tiers()[0] == "generic" and ir.TIER in ir.available_tiers()
    monkeypatch.setenv("GOINFER_CPU_TIER", "generic")
    assert ir._default_tier() == "generic"
    monkeypatch.setenv("GOINFER_CPU_TIER", "auto")
    assert ir._default_tier() == ir.available_tiers()[-1]
    with pytest.raises(ValueError, match="unknown CPU kernel tier"):
        ir.tier_token("sse9")
    for t in set(ir.TIERS) - set(ir.available_tiers()):  # never compiled: LLVM would abort
        with pytest.raises(ValueError, match="cannot run"):
            ir.tier_token(t)


def test_a_bad_forced_tier_is_reported_when_used(monkeypatch):
    # GOINFER_CPU_TIER=vnni on a CPU without VNNI must not break importing the engine.
    monkeypatch.setattr(ir, "_TIER_ERROR", ValueError("this CPU cannot run the 'vnni' kernels"))
    with pytest.raises(ValueError, match="GOINFER_CPU_TIER"):
        kernels_for("cpu-q8")
    assert Int8Kernels("generic").tier == "generic"  # an explicit tier still works


# ---------------------------------------------------------------------------------------------------------
# The backend: every tensor type of the tiny fixtures, both paths
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_matrices(tmp_path_factory) -> list[QTensor]:
    d = tmp_path_factory.mktemp("q8_fixtures")
    out = []
    for path in (make_fixtures.write_llama_fixture(d / "llama.gguf"), make_fixtures.write_gemma3_fixture(d / "g.gguf")):
        f = GGUFFile(path)
        out += [f.tensor(n) for n, e in f.entries.items() if len(e.shape) == 2]
    f = GGUFFile(make_fixtures.write_mxfp4_fixture(d / "mxfp4.gguf"))  # only its MXFP4 matrices are new
    out += [f.tensor(n) for n, e in f.entries.items() if e.type_id == int(G.MXFP4)]
    assert {t.ggml_type for t in out} == STEP_TYPES  # the low-bit types: test_lowbit_int8.py, test_iquant_int8.py
    return out


def test_backend_is_registered():
    be = kernels_for("cpu-q8")
    assert isinstance(be, Int8Kernels) and isinstance(be, MatmulKernels) and be.name == "cpu-q8"
    assert be.tier == ir.TIER and Int8Kernels("generic").tier == "generic"


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_backend_matmul_on_fixtures_both_paths(fixture_matrices, tier):
    be = Int8Kernels(tier)
    rng = np.random.default_rng(6)
    for T in (1, 3, Q8_MATVEC_MAX_T, Q8_MATVEC_MAX_T + 1, 33, 64):
        for w in fixture_matrices:
            x = rng.standard_normal((T, w.cols)).astype(np.float32)
            got = be.matmul(x, w)
            # int8 activations (float weights keep f32 ones): decode and a prompt's partial tile (the matvec, or
            # over K-quants the int8 GEMM past a few rows), and whole tiles over K-quants (the GEMM; sgemm for others)
            form = gemm8.variant(tier) if gemm8.usable(w) else None
            if T <= Q8_MATVEC_MAX_T or form == "512" or (form == "256" and T >= 64):
                x = int8.dequantized_input(int8.quantize(x, [w.ggml_type]), w.ggml_type)
            _assert_close(got, x, reference.dequantize(w))


def test_backend_matmul_many(fixture_matrices):
    be = kernels_for("cpu-q8")
    by_cols = {}
    for w in fixture_matrices:
        by_cols.setdefault(w.cols, []).append(w)
    group = max(by_cols.values(), key=len)  # several types sharing one input
    assert len({w.ggml_type for w in group}) > 2
    for T in (1, 2, Q8_MATVEC_MAX_T + 3):
        x = np.random.default_rng(T).standard_normal((T, group[0].cols)).astype(np.float32)
        outs = be.matmul_many(x, group)
        assert [o.shape for o in outs] == [(T, w.rows) for w in group]
        for o, w in zip(outs, group):
            np.testing.assert_array_equal(o, be.matmul(x, w))  # same kernels, same input quantization
    assert be.matmul_many(x, []) == []


# ---------------------------------------------------------------------------------------------------------
# Real tensors: every (type, shape) the two real models hold
# ---------------------------------------------------------------------------------------------------------


def _distinct_matrices(path, max_rows=512) -> list[QTensor]:
    f = GGUFFile(path)
    seen, out = set(), []
    for name, e in f.entries.items():
        if len(e.shape) == 2 and (e.type_id, e.shape) not in seen:
            seen.add((e.type_id, e.shape))
            t = f.tensor(name)
            if t.rows > max_rows:  # a vocabulary head: its first rows, still a view of the file
                t = QTensor(f"{name}[:{max_rows}]", t.ggml_type, (max_rows, t.cols), t.raw[:max_rows])
            out.append(t)
    return out


@pytest.fixture(scope="module")
def real_matrices(smollm2_gguf, gemma_gguf) -> list[QTensor]:
    ms = _distinct_matrices(smollm2_gguf) + _distinct_matrices(gemma_gguf)
    assert {m.ggml_type for m in ms} == {G.Q4_1, G.Q8_0, G.Q5_0, G.Q4_K, G.Q6_K}
    return ms


@pytest.mark.real_model
@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_real_tensors(real_matrices, tier):
    rng = np.random.default_rng(10)
    for w in real_matrices:
        x = rng.standard_normal((2, w.cols)).astype(np.float32)
        qin = int8.quantize(x, [w.ggml_type])
        np.testing.assert_array_equal(int8.integer_dots(w, qin, tier=tier)[:, :64],
                                      _ref_integer_dots(w.raw[:64], w.ggml_type, w.cols, x), err_msg=w.name)
        got = int8.matvec([w], qin, tier=tier)
        wf = reference.dequantize(w)
        _assert_close(got, int8.dequantized_input(qin, w.ggml_type), wf)
        # Against exact f32 activations the int8 ones cost ~0.5 % (as in llama.cpp): a sanity bound.
        exact = x.astype(np.float64) @ wf.T.astype(np.float64)
        assert np.linalg.norm(got - exact) <= 0.02 * np.linalg.norm(exact), w.name


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_mxfp4_expert_stacks(tier):
    # gpt-oss's expert matrices (the families kit's tiny model): (n_expert * out, in) rows of MXFP4 blocks.
    f = GGUFFile(in_kit("gpt_oss", "tiny-gpt-oss-a.MXFP4_MOE.gguf"))
    stacks = [f.tensor(n) for n, e in f.entries.items() if e.type_id == int(G.MXFP4)]
    assert len(stacks) == 6
    rng = np.random.default_rng(12)
    for w in stacks:
        x = rng.standard_normal((2, w.cols)).astype(np.float32)
        qin = int8.quantize(x, [w.ggml_type])
        np.testing.assert_array_equal(int8.integer_dots(w, qin, tier=tier),
                                      _ref_integer_dots(w.raw, w.ggml_type, w.cols, x), err_msg=w.name)
        got = int8.matvec([w], qin, tier=tier)
        wf = reference.dequantize(w)
        _assert_close(got, int8.dequantized_input(qin, w.ggml_type), wf)
        exact = x.astype(np.float64) @ wf.T.astype(np.float64)
        assert np.linalg.norm(got - exact) <= 0.02 * np.linalg.norm(exact), w.name


@pytest.mark.parametrize("kit", ["qwen3_moe/tiny-qwen3-moe-a.Q4_K_M.gguf", "gpt_oss/tiny-gpt-oss-a.MXFP4_MOE.gguf",
                                 "qwen3_moe/tiny-qwen3-moe-a.Q8_0.gguf"])
@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_grouped_experts_equal_the_matvec_expert_by_expert(kit, tier):
    # kernels/cpu/expert_matmul.py: a prompt tile's (token, expert) pairs grouped by expert, one call per stacked
    # tensor, against the int8 matvec of each expert's own rows over its group's inputs: bit for bit, with
    # groups of 1 to 20 rows, experts out of order and some experts unused.
    from engine.kernels.cpu import expert_matmul

    f = GGUFFile(in_kit(kit))
    n_expert = f.metadata[f"{f.metadata['general.architecture']}.expert_count"]
    stacks = [f.tensor(n) for n in f.entries if n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight"))][:2]
    assert all(expert_matmul.usable(s) for s in stacks)
    rng = np.random.default_rng(3)
    experts = rng.permutation(n_expert)[: max(2, n_expert - 2)]
    sizes = rng.integers(1, 21, len(experts))
    starts = np.concatenate(([0], np.cumsum(sizes)))
    x = rng.standard_normal((starts[-1], stacks[0].cols)).astype(np.float32)
    got = expert_matmul.expert_matmul(x, experts, starts, stacks, n_expert, tier)
    for out, stack in zip(got, stacks):
        per = stack.rows // n_expert
        for i, e in enumerate(experts):
            view = QTensor(stack.name, stack.ggml_type, (per, stack.cols), stack.raw[e * per : (e + 1) * per])
            rows = x[starts[i] : starts[i + 1]]
            want = int8.matvec([view], int8.quantize(rows, [view.ggml_type]), tier=tier)
            np.testing.assert_array_equal(out[starts[i] : starts[i + 1]], want, err_msg=f"{stack.name} expert {e}")


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_mxfp4_matvec_covers_every_scale_a_quantizer_writes(tier):
    # The kernels sum blocks with 4 * 2^(e-128) and scale the row by 1/4 (legacy.py): exact for e <= 253, the
    # two subnormal scales (e = 0, 1) included; ggml's quantizer writes e <= 252. Small exponents meet large
    # activations and large ones small activations, so every product stays a normal f32.
    rng = np.random.default_rng(13)
    for exps, size in (([0, 1, 2, 3], 100.0), ([120, 127, 134], 1.0), ([250, 252, 253], 1e-30)):
        raw = rng.integers(0, 256, (6, 8 * 17), dtype=np.uint8)  # 8 blocks per row
        blocks = raw.reshape(6, 8, 17)
        blocks[:, :, 0] = rng.choice(exps, (6, 8))
        blocks[0, :, 0] = exps[0]  # a row of the smallest scale alone
        if exps[-1] == 253:  # 8 * 2^125 overflows f32 already in the weights: codes of |value| <= 1.5 there
            codes = blocks[..., 1:]  # (E2M1: sign bit 3, exponent bits 1-2; their exponent's top bit moves down)
            blocks[..., 1:] = (codes & 0x99) | ((codes & 0x44) >> 1)
        x = (rng.standard_normal((2, 256)) * size).astype(np.float32)
        qin = int8.quantize(x, [G.MXFP4])
        w = reference.dequantize_raw(raw, G.MXFP4, 256)
        assert np.isfinite(w).all()
        _assert_close(int8.matvec([(raw, G.MXFP4)], qin, tier=tier), int8.dequantized_input(qin, G.MXFP4), w)


# ---------------------------------------------------------------------------------------------------------
# The njit entry points, called from compiled code (as a compiled decode step will)
# ---------------------------------------------------------------------------------------------------------


@numba.njit(cache=False)
def _compiled_step(x, wa, ta, wb, tb, xq8, xs8, xqk, xdk, xbk, out, tier):
    # One input quantized in place, then two matrices' rows in 4 ranges (as plain_threads runs them).
    quantize.quantize_legacy_into(x, xq8, xs8, 0, x.shape[1])
    quantize.quantize_k_into(x, xqk, xdk, xbk, 0, x.shape[1])
    starts = np.array([0, wa.shape[0], wa.shape[0] + wb.shape[0]])
    for ch in range(4):
        int8.matvec_into((wa, wb), np.array([ta, tb]), starts, xq8, xs8, xqk, xdk, xbk, x, out, tier, 4, ch)


def test_entry_points_compose_inside_njit():
    wa, wb = _sane(G.Q4_1, 12, 512, seed=1), _sane(G.Q6_K, 7, 512, seed=2)
    x = _inputs(2, 512, seed=3)
    qin = int8.quantize(x, [G.Q4_1, G.Q6_K])
    bufs = [np.empty_like(a) for a in (qin.xq8, qin.xs8, qin.xqk, qin.xdk, qin.xbk)]
    out = np.empty((2, 19), np.float32)
    _compiled_step(x, wa.raw, int(wa.ggml_type), wb.raw, int(wb.ggml_type), *bufs, out, ir.tier_token())
    np.testing.assert_array_equal(out, int8.matvec([wa, wb], qin))
