"""Quantized kernels: reference.py against gguf.quants (bit for bit), the numba kernels and backends against
reference.py, on random blocks, on the tiny fixtures and on real tensors of every type the real models hold."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.formats.gguf import GGUFFile
from engine.kernels.cpu import matmul as matmul_mod
from engine.kernels import reference
from engine.kernels.cpu import exact
from engine.kernels.cpu.matmul import ExactKernels, MatmulKernels, ReferenceKernels, kernels_for
from engine.kernels.quant_types import (BLOCK_GEOMETRY, COMPUTE_TYPES, LATTICE_TYPES, STEP_TYPES, GGMLType,
                                        QTensor, row_bytes)
from tests.conftest import KIT, needs_kit
from testdata import make_fixtures

ALL_TYPES = list(GGMLType)  # the reference decodes every one
KERNEL_TYPES = sorted(COMPUTE_TYPES)  # the CPU kernels these
# gpt-oss's MXFP4 expert stacks (3-D [in, out, n_expert] in GGUF): the families kit's tiny model
GPT_OSS_MXFP4 = KIT / "gpt_oss" / "tiny-gpt-oss-a.MXFP4_MOE.gguf"


def _ids(types):
    return [t.name for t in types]


def _bits(a: np.ndarray) -> np.ndarray:
    """Floats as bit patterns, so -0.0 and 0.0 differ. NaNs all map to one pattern: their payloads carry no
    meaning, and the hardware f16 -> f32 conversion quiets signalling NaNs where numpy's does not."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))


def _oracle(raw: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(ggml_type)))


