"""Safetensors checkpoints: the reader (formats/safetensors.py) against files the `safetensors` package writes,
and the refusals a broken or unsupported checkpoint directory gets (one clear error, never a traceback)."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import engine
from engine.errors import ModelLoadError, UnsupportedModel
from engine.formats.safetensors import SafetensorsCheckpoint, to_f32
from goinfer_cli.app import app
from tests.conftest import KIT, in_kit, needs_kit

QWEN2 = KIT / "qwen2" / "hf"


def _write_raw(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file written by hand (numpy has no bfloat16 for the package to write)."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_f32_f16_and_bf16_tensors_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float16)
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    values = rng.standard_normal(6).astype(np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated: exactly representable in bf16
    _write_raw(tmp_path / "extra.safetensors", {"c": ("BF16", [2, 3], bf16.tobytes())})
    ck = SafetensorsCheckpoint(tmp_path)
    assert sorted(ck.names) == ["a", "b", "c"]
    assert np.array_equal(to_f32(ck.array("a"), ck.dtype("a")), a)
    assert np.array_equal(to_f32(ck.array("b"), ck.dtype("b")), b.astype(np.float32))
    c = to_f32(ck.array("c"), "BF16")
    assert c.shape == (2, 3) and np.array_equal(c.reshape(-1), (bf16.astype(np.uint32) << 16).view(np.float32))


def test_shards_come_from_the_index(tmp_path):
    save_file({"x": np.ones(4, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"y": np.zeros(2, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"stray": np.zeros(1, np.float32)}, str(tmp_path / "unrelated.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}))
    assert sorted(SafetensorsCheckpoint(tmp_path).names) == ["x", "y"]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing: model-00002-of-00002"):
        SafetensorsCheckpoint(tmp_path)


@pytest.mark.parametrize("damage,message", [
    (lambda raw: raw[:-10], "truncated"),
    (lambda raw: struct.pack("<Q", 1 << 40) + raw[8:], "header length"),
    (lambda raw: raw[:8] + b"{not json" + raw[17:], "corrupt safetensors header"),
    (lambda raw: raw[:3], "not a safetensors file"),
])
def test_a_damaged_file_is_refused_naming_the_problem(tmp_path, damage, message):
    save_file({"w": np.ones((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    path = tmp_path / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ModelLoadError, match=message):
        SafetensorsCheckpoint(tmp_path)


def test_an_unsupported_dtype_is_named(tmp_path):
    _write_raw(tmp_path / "model.safetensors", {"q": ("F8_E4M3", [4], b"\x01" * 4)})
    with pytest.raises(UnsupportedModel, match="F8_E4M3"):
        SafetensorsCheckpoint(tmp_path).array("q")


def _copy_kit(tmp_path, **config_changes):
    d = tmp_path / "ck"
    shutil.copytree(in_kit("qwen2", "hf"), d)
    config = json.loads((d / "config.json").read_text())
    config.update(config_changes)
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("changes,error,message", [
    ({"model_type": "bert"}, UnsupportedModel, "is an embedding model .* goinfer serve --embed-model"),
    ({"model_type": "t5"}, UnsupportedModel, "model_type 't5' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}}, UnsupportedModel, "'dynamic'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, ModelLoadError,
     "lacks 'original_max_position_embeddings'"),  # YaRN needs the window it stretches
    ({"hidden_size": None}, ModelLoadError, "lacks 'hidden_size'"),
    ({"num_hidden_layers": "many"}, ModelLoadError, "config.json"),
])
def test_an_unsupported_or_broken_config_is_refused(tmp_path, changes, error, message):
    with pytest.raises(error, match=message):
        engine.load_model(_copy_kit(tmp_path, **changes), selftest=False)


def test_the_cli_reports_a_checkpoint_without_its_tokenizer_in_one_line(tmp_path):
    d = _copy_kit(tmp_path)
    (d / "tokenizer.json").unlink()
    r = CliRunner().invoke(app, ["chat", "--model", str(d), "--prompt", "hi", "--no-selftest"], env={"NO_COLOR": "1"})
    assert r.exit_code != 0
    assert "no tokenizer.json" in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1


@needs_kit
def test_a_checkpoint_runs_its_chat_template_and_stops_at_its_end_token():
    model = engine.load_model(QWEN2, selftest=False)
    assert model.tokenizer.eos_id == model.tokenizer.token_to_id("<|im_end|>")
    assert model.tokenizer.eos_id in model.tokenizer.eog_ids
    prompt = model.template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>user\nhi<|im_end|>") and prompt.endswith("<|im_start|>assistant\n")
    assert model.tokenizer.decode(model.tokenizer.encode(prompt)) == prompt


@needs_kit
def test_check_fit_sizes_a_checkpoint_as_the_default_path_holds_it():
    from engine.loading.hardware import fit_report
    from engine.models.hf_checkpoint import HFCheckpoint

    report = fit_report(str(QWEN2))
    assert report["architecture"] == "qwen2"
    assert report["weights_bytes"] == HFCheckpoint(QWEN2, quantize=True).file_size  # Q8_0 matrices, f32 vectors
