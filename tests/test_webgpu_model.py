"""Models resident on WebGPU (`--backend webgpu`), on Mesa's lavapipe: the reference checks of the CPU's default
path (../shared/research/fidelity_noise.md's bars against llama.cpp's `top`) on a subset of the built-in models'
cases and on the kit's dense families, prompt and decode step; the self-test and its fallback to the CPU; the
device cache's fork, rewind and saved-session round trip; a served chat streaming from a resident model.

lavapipe runs WGSL on the CPU far slower than numpy: the cases are the short ones, cut to their first positions."""

from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from engine.models.base import log_softmax
from tests.conftest import SHARED
from tests.fidelity import assert_in_noise_band, assert_mean_kl, vs_llama_cpp
from tests import test_webgpu

pytestmark = test_webgpu.pytestmark  # the same skip: no adapter outside CI

KIT = SHARED / "families"
KIT_FILES = sorted(p for f in ("llama", "qwen2", "qwen3", "phi3", "gemma2") for p in (KIT / f).glob("tiny-*.gguf"))
BUILT_IN_CASES = {"smollm2": ("SmolLM2-135M-Instruct.Q4_1", ("english_a", "code_a")),
                  "gemma": ("gemma-3-270m-q4_k_m", ("chat_a",))}
POSITIONS = 8  # of each built-in case: its prompt's last, then 7 of the continuation

_models: dict = {}


def _resident(path) -> engine.Model:
    if path not in _models:
        _models[path] = engine.load_model(path, backend="webgpu")
        assert _models[path].placement["backend"] == "webgpu", _models[path].placement
    return _models[path]


def _prompt_rows(model, case: dict, n: int) -> np.ndarray:
    ids = case["tokens"] + case["greedy_ids"][: n - 1]
    return model.logprobs(ids, start=len(case["tokens"]) - 1)


def _decoded_rows(model, case: dict, n: int) -> np.ndarray:
    cache = model.new_cache(len(case["tokens"]) + n)
    rows = [model.prefill(case["tokens"], cache)[-1]]
    rows += [model.decode([t], [cache])[0] for t in case["greedy_ids"][: n - 1]]
    return log_softmax(np.stack(rows))


@pytest.mark.parametrize("name", BUILT_IN_CASES)
def test_a_built_in_model_on_webgpu_is_inside_llama_cpps_noise_band(request, name):
    stem, cases = BUILT_IN_CASES[name]
    model = _resident(request.getfixturevalue({"smollm2": "smollm2_gguf", "gemma": "gemma_gguf"}[name]))
    reference = json.loads((SHARED / "reference" / f"{stem}.json").read_text())
    kls = []
    for case in (c for c in reference["cases"] if c["name"] in cases):
        cut = {**case, "positions": case["positions"][:POSITIONS]}
        rows = _prompt_rows(model, case, POSITIONS) if case["name"] != "code_a" else _decoded_rows(model, case, 4)
        cut["positions"] = cut["positions"][: len(rows)]
        mean, worst, misses, case_kls = vs_llama_cpp(rows, cut)
        assert_in_noise_band(mean, worst, misses)
        kls += case_kls
    assert_mean_kl(kls)


@pytest.mark.parametrize("path", KIT_FILES, ids=[p.stem for p in KIT_FILES])
def test_a_kit_dense_family_on_webgpu_is_inside_llama_cpps_noise_band(path):
    reference = json.loads(path.with_suffix(".json").read_text())
    model = _resident(path)
    kls = []
    for case in (c for c in reference["cases"] if c["name"] in ("short", "chat")):
        n = len(case["positions"])
        rows = _prompt_rows(model, case, n) if case["name"] == "chat" else _decoded_rows(model, case, n)
        mean, worst, misses, case_kls = vs_llama_cpp(rows, case)
        assert_in_noise_band(mean, worst, misses)
        kls += case_kls
    assert_mean_kl(kls)