def _random_bytes(ggml_type: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Entirely random blocks: scales include subnormals, infinities and NaNs. Decoders must still agree."""
    return np.random.default_rng(seed).integers(0, 256, size=(rows, row_bytes(ggml_type, cols)), dtype=np.uint8)


def _sane(ggml_type: GGMLType, rows: int, cols: int, seed: int) -> QTensor:
    raw = make_fixtures.random_weight(np.random.default_rng(seed), rows, cols, ggml_type)
    return QTensor(f"random.{ggml_type.name}", ggml_type, (rows, cols), raw)


def _assert_close(got: np.ndarray, x: np.ndarray, w: np.ndarray, rtol: float = 1e-5) -> None:
    """got ~ x @ w.T. f32 sums in another order differ from the float64 product by a few ulp of sum |x||w|
    (at most n * eps for n terms, ~sqrt(n) * eps in practice); a single wrong weight moves it by far more."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T  # (T, rows): the size of the terms each output sums
    err = np.abs(got.astype(np.float64) - want)
    assert got.shape == want.shape and got.dtype == np.float32
    worst = np.unravel_index(np.argmax(err - rtol * scale), err.shape)
    assert np.all(err <= rtol * scale), f"at {worst}: got {got[worst]}, want {want[worst]} (scale {scale[worst]})"


def _cols_for(t: GGMLType) -> int:
    return 512 if BLOCK_GEOMETRY[t][0] == 256 else 96


# ---------------------------------------------------------------------------------------------------------
# Shared data: the tiny fixtures' matrices, a few real tensors
# ---------------------------------------------------------------------------------------------------------


def _matrices(path) -> list[QTensor]:
    f = GGUFFile(path)
    return [f.tensor(name) for name, e in f.entries.items() if len(e.shape) == 2]


@pytest.fixture(scope="module")
def fixture_matrices(tmp_path_factory) -> list[QTensor]:
    d = tmp_path_factory.mktemp("quant_fixtures")
    mxfp4 = [t for t in _matrices(make_fixtures.write_mxfp4_fixture(d / "mxfp4.gguf"))
             if t.ggml_type == GGMLType.MXFP4]  # the rest of that file repeats the llama fixture's types
    return (_matrices(make_fixtures.write_llama_fixture(d / "llama.gguf"))
            + _matrices(make_fixtures.write_gemma3_fixture(d / "gemma3.gguf")) + mxfp4)


def _head_rows(t: QTensor, n: int) -> QTensor:
    """The first n rows of a big matrix (a vocabulary head), still a view of the file."""
    return QTensor(t.name + f"[:{n}]", t.ggml_type, (n, t.cols), t.raw[:n])


@pytest.fixture(scope="module")
def real_tensors(smollm2_gguf, gemma_gguf) -> dict[str, QTensor]:
    s, g = GGUFFile(smollm2_gguf), GGUFFile(gemma_gguf)
    picks = {
        "smollm2.attn_q(Q4_1)": s.tensor("blk.0.attn_q.weight"),
        "smollm2.ffn_down(Q4_1)": s.tensor("blk.7.ffn_down.weight"),
        "smollm2.head(Q8_0)": _head_rows(s.tensor("token_embd.weight"), 2048),
        "gemma.attn_q(Q5_0)": g.tensor("blk.0.attn_q.weight"),
        "gemma.attn_output(Q4_K)": g.tensor("blk.0.attn_output.weight"),
        "gemma.ffn_down(Q6_K)": g.tensor("blk.0.ffn_down.weight"),
        "gemma.attn_v(Q8_0)": g.tensor("blk.0.attn_v.weight"),
        "gemma.head(Q8_0)": _head_rows(g.tensor("token_embd.weight"), 1024),
    }
    for label, t in picks.items():
        assert label.endswith(f"({t.ggml_type.name})"), (label, t.ggml_type)
    return picks


def test_fixtures_hold_every_type(fixture_matrices):
    # the decode step's types; the low-bit ones: tests/test_lowbit_*.py, test_iquant_int8.py and the quant kit
    assert {t.ggml_type for t in fixture_matrices} == STEP_TYPES


# ---------------------------------------------------------------------------------------------------------
# (i) reference.py == gguf.quants, bit for bit
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_reference_matches_gguf_on_random_blocks(ggml_type):
    # Same float operations in the same order as ggml, so every bit agrees, NaN and -0.0 included.
    for seed, (rows, cols) in enumerate([(3, _cols_for(ggml_type)), (17, 2 * _cols_for(ggml_type))]):
        raw = _random_bytes(ggml_type, rows, cols, seed)
        with np.errstate(invalid="ignore", over="ignore"):
            got, want = reference.dequantize_raw(raw, ggml_type, cols), _oracle(raw, ggml_type)
        assert got.shape == (rows, cols) and got.dtype == np.float32
        np.testing.assert_array_equal(_bits(got), _bits(want.reshape(rows, cols)))


def test_reference_matches_gguf_on_fixture_tensors(fixture_matrices):
    for t in fixture_matrices:
        got = reference.dequantize(t)
        assert np.isfinite(got).all(), t.name
        np.testing.assert_array_equal(_bits(got), _bits(_oracle(t.raw, t.ggml_type).reshape(t.shape)), err_msg=t.name)


def test_reference_matches_gguf_on_real_tensors(real_tensors):
    for label, t in real_tensors.items():
        want = _oracle(t.raw, t.ggml_type)
        np.testing.assert_array_equal(_bits(reference.dequantize(t)), _bits(want), err_msg=label)


def test_reference_decodes_known_blocks():
    # Hand-made blocks, independent of gguf: Q8_0 with d = 0.5 and Q4_0 with d = 2.
    q8 = np.zeros((1, 34), np.uint8)
    q8[0, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    q8[0, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(reference.dequantize_raw(q8, GGMLType.Q8_0, 32)[0], np.arange(-16, 16) * 0.5)
    q4 = np.zeros((1, 18), np.uint8)
    q4[0, :2] = np.frombuffer(np.float16(2.0).tobytes(), np.uint8)
    q4[0, 2:] = np.arange(16, dtype=np.uint8) | (np.uint8(15) << 4)  # low nibbles 0..15, high nibbles all 15
    want = np.concatenate([np.arange(16) - 8, np.full(16, 7)]) * 2.0
    np.testing.assert_array_equal(reference.dequantize_raw(q4, GGMLType.Q4_0, 32)[0], want)


def test_reference_matmul_and_embed_rows():
    t = _sane(GGMLType.Q5_1, 40, 64, seed=1)
    w = reference.dequantize(t)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(reference.matmul(x, t), x @ w.T)
    np.testing.assert_array_equal(reference.embed_rows(t, [5, 0, 5, 39]), w[[5, 0, 5, 39]])


def test_unsupported_types_are_refused():
    with pytest.raises(NotImplementedError, match="Q8_K"):  # no decoder at all (292 bytes per 256 weights)
        reference.dequantize_raw(np.zeros((2, 292), np.uint8), 15, 256)
    with pytest.raises(NotImplementedError, match="Q8_K"):  # nor a CPU kernel
        exact.dequantize_into(np.zeros((2, 292), np.uint8), 15, np.empty((2, 256), np.float32))
    with pytest.raises(ValueError):  # row_bytes does not match the column count
        exact.dequantize_into(np.zeros((2, 20), np.uint8), GGMLType.Q4_1, np.empty((2, 64), np.float32))


# ---------------------------------------------------------------------------------------------------------
# (ii) numba dequantize == reference, bit for bit
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", sorted(LATTICE_TYPES), ids=_ids(sorted(LATTICE_TYPES)))
def test_the_exact_path_decodes_the_lattice_types_as_the_reference(ggml_type):
    for seed, rows in enumerate([3, 17]):
        raw = _random_bytes(ggml_type, rows, 512, seed)
        with np.errstate(invalid="ignore", over="ignore"):
            want = reference.dequantize_raw(raw, ggml_type, 512)
        got = exact.dequantize_into(raw, ggml_type, np.empty((rows, 512), np.float32))
        np.testing.assert_array_equal(_bits(got), _bits(want))
    w = QTensor("lattice", ggml_type, (24, 512), _sane_lattice(ggml_type, 24, 512))
    weights = reference.dequantize(w)
    assert np.isfinite(weights).all() and 0 < np.abs(weights).max() < 20  # 0.01 x group scale x grid point
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    _assert_close(exact.matvec(w.raw, ggml_type, x, np.empty((3, 24), np.float32)), x, weights)


def _sane_lattice(ggml_type: GGMLType, rows: int, cols: int) -> np.ndarray:
    """Random blocks with a finite, modest scale (f16 0.01) where each type keeps it: gguf cannot quantize these."""
    raw = _random_bytes(ggml_type, rows, cols, 7)
    blocks = raw.reshape(-1, BLOCK_GEOMETRY[ggml_type][1])
    if ggml_type == GGMLType.IQ1_M:  # d is the top nibbles of the four scale words
        d = int(np.float16(0.01).view(np.uint16))
        for i in range(4):  # nibble i of d: the top nibble of scale word i (the high byte's high half)
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4)
    else:
        blocks[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=_ids(KERNEL_TYPES))
def test_cpu_dequantize_matches_reference_on_random_blocks(ggml_type):
    rows, cols = 37, 2 * _cols_for(ggml_type)
    raw = _random_bytes(ggml_type, rows, cols, seed=7)
    out = np.full((rows, cols), 123.0, np.float32)
    exact.dequantize_into(raw, ggml_type, out)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.dequantize_raw(raw, ggml_type, cols)
    np.testing.assert_array_equal(_bits(out), _bits(want))
    ids = np.array([36, 0, 5, 5, 20])
    rows_out = exact.dequantize_rows_into(raw, ggml_type, ids, np.empty((len(ids), cols), np.float32))
    np.testing.assert_array_equal(_bits(rows_out), _bits(want[ids]))


def test_cpu_dequantize_matches_reference_on_fixtures_and_real_tensors(fixture_matrices, real_tensors):
    for t in fixture_matrices + list(real_tensors.values()):
        out = exact.dequantize_into(t.raw, t.ggml_type, np.empty(t.shape, np.float32))
        np.testing.assert_array_equal(_bits(out), _bits(reference.dequantize(t)), err_msg=t.name)


# ---------------------------------------------------------------------------------------------------------
# (iii) fused matvec and backend.matmul (both paths) == reference, to f32 rounding
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=_ids(KERNEL_TYPES))
def test_cpu_matvec_matches_reference(ggml_type):
    t = _sane(ggml_type, 45, 2 * _cols_for(ggml_type), seed=3)
    w = reference.dequantize(t)
    rng = np.random.default_rng(4)
    for T in (1, 3, 8):
        x = rng.standard_normal((T, t.cols)).astype(np.float32)
        out = exact.matvec(t.raw, t.ggml_type, x, np.full((T, t.rows), np.nan, np.float32))
        _assert_close(out, x, w)


def test_cpu_matvec_detects_a_changed_weight():
    # The tolerance is tight enough to see one weight's lowest nibble change (the test above can fail).
    t = _sane(GGMLType.Q4_1, 8, 64, seed=5)
    x = np.ones((1, 64), np.float32)
    out = exact.matvec(t.raw, t.ggml_type, x, np.empty((1, 8), np.float32))
    bumped = t.raw.copy()
    bumped[3, 4] ^= 1  # row 3, first block's first quant byte
    with pytest.raises(AssertionError):
        _assert_close(out, x, reference.dequantize_raw(bumped, t.ggml_type, t.cols))


@pytest.mark.parametrize("name", ["cpu", "reference"])
def test_backend_matmul_matches_reference_on_both_paths(name, fixture_matrices, monkeypatch):
    be = kernels_for(name)
    assert isinstance(be, MatmulKernels) and be.name in ("cpu", "reference")
    rng = np.random.default_rng(6)
    for T in (1, matmul_mod.MATVEC_MAX_T, matmul_mod.MATVEC_MAX_T + 1, 33):
        for t in fixture_matrices:
            x = rng.standard_normal((T, t.cols)).astype(np.float32)
            _assert_close(be.matmul(x, t), x, reference.dequantize(t))
    # A weight bigger than the scratch limit goes through BLAS in row chunks.
    monkeypatch.setattr(matmul_mod, "SCRATCH_MAX_FLOATS", 1000)
    t = max(fixture_matrices, key=lambda t: t.rows)
    x = rng.standard_normal((20, t.cols)).astype(np.float32)
    _assert_close(be.matmul(x[:, :], t), x, reference.dequantize(t))


def test_numba_backend_keeps_one_scratch_buffer(fixture_matrices):
    be = ExactKernels()
    x = np.ones((16, 256), np.float32)
    mats = [t for t in fixture_matrices if t.cols == 256 and t.ggml_type != GGMLType.F32]
    for t in mats:
        be.matmul(x, t)
    largest = max(t.rows * t.cols for t in mats)
    assert be._scratch.size == largest  # reused, never one f32 copy per weight


def test_backend_matmul_takes_strided_input(fixture_matrices):
    t = next(t for t in fixture_matrices if t.ggml_type == GGMLType.Q6_K)
    x = np.random.default_rng(8).standard_normal((t.cols, 4)).astype(np.float32).T  # (4, cols), not contiguous
    _assert_close(kernels_for("cpu").matmul(x, t), x, reference.dequantize(t))


# ---------------------------------------------------------------------------------------------------------
# (iv) real tensors: matvec, both matmul paths, embed
# ---------------------------------------------------------------------------------------------------------


def test_real_tensors_matmul_matches_reference(real_tensors):
    be = kernels_for("cpu")
    rng = np.random.default_rng(9)
    for label, t in real_tensors.items():
        w = reference.dequantize(t)
        for T in (1, 4, 16):
            x = rng.standard_normal((T, t.cols)).astype(np.float32)
            _assert_close(be.matmul(x, t), x, w)


# ---------------------------------------------------------------------------------------------------------
# (iv b) MXFP4: known values, extreme exponents, gpt-oss's expert stacks
# ---------------------------------------------------------------------------------------------------------

# E2M1 code -> value (the OCP MX spec's FP4, not doubled): sign bit 3, exponent bits 1-2, mantissa bit 0.
# Code 8 (-0) decodes to +0 in ggml (its table holds integers); _bits() in the tests below would tell them apart.
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _mxfp4_blocks(exponents) -> np.ndarray:
    """One row per exponent e: 2 blocks with scale byte e whose 32 codes are 0..15, then 15..0 (every code in
    both nibble halves)."""
    codes = np.r_[np.arange(16), np.arange(15, -1, -1)].astype(np.uint8)  # weight j's code
    qs = codes[:16] | (codes[16:] << 4)  # low nibbles = weights 0..15, high = 16..31
    rows = [np.r_[e, qs, e, qs[::-1]].astype(np.uint8) for e in exponents]
    return np.stack(rows)


def test_mxfp4_reference_decodes_known_blocks():
    # Independent of gguf: w = E2M1(code) * 2^(e - 127) (the MX spec's scale), exact in float64.
    exps = [0, 1, 2, 100, 126, 127, 128, 200, 252, 253, 254, 255]
    raw = _mxfp4_blocks(exps)
    codes = np.r_[np.arange(16), np.arange(15, -1, -1)]
    codes = np.r_[codes, np.r_[np.arange(15, -1, -1), np.arange(16)]]  # block 2 has its qs bytes reversed
    for row, e in zip(raw, exps):
        want = np.array([np.ldexp(_E2M1[c], e - 127) for c in codes])
        with np.errstate(over="ignore"):
            want = want.astype(np.float32)  # beyond f32 range (e >= 253 with large codes): inf, as ggml
        with np.errstate(over="ignore"):
            got = reference.dequantize_raw(row[None], GGMLType.MXFP4, 64)[0]
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"e={e}")
    assert reference.dequantize_raw(raw[:1], GGMLType.MXFP4, 64)[0, 1] == 2.0**-128  # e = 0: a subnormal scale
    with np.errstate(over="ignore"):
        top = reference.dequantize_raw(raw[-1:], GGMLType.MXFP4, 64)[0]
    assert top[1] == 2.0**127 and top[2] == np.inf  # e = 255 scales by 2^128 (no NaN); 2^128 overflows


