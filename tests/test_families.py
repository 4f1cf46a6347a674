"""Each dense family against ../shared/families: tiny random-weight models of the family (GGUF files made by
llama.cpp's converter, and the Hugging Face safetensors directory they were made from), with llama.cpp's logits
(`top`) and exact f32 logits on each file's own weights (`exact_top`). Tolerances from the kit's README (the same
as ../shared/reference's): the exact path within 1e-3 of the oracle; the default path, prompt and decode step,
inside llama.cpp's noise band; tokens as llama.cpp's on a GGUF, as tokenizer.json's on the directory.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import engine
from tests.conftest import KIT, needs_kit
from tests.fidelity import KitReferences, assert_in_noise_band, assert_mean_kl, decoded_rows, exact_violations, \
    vs_llama_cpp

pytestmark = needs_kit  # every test here reads the family kit
FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma2")  # the dense families the engine loads from GGUF
REFS = sorted(p for f in FAMILIES for p in (KIT / f).glob("tiny-*.json"))  # per family: Q8_0, Q4_K_M, hf/
PARAMS = [pytest.param(r, c["name"], id=f"{r.stem}-{c['name']}") for r in REFS
          for c in json.loads(r.read_text())["cases"]]

_kit = KitReferences()
_ref, _model, _case, _rows_of = _kit.ref, _kit.model, _kit.case, _kit.rows


def test_the_kit_is_there():
    assert len(REFS) == 3 * len(FAMILIES), [r.name for r in REFS]  # Q8_0, Q4_K_M and hf/ per family


@pytest.mark.parametrize("ref,case_name", PARAMS)
def test_tokens_equal_llama_cpp_or_tokenizer_json(ref, case_name):
    case = _case(ref, case_name)
    ours = _model(ref, "auto").tokenizer.encode(case["prompt"], add_bos=case["add_bos"])
    if _ref(ref)["model_file"] != "hf":
        assert ours == case["tokens"]
        return
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(ref.parent / "hf" / "tokenizer.json"))
    bos = [_ref(ref)["bos_id"]] if case["add_bos"] else []
    assert ours == bos + hf.encode(case["prompt"], add_special_tokens=False).ids
    if case["name"] != "chat":  # phi3's and gemma2's tokenizer.json split text after a special token otherwise
        assert ours == case["tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_directory_is_configured_as_its_gguf(family):
    # models/hf_config.py + the family's hf_keys make of config.json what llama.cpp's converter wrote
    from dataclasses import replace

    from engine.formats.gguf import GGUFFile
    from engine.models.hf_checkpoint import HFCheckpoint
    from engine.models.registry import config_from_gguf

    converted = config_from_gguf(HFCheckpoint(KIT / family / "hf", quantize=False).metadata, 2048)
    stored = config_from_gguf(GGUFFile(KIT / family / f"tiny-{family}-a.Q8_0.gguf").metadata, 2048)
    for f32_field in ("rms_eps", "rope_attn_factor"):  # the GGUF stores them as f32
        assert getattr(converted, f32_field) == pytest.approx(getattr(stored, f32_field), rel=1e-6)
    assert replace(converted, rms_eps=0, rope_attn_factor=0) == replace(stored, rms_eps=0, rope_attn_factor=0)


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


def test_check_hardware_lists_every_family_that_loads():
    from engine.loading.hardware import supported_models

    listed = {a["architecture"]: a for a in supported_models()["architectures"]}
    assert set(FAMILIES) | {"gemma3"} <= set(listed)
    assert all(listed[f]["decode_step"] for f in FAMILIES)
    assert all("safetensors" in listed[f]["formats"] for f in FAMILIES)  # each proven on its hf/ directory
    assert "safetensors" in listed["gemma3"]["formats"]  # proven on a transformers-made variant (docs/models.md)


def test_only_a_phi3_model_drops_the_whitespace_after_its_special_tokens():
    # llama.cpp decides by general.name (llama-vocab.cpp): "<|user|>\nhi" loses its newline in a Phi-3 model
    # (and SentencePiece then prefixes the word with a space), keeps it in any other.
    from engine.formats.gguf import GGUFFile
    from engine.tokenizer import Tokenizer

    meta = dict(GGUFFile(KIT / "phi3" / "tiny-phi3-a.Q8_0.gguf").metadata)
    phi3 = Tokenizer.from_gguf_metadata(meta)
    other = Tokenizer.from_gguf_metadata({**meta, "general.name": "tiny-llama-like"})
    newline = other.token_to_id("<0x0A>")
    assert newline in other.encode("<|user|>\nhi", add_bos=False)
    assert newline not in phi3.encode("<|user|>\nhi", add_bos=False)
    assert phi3.encode("<s>\nhi", add_bos=False) == other.encode("<s>\nhi", add_bos=False)  # <s> is exempt


def test_phi3_past_its_original_window_switches_to_the_long_rope_factors():
    # As llama.cpp: the context asked for at load picks LongRoPE's factors for the whole model (short up to
    # original_context_length, long past it, up to the trained length); the compiled step follows the prompt.
    path = KIT / "phi3" / "tiny-phi3-a.Q8_0.gguf"
    default = engine.load_model(path, selftest=False)
    long = engine.load_model(path, selftest=False, context=10_000)
    assert (default.context_length, default.config.rope_factors) == (4096, "rope_factors_short")
    assert (long.context_length, long.config.rope_factors) == (10_000, "rope_factors_long")
    assert engine.load_model(path, selftest=False, context=1 << 30).context_length == 131072  # the trained length
    case = _case(KIT / "phi3" / "tiny-phi3-a.Q8_0.json", "medium")
    ids = case["tokens"] + case["greedy_ids"][:-1]
    short_rows = default.logprobs(ids, start=len(case["tokens"]) - 1)
    long_rows = long.logprobs(ids, start=len(case["tokens"]) - 1)
    assert np.abs(long_rows - short_rows).mean() > 1.0  # other frequencies, other logits (measured: 2.8)
    # the decode step agrees with the prompt as closely as with the short factors (int8 noise; 0.05 measured)
    assert np.abs(decoded_rows(long, case) - long_rows).mean() < 0.15
