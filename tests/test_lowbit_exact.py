"""The exact path's compiled decoders of the low-bit types (dequant_lowbit.py, through exact.py): bit for bit
reference.py's weights, matvec to f32 rounding, on random blocks and on the quant kit's real tensors; the base types
unchanged; each type's closure compiles its own decoder only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engine.formats.gguf import GGUFFile
from engine.kernels import reference
from engine.kernels.cpu import dequant_lowbit, exact
from engine.kernels.quant_types import BLOCK_GEOMETRY, GGMLType, row_bytes
from tests.conftest import QUANT_KIT, QUANT_KIT_MISSING, ROOT
from tests.test_lowbit_reference import KIT_TYPES, LOWBIT, _assert_bit_equal, _ids, _random_blocks
from tests.test_quant_kernels import _assert_close, _bits


def _cols(t: GGMLType) -> int:
    return 3 * BLOCK_GEOMETRY[t][0]  # an odd number of blocks per row


def _check_decoders(raw: np.ndarray, t: GGMLType, cols: int, what: str, parallel=(True, False)) -> np.ndarray:
    """exact's three decode entry points against the reference; returns the reference weights."""
    want = reference.dequantize_raw(raw, t, cols)
    for parallel in parallel:
        out = np.full((raw.shape[0], cols), np.nan, np.float32)
        _assert_bit_equal(exact.dequantize_into(raw, t, out, parallel=parallel), want, f"{what} parallel={parallel}")
    ids = np.array([raw.shape[0] - 1, 0, raw.shape[0] // 2, 0])
    got = exact.dequantize_rows_into(raw, t, ids, np.full((len(ids), cols), np.nan, np.float32))
    _assert_bit_equal(got, want[ids], f"{what} rows {ids}")
    return want


@pytest.mark.parametrize("t", LOWBIT, ids=_ids(LOWBIT))
def test_exact_dequantize_matches_reference_on_random_blocks(t):
    for seed, rows in enumerate((1, 7, 37)):
        _check_decoders(_random_blocks(t, rows, _cols(t), seed), t, _cols(t), f"{t.name} {rows} rows")


@pytest.mark.parametrize("t", LOWBIT, ids=_ids(LOWBIT))
def test_exact_dequantize_matches_reference_on_any_bytes(t):
    # Entirely random blocks: scales include subnormals, infinities and NaNs (compared as bit patterns, NaNs as one).
    raw = np.random.default_rng(11).integers(0, 256, (23, row_bytes(t, _cols(t))), dtype=np.uint8)
    out = exact.dequantize_into(raw, t, np.empty((23, _cols(t)), np.float32))
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.dequantize_raw(raw, t, _cols(t))
    np.testing.assert_array_equal(_bits(out), _bits(want))


@pytest.mark.parametrize("t", LOWBIT, ids=_ids(LOWBIT))
def test_exact_matvec_matches_reference(t):
    raw = _random_blocks(t, 45, _cols(t), seed=3)
    w = reference.dequantize_raw(raw, t, _cols(t))
    rng = np.random.default_rng(4)
    for T in (1, 3, 8):
        x = rng.standard_normal((T, _cols(t))).astype(np.float32)
        _assert_close(exact.matvec(raw, t, x, np.full((T, 45), np.nan, np.float32)), x, w)


def test_a_base_type_goes_through_unchanged():
    # Q4_K takes the inlined base dispatch (dequant.dequant_row): still the reference, bit for bit.
    t = GGMLType.Q4_K
    raw = np.random.default_rng(5).integers(0, 256, (9, row_bytes(t, 512)), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.dequantize_raw(raw, t, 512)
    np.testing.assert_array_equal(_bits(exact.dequantize_into(raw, t, np.empty((9, 512), np.float32))), _bits(want))
    out = np.empty(512, np.float32)  # and the dispatch called from Python, row by row
    dequant_lowbit.dequant_any_row(raw[4], int(t), out)
    np.testing.assert_array_equal(_bits(out), _bits(want[4]))


def test_each_closure_compiles_its_own_decoder_only(tmp_path):
    # A fresh process and an empty kernel cache (a cached kernel would load without typing its callees): the row
    # decoders numba compiled are exactly those of the types decoded.
    code = textwrap.dedent("""
        import json
        import numpy as np
        from engine.kernels.cpu import dequant, dequant_lattice, dequant_lowbit, exact
        from engine.kernels.quant_types import GGMLType, row_bytes

        def compiled():
            return sorted(n for m in (dequant, dequant_lowbit, dequant_lattice) for n in dir(m)
                          if n.startswith("_row_") and getattr(m, n).signatures)

        seen = []
        for t in (GGMLType.Q4_K, GGMLType.Q2_K, GGMLType.IQ1_M):
            raw = np.zeros((3, row_bytes(t, 256)), np.uint8)
            exact.dequantize_into(raw, t, np.empty((3, 256), np.float32))
            exact.matvec(raw, t, np.zeros((1, 256), np.float32), np.empty((1, 3), np.float32))
            seen.append(compiled())
        print(json.dumps(seen))
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "empty"), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["_row_q4_k"], ["_row_q2_k", "_row_q4_k"],
                                      ["_row_iq1_m", "_row_q2_k", "_row_q4_k"]]


# ---------------------------------------------------------------------------------------------------------
# Whole tensors of real files: testdata/make_quant_kit.py's llama.cpp quantizations of the family kit
# ---------------------------------------------------------------------------------------------------------


def test_exact_matches_reference_on_real_tensors():
    # Every low-bit tensor of the kit (~1,200) decoded on the calling thread; the parallel drivers (matvec, dequantize)
    # on the first two of each file and type, since a parallel launch costs milliseconds on a small machine.
    if not QUANT_KIT.is_dir() or not any(QUANT_KIT.glob("*.gguf")):
        pytest.skip(QUANT_KIT_MISSING)
    seen: dict[str, int] = {}
    rng = np.random.default_rng(6)
    for path in sorted(QUANT_KIT.glob("*.gguf")):
        f, in_file = GGUFFile(path), {}
        for name, e in f.entries.items():  # (the directory: raw blocks, as stored)
            if e.type_id not in {int(t) for t in KIT_TYPES}:
                continue
            t, cols = GGMLType(e.type_id), e.shape[-1]
            raw = f.data[e.offset:e.offset + e.nbytes].reshape(-1, row_bytes(t, cols))
            in_file[t] = in_file.get(t, 0) + 1
            few = in_file[t] <= 2
            w = _check_decoders(raw, t, cols, f"{path.name}: {name} ({t.name})",
                                parallel=(True, False) if few else (False,))
            if few:
                x = rng.standard_normal((3, cols)).astype(np.float32)
                _assert_close(exact.matvec(raw, t, x, np.empty((3, raw.shape[0]), np.float32)), x, w)
            seen[t.name] = seen.get(t.name, 0) + 1
    assert set(seen) == {t.name for t in KIT_TYPES}, f"the kit holds tensors of {seen} only"