def test_mxfp4_extreme_exponents_match_gguf_and_the_cpu_decoder():
    raw = _mxfp4_blocks([0, 1, 2, 3, 127, 251, 252, 253, 254, 255])
    with np.errstate(over="ignore", invalid="ignore"):
        want = _oracle(raw, GGMLType.MXFP4).reshape(raw.shape[0], 64)
        got = reference.dequantize_raw(raw, GGMLType.MXFP4, 64)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    out = exact.dequantize_into(raw, GGMLType.MXFP4, np.empty((raw.shape[0], 64), np.float32))
    np.testing.assert_array_equal(_bits(out), _bits(want))


@pytest.fixture(scope="module")
def gpt_oss_experts() -> dict[str, QTensor]:
    f = GGUFFile(GPT_OSS_MXFP4)
    stacks = {name[: -len(".weight")]: f.tensor(name) for name, e in f.entries.items() if e.type_id == 39}
    assert len(stacks) == 6  # ffn_gate_exps, ffn_up_exps, ffn_down_exps in each of 2 layers
    return stacks


@needs_kit
def test_mxfp4_expert_stacks_load_and_decode_as_gguf(gpt_oss_experts):
    # Our loader presents a 3-D stack [in, out, n_expert] (GGUF order) as (n_expert * out, in) rows; gguf's own
    # reader and dequantizer must see the same weights there, expert by expert.
    reader = gguf.GGUFReader(GPT_OSS_MXFP4)
    theirs = {t.name[: -len(".weight")]: t for t in reader.tensors}
    for name, t in gpt_oss_experts.items():
        g = theirs[name]
        n_in, n_out, n_expert = (int(n) for n in g.shape)
        assert t.ggml_type == GGMLType.MXFP4 and t.shape == (n_expert * n_out, n_in), name
        want = gguf.quants.dequantize(np.asarray(g.data), gguf.GGMLQuantizationType.MXFP4)  # (n_expert, out, in)
        assert want.shape == (n_expert, n_out, n_in)
        want = want.reshape(t.shape)
        np.testing.assert_array_equal(_bits(reference.dequantize(t)), _bits(want), err_msg=name)
        out = exact.dequantize_into(t.raw, t.ggml_type, np.empty(t.shape, np.float32))
        np.testing.assert_array_equal(_bits(out), _bits(want), err_msg=name)
        assert np.isfinite(want).all() and np.abs(want).max() > 0


