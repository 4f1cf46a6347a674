"""Defects found by trying goinfer as a hostile user would (issue 22), each held by a test that failed before its
fix: a GGUF whose alignment is not a positive integer, and the int8 kernels' memo of prepared weights growing by
one entry per call on freshly sliced head tensors. (The wire formats' parsers are fuzzed in tests/test_fuzz.py,
the REPL's markup in tests/test_cli.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import engine
from engine.errors import ModelLoadError
from engine.kernels.cpu import packed
from engine.kernels.cpu.matmul import Int8Kernels
from engine.kernels.quant_types import GGMLType, QTensor
from testdata import make_fixtures


@pytest.mark.parametrize("alignment", [0, "32"])
def test_a_gguf_whose_alignment_is_not_a_positive_integer_is_a_load_error(tmp_path, alignment):
    path = tmp_path / "bad-alignment.gguf"
    w = make_fixtures._llama_writer(path)
    if isinstance(alignment, str):
        w.add_string("general.alignment", alignment)
    else:
        w.add_uint32("general.alignment", alignment)
    make_fixtures._write(w)
    with pytest.raises(ModelLoadError, match="general.alignment"):
        engine.load_model(path, selftest=False)


def test_the_prepared_weights_memo_does_not_grow_with_fresh_slices_of_one_matrix():
    rng = np.random.default_rng(0)
    head = QTensor("output", GGMLType.Q4_K, (64, 256), make_fixtures.random_weight(rng, 64, 256, GGMLType.Q4_K))
    kernels = Int8Kernels()
    x = rng.standard_normal((10, 256)).astype(np.float32)
    for _ in range(20):  # what the backend does for a vocabulary head over a few rows: new slices each call
        kernels.matmul(x, packed.slice_rows(head, 0, 32))
        kernels.matmul(x, packed.slice_rows(head, 32, 64))
    assert len(kernels._groups) == 2
