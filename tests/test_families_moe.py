"""The MoE families against ../shared/families (as tests/test_families.py for the dense ones: each GGUF and the
hf/ safetensors directory, its experts stacked at load), with the kit's rule
for routing-fragile positions: where the exact model's k-th and (k+1)-th router logits are within `router_gap`
< 0.25, llama.cpp's rounding may pick another expert, so those positions leave the default path's per-position
max, top-1 and KL checks (they still count in the case means); the exact path leaves out router_gap < 0.01.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import KIT, needs_kit
from tests.fidelity import KitReferences, assert_in_noise_band, assert_mean_kl, exact_violations, vs_llama_cpp

pytestmark = needs_kit  # every test here reads the family kit
FAMILIES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss")  # kit directories of the MoE families the engine loads
REFS = sorted(p for f in FAMILIES for p in (KIT / f).glob("tiny-*.json"))  # Q8_0, Q4_K_M (gpt-oss: MXFP4_MOE), hf/
PARAMS = [pytest.param(r, c["name"], id=f"{r.stem}-{c['name']}") for r in REFS
          for c in json.loads(r.read_text())["cases"]]
FRAGILE, EXACT_FRAGILE = 0.25, 0.01

_kit = KitReferences()
_ref, _model, _case, _rows_of = _kit.ref, _kit.model, _kit.case, _kit.rows


def _robust(lp: np.ndarray, case: dict, gap: float) -> tuple[np.ndarray, dict]:
    """The rows and positions whose routing is not fragile at `gap`."""
    keep = [j for j, p in enumerate(case["positions"]) if p["router_gap"] >= gap]
    return lp[keep], {**case, "positions": [case["positions"][j] for j in keep]}


def test_the_kit_is_there():
    assert len(REFS) == 3 * len(FAMILIES), [r.name for r in REFS]


@pytest.mark.parametrize("ref,case_name", PARAMS)
def test_tokens_equal_llama_cpp(ref, case_name):
    case = _case(ref, case_name)
    # the kit's byte-level tokenizer.json agrees with llama.cpp on every case, so one check serves GGUF and hf/
    assert _model(ref, "auto").tokenizer.encode(case["prompt"], add_bos=case["add_bos"]) == case["tokens"]


@pytest.mark.parametrize("ref,case_name", PARAMS)
def test_exact_path_matches_the_f32_oracle(ref, case_name):
    case = _case(ref, case_name)
    bad = exact_violations(*_robust(_rows_of(ref, "f32", case, "prompt"), case, EXACT_FRAGILE))
    assert not bad, bad[:5]


@pytest.mark.parametrize("how", ["prompt", "decode"])
@pytest.mark.parametrize("ref,case_name", PARAMS)
def test_default_path_within_llama_cpp_noise(ref, case_name, how):
    case = _case(ref, case_name)
    rows = _rows_of(ref, "auto", case, how)
    mean = vs_llama_cpp(rows, case)[0]  # every position counts in the case mean
    _, worst, misses, _ = vs_llama_cpp(*_robust(rows, case, FRAGILE))
    assert_in_noise_band(mean, worst, misses)


@pytest.mark.parametrize("how", ["prompt", "decode"])
@pytest.mark.parametrize("ref", REFS, ids=[r.stem for r in REFS])
def test_default_path_mean_kl_per_file(ref, how):
    kls = []
    for case in _ref(ref)["cases"]:
        kls += vs_llama_cpp(*_robust(_rows_of(ref, "auto", case, how), case, FRAGILE))[3]
    assert_mean_kl(kls)


def test_the_router_takes_the_top_k_renormalized():
    from engine.models.moe import route

    logits = np.array([[0.0, 2.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]], np.float32)
    chosen, weight = route(logits, 2)
    assert chosen.tolist() == [[1, 3], [0, 2]]  # a tie goes to the lower id
    np.testing.assert_allclose(weight, [[0.5, 0.5], [1 / (1 + np.exp(-1)), 1 - 1 / (1 + np.exp(-1))]], rtol=1e-6)


@pytest.mark.parametrize("path", ["exact", "fast"])
def test_a_token_through_the_forward_pass_reads_only_its_experts(monkeypatch, path):
    # the prompt path's grouping: one token, k experts per layer (the compiled step addresses the chosen
    # experts' rows itself: moe_step.py; tests/test_decode_step.py holds it to this pass). The exact path reads
    # expert by expert; the fast one groups a tile's tokens by expert in one call per stacked tensor.
    model = _model(REFS[0], "f32" if path == "exact" else "auto")
    read = []
    real, grouped = model.weights.expert, model.backend.expert_matmul
    monkeypatch.setattr(model.weights, "expert", lambda name, e, n: read.append((name, int(e))) or real(name, e, n))

    def grouped_reading(x, experts, starts, stacks, n):
        got = grouped(x, experts, starts, stacks, n)
        if got is not None:  # (None: the exact path, which goes expert by expert)
            read.extend((s.name, e) for s in stacks for e in experts.tolist())
        return got

    monkeypatch.setattr(model.backend, "expert_matmul", grouped_reading)
    monkeypatch.setattr(model.backend, "step", None)
    cache = model.new_cache(16)
    model.prefill([5, 6, 7], cache)
    read.clear()
    model.decode([8], [cache])
    cfg = model.config
    assert len(read) == 3 * cfg.n_expert_used * cfg.n_layer  # gate, up and down of k experts per layer
    assert len({e for _, e in read}) > cfg.n_expert_used  # (layers choose their own)


@pytest.mark.parametrize("family,shape", [("qwen3_moe", (8, 2, 128)), ("gpt_oss", (8, 2, 128))])
def test_the_checkpoint_directory_is_configured_as_its_gguf(family, shape):
    from dataclasses import replace

    from engine.formats.gguf import GGUFFile
    from engine.models.hf_checkpoint import HFCheckpoint
    from engine.models.registry import config_from_gguf

    converted = config_from_gguf(HFCheckpoint(KIT / family / "hf", quantize=False).metadata, 2048)
    stored = config_from_gguf(GGUFFile(next((KIT / family).glob("*.Q8_0.gguf"))).metadata, 2048)
    assert (converted.n_expert, converted.n_expert_used, converted.n_ff_expert) == shape
    assert converted.rms_eps == pytest.approx(stored.rms_eps, rel=1e-6)  # the GGUF stores it as f32
    assert replace(converted, rms_eps=0) == replace(stored, rms_eps=0)


def test_gpt_oss_layers_alternate_windows_and_use_yarn():
    model = _model(KIT / "gpt_oss" / "tiny-gpt-oss-a.Q8_0.json", "auto")
    cfg = model.config
    assert cfg.layer_window == (32, 0)  # sliding on even layers, as llama.cpp's pattern of 2
    assert cfg.rope_attn_factor == pytest.approx(0.1 * np.log(32) + 1)  # YaRN's attention factor for factor 32
    d = np.array(cfg.rope_divisors)
    assert d[0] == 1.0 and d[-1] == pytest.approx(32.0) and np.all(np.diff(d) >= 0)  # fast pairs kept, slow / 32


def test_the_clamped_swiglu_saturates_as_gpt_oss():
    from engine.models.moe import clamped_swiglu

    gate = np.array([[-3.0, 0.0, 2.0, 50.0]], np.float32)
    up = np.array([[1.0, 5.0, -20.0, 20.0]], np.float32)
    g = np.minimum(gate, 7.0).astype(np.float64)
    want = (np.clip(up, -7, 7) + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(clamped_swiglu(gate, up), want, rtol=1e-6)