@needs_kit
def test_mxfp4_expert_stacks_matmul_matches_reference(gpt_oss_experts):
    rng = np.random.default_rng(10)
    for name, t in gpt_oss_experts.items():
        w = reference.dequantize(t)
        for T in (1, 4, 16):  # the fused matvec, then dequantize + sgemm
            x = rng.standard_normal((T, t.cols)).astype(np.float32)
            _assert_close(kernels_for("cpu").matmul(x, t), x, w)


# ---------------------------------------------------------------------------------------------------------
# (v) embed == reference rows
# ---------------------------------------------------------------------------------------------------------


def test_embed_matches_reference_rows(fixture_matrices, smollm2_gguf, gemma_gguf):
    heads = [t for t in fixture_matrices if t.name == "token_embd.weight"]
    heads += [GGUFFile(smollm2_gguf).tensor("token_embd.weight"), GGUFFile(gemma_gguf).tensor("token_embd.weight")]
    for t in heads:
        ids = np.array([0, 1, t.rows - 1, 17, 17, t.rows // 2])
        want = reference.embed_rows(t, ids)
        assert want.shape == (len(ids), t.cols)
        for be in (kernels_for("cpu"), kernels_for("reference")):
            np.testing.assert_array_equal(_bits(be.embed(t, ids)), _bits(want), err_msg=t.name)
    with pytest.raises(IndexError):
        kernels_for("cpu").embed(heads[0], [heads[0].rows])


def test_get_backend_names():
    assert isinstance(kernels_for(), ExactKernels) and isinstance(kernels_for("reference"), ReferenceKernels)
    with pytest.raises(ValueError, match="unknown backend"):
        kernels_for("tpu")


def test_block_geometry_agrees_with_gguf():
    for t in ALL_TYPES:
        assert BLOCK_GEOMETRY[t] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))], t
