"""The dense hybrids against ../shared/families, as tests/test_families.py checks the dense families: Qwen3.5
(gated DeltaNet layers beside gated attention; the MoE variant, qwen3_5_moe, runs in test_families_moe.py with the
router rule) and LFM2 (gated short convolutions beside attention); and what a recurrent state adds: it lives in
the sequence's cache, survives being decoded one token at a time, and is snapshotted and restored where keys and
values are merely truncated.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import KIT, needs_kit
from tests.fidelity import KitReferences, assert_in_noise_band, assert_mean_kl, exact_violations, vs_llama_cpp

pytestmark = needs_kit  # every test here reads the family kit
FAMILIES = ("qwen3_5", "lfm2")
REFS = sorted(p for f in FAMILIES for p in (KIT / f).glob("tiny-*.json"))  # Q8_0, Q4_K_M, hf/ each
PARAMS = [pytest.param(r, c["name"], id=f"{r.stem}-{c['name']}") for r in REFS
          for c in json.loads(r.read_text())["cases"]]
QWEN35 = KIT / "qwen3_5" / "tiny-qwen3-5-a.Q4_K_M.json"

_kit = KitReferences()
_ref, _model, _case, _rows_of = _kit.ref, _kit.model, _kit.case, _kit.rows


def test_the_kit_is_there():
    assert len(REFS) == 3 * len(FAMILIES), [r.name for r in REFS]


@pytest.mark.parametrize("ref,case_name", PARAMS)
def test_tokens_equal_llama_cpp(ref, case_name):
    case = _case(ref, case_name)  # the kit's tokenizer.json agrees with llama.cpp on every case (tokenizer_check)
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


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "lfm2"])
def test_a_checkpoint_directory_is_configured_as_its_gguf(family):
    from dataclasses import replace

    from engine.formats.gguf import GGUFFile
    from engine.models.hf_checkpoint import HFCheckpoint
    from engine.models.registry import config_from_gguf

    converted = config_from_gguf(HFCheckpoint(KIT / family / "hf", quantize=False).metadata, 2048)
    stored = config_from_gguf(GGUFFile(next((KIT / family).glob("*.Q8_0.gguf"))).metadata, 2048)
    assert converted.layer_recurrent == ((True, True, False, True) if family == "lfm2" else (True, False))
    assert converted.rms_eps == pytest.approx(stored.rms_eps, rel=1e-6)  # the GGUF stores it as f32
    assert replace(converted, rms_eps=0) == replace(stored, rms_eps=0)


def test_the_cache_keeps_keys_for_attention_layers_and_state_for_the_recurrent_ones():
    model = _model(QWEN35, "auto")
    cfg, cache = model.config, model.new_cache(64)
    assert cfg.kv_layers == (1,) and cache.k.shape[0] == 1  # no keys or values for the DeltaNet layer
    assert cache.state["ssm"].shape == (1, 4, 64, 64) and cache.state["conv"].shape == (1, 3, 512)
    model.prefill([5, 6, 7, 8], cache)
    assert np.abs(cache.state["ssm"]).max() > 0 and np.abs(cache.state["conv"]).max() > 0
    lfm2 = _model(KIT / "lfm2" / "tiny-lfm2-a.Q8_0.json", "auto")
    cache = lfm2.new_cache(64)  # three convolution layers of 3 taps over n_embd 256, one attention layer
    assert lfm2.config.kv_layers == (2,) and cache.k.shape[0] == 1 and cache.state["conv"].shape == (3, 2, 256)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_snapshot_brings_a_sequence_back_where_truncation_cannot(family):
    model = _model(next(r for r in REFS if r.parent.name == family), "auto")
    prompt, more = [40, 41, 42, 43, 44, 45], [50, 51, 52]
    cache = model.new_cache(64)
    model.prefill(prompt, cache)
    snap = cache.snapshot()
    first = model.prefill(more, cache)[-1]
    with pytest.raises(ValueError, match="snapshot"):
        cache.truncate(len(prompt))  # the state holds the whole prefix: no going back by positions
    cache.restore(snap)
    assert cache.length == len(prompt)
    np.testing.assert_array_equal(model.prefill(more, cache)[-1], first)  # the same continuation, bit for bit
    cache.truncate(0)  # back to the start: the state is zeroed
    assert cache.length == 0 and not any(np.abs(a).any() for a in cache.state.values())
    fresh = model.new_cache(64)
    np.testing.assert_array_equal(model.prefill(prompt, cache), model.prefill(prompt, fresh))


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_in_pieces_equals_prompt_at_once(family):
    # the convolutions' and the delta rule's state carry across calls exactly as within one
    model = _model(next(r for r in REFS if r.parent.name == family), "f32")
    ids = list(range(30, 70))
    whole = model.logprobs(ids, start=len(ids) - 1)[0]
    cache = model.new_cache(64)
    for piece in (ids[:13], ids[13:14], ids[14:33], ids[33:]):
        last = model.prefill(piece, cache)[-1]
    from engine.models.base import log_softmax

    np.testing.assert_allclose(log_softmax(last[None])[0], whole, atol=2e-5)
