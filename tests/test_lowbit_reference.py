"""The low-bit types (Q2_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0): reference.py against gguf.quants bit for bit, on
random blocks and on whole tensors of files llama.cpp quantized (the quant kit); and the loader refusing a type no
kernel computes with, in one line. (The lattice types: tests/test_quant_kernels.py, test_lattice_int8.py.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import engine
from engine.errors import UnsupportedModel
from engine.kernels import reference
from engine.kernels.quant_types import BLOCK_GEOMETRY, LATTICE_TYPES, STEP_TYPES, GGMLType, row_bytes
from tests.conftest import QUANT_KIT, QUANT_KIT_MISSING
from testdata import make_fixtures

LOWBIT = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.TQ1_0, GGMLType.TQ2_0]
KIT_TYPES = LOWBIT + sorted(LATTICE_TYPES)  # every type the quant kit's files hold tensors of (its real-tensor tests)
# Byte offsets of each block's f16 fields (d, and Q2_K's dmin), from the layouts in reference.py.
F16_FIELDS = {GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
              GGMLType.TQ1_0: (52,), GGMLType.TQ2_0: (64,)}


def _ids(types):
    return [t.name for t in types]


def _oracle(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t)))


def _random_blocks(t: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes whose f16 scales are finite (both signs, a few zeros and subnormals), so results hold no NaN
    and bit equality is plain equality."""
    rng = np.random.default_rng(seed)
    block, size = BLOCK_GEOMETRY[t]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        d = rng.uniform(-0.2, 0.2, raw.shape[:2]).astype(np.float16)
        d[rng.random(d.shape) < 0.05] = 0
        d[rng.random(d.shape) < 0.05] = np.float16(3e-6)  # f16 subnormal
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return raw.reshape(rows, -1)


def _assert_bit_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    assert np.isfinite(got).all(), what
    bad = np.argwhere(got.view(np.uint32) != np.ascontiguousarray(want, np.float32).view(np.uint32))
    assert len(bad) == 0, f"{what}: {len(bad)} weights differ, first at {bad[0]}: {got[tuple(bad[0])]} vs " \
                          f"{want[tuple(bad[0])]}"


def test_the_lowbit_types_have_gguf_geometry_and_stay_out_of_the_decode_step():
    for t in LOWBIT:
        assert BLOCK_GEOMETRY[t] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))], t
        assert t not in STEP_TYPES


