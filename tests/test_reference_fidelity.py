"""The whole model against ../shared/reference: llama.cpp's outputs and the exact f32 oracle.

Thresholds from ../shared/research/fidelity_noise.md: correct code passes them with room; the bugs
tried there (wrong RoPE base/style, missing sliding window, norms off by one...) fail them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from tests.conftest import HAVE_REFERENCE, REFERENCE, needs_reference
from tests.fidelity import (CASE_MEAN_DIFF, EXACT_MAX_DIFF, EXACT_TIE_MARGIN, GREEDY_MARGIN, MODEL_MEAN_KL,
                            POSITION_MAX_DIFF, decoded_rows, vs_llama_cpp)

MODELS = {
    "smollm2": ("smollm2_gguf", REFERENCE / "SmolLM2-135M-Instruct.Q4_1.json"),
    "gemma3": ("gemma_gguf", REFERENCE / "gemma-3-270m-q4_k_m.json"),
}
CASES = {name: json.loads(path.read_text())["cases"] for name, (_, path) in MODELS.items()} if HAVE_REFERENCE else {}
pytestmark = needs_reference  # every test here compares with ../shared/reference
PARAMS = [(m, c["name"]) for m, cases in CASES.items() for c in cases]

_models: dict[tuple[str, str], engine.Model] = {}
_scores: dict[tuple[str, str, str], np.ndarray] = {}


def _model(request, name: str, quant: str) -> engine.Model:
    key = (name, quant)
    if key not in _models:
        _models[key] = engine.load_model(request.getfixturevalue(MODELS[name][0]), quant=quant)
    return _models[key]


def _case(name: str, case_name: str) -> dict:
    return next(c for c in CASES[name] if c["name"] == case_name)


def _teacher_forced(model: engine.Model, name: str, case: dict) -> np.ndarray:
    """logprobs (len(positions), vocab) after each position of tokens + greedy_ids, one forward pass."""
    key = (name, model.backend.path, case["name"])
    if key not in _scores:
        ids = case["tokens"] + case["greedy_ids"][:-1]
        _scores[key] = model.logprobs(ids, start=len(case["tokens"]) - 1)
    return _scores[key]


def _teacher_forced_decode(model: engine.Model, name: str, case: dict) -> np.ndarray:
    """The same rows, but the continuation fed one token at a time: the compiled decode step (int8) on the
    default path, as generation runs it."""
    key = (name, model.backend.path + "-decode", case["name"])
    if key not in _scores:
        _scores[key] = decoded_rows(model, case)
    return _scores[key]


@pytest.mark.parametrize("name,case_name", PARAMS)
def test_prompt_tokens_equal_llama_cpp(request, name, case_name):
    case = _case(name, case_name)
    model = _model(request, name, "auto")
    assert model.tokenizer.encode(case["prompt"], add_bos=case["add_bos"]) == case["tokens"]


@pytest.mark.parametrize("name,case_name", PARAMS)
def test_exact_path_matches_f32_oracle(request, name, case_name):
    case = _case(name, case_name)
    lp = _teacher_forced(_model(request, name, "f32"), name, case)
    for j, pos in enumerate(case["positions"]):
        ids = np.array([i for i, _ in pos["exact_top"]])
        ref = np.array([v for _, v in pos["exact_top"]])
        worst = np.abs(lp[j, ids] - ref).max()
        assert worst <= EXACT_MAX_DIFF, f"position {j}: max |logprob diff| {worst:.2e} > {EXACT_MAX_DIFF}"
        margin = ref[0] - ref[1]
        if margin >= EXACT_TIE_MARGIN:
            assert int(np.argmax(lp[j])) == ids[0], f"position {j}: top-1 differs from the oracle (margin {margin:.4f})"


@pytest.mark.parametrize("name,case_name", PARAMS)
def test_default_path_within_llama_cpp_noise(request, name, case_name):
    case = _case(name, case_name)
    lp = _teacher_forced(_model(request, name, "auto"), name, case)
    mean, worst, misses, _ = vs_llama_cpp(lp, case)
    assert mean <= CASE_MEAN_DIFF, f"mean |logprob diff| {mean:.3f} > {CASE_MEAN_DIFF}"
    assert worst <= POSITION_MAX_DIFF, f"max |logprob diff| {worst:.3f} > {POSITION_MAX_DIFF}"
    assert not misses, f"top-1 differs from llama.cpp at confident positions {misses}"


@pytest.mark.parametrize("name,case_name", PARAMS)
def test_decode_step_within_llama_cpp_noise(request, name, case_name):
    case = _case(name, case_name)
    model = _model(request, name, "auto")
    assert model.backend.step is not None  # the fast path is what runs here
    mean, worst, misses, _ = vs_llama_cpp(_teacher_forced_decode(model, name, case), case)
    assert mean <= CASE_MEAN_DIFF, f"mean |logprob diff| {mean:.3f} > {CASE_MEAN_DIFF}"
    assert worst <= POSITION_MAX_DIFF, f"max |logprob diff| {worst:.3f} > {POSITION_MAX_DIFF}"
    assert not misses, f"top-1 differs from llama.cpp at confident positions {misses}"


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("how", ["prompt", "decode"])
def test_default_path_mean_kl_per_model(request, name, how):
    model = _model(request, name, "auto")
    scores = _teacher_forced if how == "prompt" else _teacher_forced_decode
    kls = []
    for case in CASES[name]:
        kls += vs_llama_cpp(scores(model, name, case), case)[3]
    assert np.mean(kls) <= MODEL_MEAN_KL, f"mean KL(llama.cpp || ours) {np.mean(kls):.4f} > {MODEL_MEAN_KL}"


@pytest.mark.parametrize("name,case_name", PARAMS)
def test_greedy_generation_follows_llama_cpp(request, name, case_name):
    case = _case(name, case_name)
    model = _model(request, name, "auto")
    want = case["greedy_ids"]
    # Compare up to the first near-tie: there either token is a correct greedy choice, so there we
    # only ask for one of llama.cpp's top three.
    upto = next((j for j, pos in enumerate(case["positions"]) if pos["margin"] < GREEDY_MARGIN), len(want))
    n = min(upto + 1, len(want))
    events = list(engine.generate(model, case["tokens"], max_tokens=n, temperature=0.0, top_logprobs=2))
    got = [ev.token for ev in events]
    # A near-tie of ours counts too: 8-bit activations move a logprob by up to about 1 (research/fidelity_noise.md),
    # and where llama.cpp was sure by 0.53 the decode path on a Zen 4 had the two at -0.63 / -0.77 (exact f32 math:
    # llama.cpp's order). Where we part from llama.cpp, its token must be our second, within GREEDY_MARGIN of our
    # first; the two runs then go their own ways. A wrong kernel parts confidently and fails here.
    parted = next((j for j in range(min(upto, len(got))) if got[j] != want[j]), None)
    if parted is not None:
        (_, first), (second_id, second) = events[parted].top_logprobs
        assert second_id == want[parted] and first - second < GREEDY_MARGIN, \
            f"position {parted}: ours {got[parted]} ({first:.3f}) over llama.cpp's {want[parted]} ({second:.3f})"
    elif upto < len(want):
        assert got[upto] in [i for i, _ in case["positions"][upto]["top"][:3]]
