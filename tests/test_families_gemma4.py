"""Gemma 4 (text) against ../shared/families/gemma4 (its GGUFs and its hf/ directory), as tests/test_families.py
checks the dense families: tokens as llama.cpp's, the exact path within 1e-3 of the f32 oracle, the default path
(prompt, and token by token) inside llama.cpp's noise band; and what the family adds: layers that share keys and values keep none of their own, and
per-layer embeddings and the per-layer output scale move the logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import KIT as FAMILIES, needs_kit
from tests.fidelity import KitReferences, assert_in_noise_band, assert_mean_kl, exact_violations, vs_llama_cpp

pytestmark = needs_kit  # every test here reads the family kit
KIT = FAMILIES / "gemma4"
REFS = sorted(KIT.glob("tiny-*.json"))  # Q8_0, Q4_K_M, hf/
GGUF_REFS = [r for r in REFS if json.loads(r.read_text())["model_file"] != "hf"]
PARAMS = [pytest.param(r, c["name"], id=f"{r.stem}-{c['name']}") for r in REFS
          for c in json.loads(r.read_text())["cases"]]

_kit = KitReferences()
_ref, _model, _case, _rows_of = _kit.ref, _kit.model, _kit.case, _kit.rows


def test_the_kit_is_there():
    assert len(REFS) == 3 and len(GGUF_REFS) == 2, [r.name for r in REFS]


@pytest.mark.parametrize("ref,case_name", PARAMS)
def test_tokens_equal_llama_cpp(ref, case_name):
    case = _case(ref, case_name)  # the kit's tokenizer.json agrees with llama.cpp on every case
    assert _model(ref, "auto").tokenizer.encode(case["prompt"], add_bos=case["add_bos"]) == case["tokens"]


@pytest.mark.parametrize("ref,case_name", PARAMS)
def test_exact_path_matches_the_f32_oracle(ref, case_name):
    bad = exact_violations(_rows_of(ref, "f32", _case(ref, case_name), "prompt"), _case(ref, case_name))
    assert not bad, bad[:5]


@pytest.mark.parametrize("how", ["prompt", "decode"])
@pytest.mark.parametrize("ref,case_name", PARAMS)
def test_default_path_within_llama_cpp_noise(ref, case_name, how):
    case = _case(ref, case_name)
    if how == "decode":
        assert _model(ref, "auto").backend.step is not None  # the compiled step is what runs
    mean, worst, misses, _ = vs_llama_cpp(_rows_of(ref, "auto", case, how), case)
    assert_in_noise_band(mean, worst, misses)


@pytest.mark.parametrize("how", ["prompt", "decode"])
@pytest.mark.parametrize("ref", REFS, ids=[r.stem for r in REFS])
def test_default_path_mean_kl_per_file(ref, how):
    kls = []
    for case in _ref(ref)["cases"]:
        kls += vs_llama_cpp(_rows_of(ref, "auto", case, how), case)[3]
    assert_mean_kl(kls)


def test_the_checkpoint_directory_is_configured_as_its_gguf():
    from dataclasses import replace

    from engine.formats.gguf import GGUFFile
    from engine.models.hf_checkpoint import HFCheckpoint
    from engine.models.registry import config_from_gguf

    converted = config_from_gguf(HFCheckpoint(KIT / "hf", quantize=False).metadata, 2048)
    stored = config_from_gguf(GGUFFile(KIT / "tiny-gemma4-a.Q8_0.gguf").metadata, 2048)
    assert converted.rms_eps == pytest.approx(stored.rms_eps, rel=1e-6)  # the GGUF stores it as f32
    assert replace(converted, rms_eps=0) == replace(stored, rms_eps=0)


def test_shared_layers_keep_no_keys_of_their_own():
    model = _model(GGUF_REFS[0], "auto")
    cfg = model.config
    # 4 layers, the last 2 share: layer 2 (sliding) reads layer 0's keys, layer 3 (global) layer 1's
    assert cfg.layer_kv_source == (0, 1, 0, 1) and cfg.kv_layers == (0, 1)
    assert cfg.layer_head_dim == (64, 128, 64, 128) and cfg.layer_ff == (256, 256, 512, 512)
    cache = model.new_cache(32)
    assert cache.k.shape[0] == 2 and cache.k.shape[3] == 128  # two slots, padded to the widest head


def test_per_layer_embeddings_move_the_logits(monkeypatch):
    from dataclasses import replace

    model = _model(GGUF_REFS[0], "f32")
    ids = _case(GGUF_REFS[0], "short")["tokens"]
    base = model.logprobs(ids, start=len(ids) - 1)[0]
    monkeypatch.setattr(model, "config", replace(model.config, per_layer_embd=0))
    assert np.abs(model.logprobs(ids, start=len(ids) - 1)[0] - base).max() > 0.05  # PLE left out: other logits