@pytest.mark.parametrize("t", LOWBIT, ids=_ids(LOWBIT))
def test_reference_matches_gguf_on_random_blocks(t):
    block = BLOCK_GEOMETRY[t][0]
    for seed, (rows, blocks) in enumerate([(1, 1), (7, 3), (33, 2)]):
        cols = blocks * block
        raw = _random_blocks(t, rows, cols, seed)
        got = reference.dequantize_raw(raw, t, cols)
        _assert_bit_equal(got, _oracle(raw, t).reshape(rows, cols), f"{t.name} seed {seed}")
        np.testing.assert_array_equal(reference.dequantize_raw(raw[rows // 2:], t, cols), got[rows // 2:])


@pytest.mark.parametrize("t", [GGMLType.TQ1_0, GGMLType.TQ2_0], ids=["TQ1_0", "TQ2_0"])
def test_ternary_round_trip(t):
    # Independent of gguf's decoder: ternary weights times a power of two are stored exactly by the quantizer.
    w = np.random.default_rng(3).integers(-1, 2, (4, 512)).astype(np.float32) * np.float32(0.25)
    w[:, 0] = 0.25  # every block's largest magnitude is the scale
    w[:, 256] = -0.25
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(t)))
    np.testing.assert_array_equal(reference.dequantize_raw(raw, t, 512), w)


def test_q3_k_subtracts_four_where_the_high_bit_is_clear():
    # One hand-made block: d = 1, every scale 32 + 1 (so each group's factor is 1), low bits 3 everywhere; hmask
    # bit k set for weights 0..31 of chunk k where k is even. ggml reads q = 3 there, 3 - 4 = -1 elsewhere.
    b = np.zeros((1, 110), np.uint8)
    b[0, 0:32] = 0b01010101
    b[0, 32:96] = 0xFF
    b[0, 96:104] = 0x11  # low nibbles of scales (groups 0-7, 8-15): 1
    b[0, 104:108] = 0b10101010  # top 2 bits of every scale: 2, so 6-bit scale 33
    b[0, 108:110] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    want = np.where((np.arange(256) // 32) % 2 == 0, 3.0, -1.0)
    np.testing.assert_array_equal(reference.dequantize_raw(b, GGMLType.Q3_K, 256)[0], want)


@pytest.mark.parametrize("t", LOWBIT, ids=_ids(LOWBIT))
def test_a_wrong_row_size_is_refused(t):
    block = BLOCK_GEOMETRY[t][0]
    good = row_bytes(t, 2 * block)
    for raw in (np.zeros((3, good + 1), np.uint8), np.zeros((3, good - 2), np.uint8),
                np.zeros((3, good), np.int8), np.zeros((3, good // 2, 2), np.uint8)):
        with pytest.raises(ValueError, match=t.name):
            reference.dequantize_raw(raw, t, 2 * block)


@pytest.mark.parametrize("name", ["Q8_1", "NVFP4", "Q1_0"])
def test_the_loader_refuses_a_type_without_kernels_in_one_line(tmp_path, name):
    path = make_fixtures.write_unsupported_type_fixture(tmp_path / f"{name}.gguf", name)
    with pytest.raises(UnsupportedModel) as err:
        engine.load_model(path)
    message = str(err.value)
    assert "\n" not in message
    assert f"tensor 'blk.0.ffn_down.weight' has type {name}, which goinfer does not support" in message


# ---------------------------------------------------------------------------------------------------------
# Whole tensors of real files: testdata/make_quant_kit.py's llama.cpp quantizations of the family kit
# ---------------------------------------------------------------------------------------------------------


def _kit_files() -> list:
    if not QUANT_KIT.is_dir() or not any(QUANT_KIT.glob("*.gguf")):
        pytest.skip(QUANT_KIT_MISSING)
    return sorted(QUANT_KIT.glob("*.gguf"))


def test_reference_matches_gguf_on_real_tensors():
    seen: dict[str, int] = {}
    for path in _kit_files():
        for tensor in gguf.GGUFReader(path).tensors:
            if int(tensor.tensor_type) not in {int(t) for t in KIT_TYPES}:
                continue
            t = GGMLType(int(tensor.tensor_type))
            cols = int(tensor.shape[0])  # GGUF lists the row length first
            raw = np.asarray(tensor.data).reshape(-1, row_bytes(t, cols))
            got = reference.dequantize_raw(raw, t, cols)
            _assert_bit_equal(got, _oracle(raw, t).reshape(got.shape), f"{path.name}: {tensor.name} ({t.name})")
            seen[t.name] = seen.get(t.name, 0) + 1
    assert set(seen) == {t.name for t in KIT_TYPES}, f"the kit holds tensors of {seen} only"


def test_ternary_files_decode_to_the_same_weights():
    # llama.cpp quantizes TQ1_0 and TQ2_0 alike (d = max |w|, q = round(w / d)) and only packs the digits
    # differently, so the two files of a family hold the same weights: our two decoders agree, gguf aside.
    pairs = 0
    for tq1 in _kit_files():
        if not tq1.name.endswith(".TQ1_0.gguf"):
            continue
        tq2 = {t.name: t for t in gguf.GGUFReader(tq1.with_name(tq1.name.replace("TQ1_0", "TQ2_0"))).tensors}
        for t1 in gguf.GGUFReader(tq1).tensors:
            if t1.tensor_type != gguf.GGMLQuantizationType.TQ1_0:
                continue
            t2, cols = tq2[t1.name], int(t1.shape[0])
            assert t2.tensor_type == gguf.GGMLQuantizationType.TQ2_0, t1.name
            w1 = reference.dequantize_raw(np.asarray(t1.data).reshape(-1, row_bytes(GGMLType.TQ1_0, cols)),
                                          GGMLType.TQ1_0, cols)
            w2 = reference.dequantize_raw(np.asarray(t2.data).reshape(-1, row_bytes(GGMLType.TQ2_0, cols)),
                                          GGMLType.TQ2_0, cols)
            np.testing.assert_array_equal(w1, w2, err_msg=f"{tq1.name}: {t1.name}")
            pairs += 1
    assert pairs > 0
