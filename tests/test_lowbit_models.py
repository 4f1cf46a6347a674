"""The low-bit types (Q2_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, and the lattice types IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS,
IQ2_S, IQ1_S, IQ1_M) on whole models: the quant kit's files (the family kit's models quantized by llama.cpp's own
quantizer, the lattice mixes with its importance matrix, each with llama.cpp's log-probabilities on the kit's cases;
testdata/make_quant_kit.py). Real files mix types (Q3_K_M holds Q3_K, Q4_K, Q5_K and Q6_K; a row length that is not
a multiple of 256 falls back to a 32-weight type), so every file is a mixed file.

Per file and case:
- the exact path equals exact f32 math on the same weights: an F32 copy of the file, its tensors decoded by
  gguf.quants (llama.cpp's Python package, independent of our decoders), run by the f32 path the family tests prove
  against transformers; within 1e-3 on the log-probabilities;
- the default path, prompt and decode, agrees with llama.cpp's on the same file inside the noise band the other
  types use (tests/fidelity.py).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

import engine
from engine.kernels.quant_types import LOWBIT_TYPES
from tests.conftest import QUANT_KIT, QUANT_KIT_MISSING
from tests.fidelity import EXACT_MAX_DIFF, assert_in_noise_band, decoded_rows, vs_llama_cpp

HAVE_QUANT_KIT = (QUANT_KIT / "SUMMARY.json").is_file()
pytestmark = pytest.mark.skipif(not HAVE_QUANT_KIT, reason=QUANT_KIT_MISSING)
SUMMARY = json.loads((QUANT_KIT / "SUMMARY.json").read_text())["files"] if HAVE_QUANT_KIT else []
FILES = [f for f in SUMMARY if f.get("top")]
PARAMS = [pytest.param(f["file"], c["name"], id=f"{f['file'][5:-5]}-{c['name']}") for f in FILES
          for c in json.loads((QUANT_KIT / f["top"]).read_text())["cases"]]

_models: dict = {}
_refs: dict = {}


def _ref(file: str) -> dict:
    if file not in _refs:
        _refs[file] = json.loads((QUANT_KIT / file.replace(".gguf", ".json")).read_text())
    return _refs[file]


def _case(file: str, name: str) -> dict:
    return next(c for c in _ref(file)["cases"] if c["name"] == name)


def _model(path, quant: str) -> engine.Model:
    if (path, quant) not in _models:
        _models[path, quant] = engine.load_model(path, quant=quant, selftest=False)
    return _models[path, quant]


def _f32_copy(file: str, tmp_path_factory) -> object:
    """The file with every tensor decoded to F32 by gguf.quants, metadata as it is."""
    out = tmp_path_factory.getbasetemp() / "f32" / file.replace(".gguf", ".f32.gguf")
    if out.exists():
        return out
    out.parent.mkdir(exist_ok=True)
    reader = gguf.GGUFReader(QUANT_KIT / file)
    writer = gguf.GGUFWriter(out, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                                                       dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rows(model: engine.Model, case: dict) -> np.ndarray:
    return model.logprobs(case["tokens"] + case["greedy_ids"][:-1], start=len(case["tokens"]) - 1)


def test_every_low_bit_type_is_in_the_kit():
    seen = {t for f in SUMMARY for t in f["tensor_types"]}
    assert {t.name for t in LOWBIT_TYPES} <= seen, sorted(seen)


@pytest.mark.parametrize("file,case_name", PARAMS)
def test_exact_path_equals_f32_math_on_the_decoded_weights(file, case_name, tmp_path_factory):
    case = _case(file, case_name)
    ours = _rows(_model(QUANT_KIT / file, "f32"), case)
    want = _rows(_model(_f32_copy(file, tmp_path_factory), "f32"), case)
    worst = float(np.abs(ours - want).max())
    assert worst <= EXACT_MAX_DIFF, f"max |logprob diff| {worst:.2e} > {EXACT_MAX_DIFF}"


@pytest.mark.parametrize("how", ["prompt", "decode"])
@pytest.mark.parametrize("file,case_name", PARAMS)
def test_default_path_within_llama_cpp_noise(file, case_name, how):
    case = _case(file, case_name)
    model = _model(QUANT_KIT / file, "auto")
    rows = _rows(model, case) if how == "prompt" else decoded_rows(model, case)
    mean, worst, misses, _ = vs_llama_cpp(rows, case)
    assert_in_noise_band(mean, worst, misses)
