"""LoRA adapters merged at load (engine/models/lora.py), proven against the same model with the merge done here by
hand: a seeded PEFT adapter on the kit's llama (adjacent-pair RoPE: the converter permutes q/k rows, so the delta's
must be too) and qwen3 (NeoX RoPE, q/k norms), its merged weights written as a plain checkpoint, which the loader
(itself held to transformers by tests/test_families.py) reads like any other. A Hugging Face base with the adapter
gives that checkpoint's logits bit for bit on both paths; a GGUF base (the kit's Q8_0, llama.cpp's converter) gives
them within its quantization's noise; bad adapters are refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import engine
from engine.errors import ModelLoadError, UnsupportedModel
from engine.formats.safetensors import SafetensorsCheckpoint, to_f32
from engine.sessions.disk import identity
from tests.conftest import KIT, needs_kit

pytestmark = needs_kit  # every test here reads the family kit
IDS = list(range(5, 45))
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.down_proj")


def make_adapter(directory, base, *, r=4, alpha=8.0, seed=0, layers=None, config=None):
    """A PEFT adapter for the base checkpoint's TARGETS (f32, seeded); {module: (A, B)}."""
    src = SafetensorsCheckpoint(base)
    rng = np.random.default_rng(seed)
    pairs, tensors = {}, {}
    n_layer = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    for layer in layers if layers is not None else range(n_layer):
        for target in TARGETS:
            module = f"model.layers.{layer}.{target}"
            out_dim, in_dim = src.shape(module + ".weight")
            a = (rng.standard_normal((r, in_dim)) * 0.2).astype(np.float32)
            b = (rng.standard_normal((out_dim, r)) * 0.2).astype(np.float32)
            pairs[module] = (a, b)
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        config or {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"], "bias": "none"}))
    return pairs


def merged_checkpoint(directory, base, pairs, scale):
    """The base checkpoint with W + scale * B @ A written out as f32 (the by-hand merge)."""
    directory.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, directory / f.name)
    src = SafetensorsCheckpoint(base)
    out = {}
    for name in src.names:
        w = np.array(to_f32(src.array(name), src.dtype(name)), np.float32)
        pair = pairs.get(name[: -len(".weight")])
        out[name] = w + scale * (pair[1] @ pair[0]) if pair is not None else w
    save_file(out, str(directory / "model.safetensors"))
    return directory


def logprobs(ref, **kw):
    return engine.load_model(ref, selftest=False, **kw).logprobs(IDS, 0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def kit(request, tmp_path_factory):
    base = KIT / request.param / "hf"
    tmp = tmp_path_factory.mktemp(request.param)
    pairs = make_adapter(tmp / "adapter", base)
    return request.param, base, tmp / "adapter", merged_checkpoint(tmp / "merged", base, pairs, 8.0 / 4)


@pytest.mark.parametrize("quant", ["f32", "auto"])
def test_an_adapted_checkpoint_equals_the_merged_one_bit_for_bit(kit, quant):
    _, base, adapter, merged = kit
    adapted, by_hand = logprobs(base, quant=quant, lora=[(adapter, 1.0)]), logprobs(merged, quant=quant)
    assert np.array_equal(adapted, by_hand)
    plain = logprobs(base, quant=quant)
    assert (plain.argmax(1) != adapted.argmax(1)).mean() > 0.3  # the adapter really changes the model


def test_a_gguf_base_takes_the_adapter_within_its_quantization_noise(kit):
    family, _, adapter, merged = kit
    gguf = next((KIT / family).glob("*.Q8_0.gguf"))
    by_hand = logprobs(merged, quant="f32")
    adapted = logprobs(gguf, quant="f32", lora=[(adapter, 1.0)])
    kl = float((np.exp(by_hand) * (by_hand - adapted)).sum(1).mean())
    # the Q8_0 base's own noise, amplified by a strong adapter: ~0.016 on llama; a q/k delta in the wrong row
    # order (no permutation) measured 7.8
    assert kl < 0.05 and (by_hand.argmax(1) == adapted.argmax(1)).mean() >= 0.9, kl
    fast = logprobs(gguf, lora=[(adapter, 1.0)])  # the default path: merged matrices as Q8_0, the compiled step
    assert (fast.argmax(1) == adapted.argmax(1)).mean() >= 0.9


def test_scales_and_several_adapters_add_up(tmp_path):
    base = KIT / "llama" / "hf"
    one = make_adapter(tmp_path / "one", base, seed=1, layers=[0])
    two = make_adapter(tmp_path / "two", base, seed=2, layers=[1], r=2, alpha=1.0)
    # scale 0.5 on the first (alpha/r = 2 -> 1.0) and the second at its own (0.5): merged by hand at once
    pairs = {**{m: (a, 1.0 * b) for m, (a, b) in one.items()}, **{m: (a, 0.5 * b) for m, (a, b) in two.items()}}
    by_hand = logprobs(merged_checkpoint(tmp_path / "merged", base, pairs, 1.0), quant="f32")
    adapted = logprobs(base, quant="f32", lora=[(tmp_path / "one", 0.5), (tmp_path / "two", 1.0)])
    assert np.allclose(adapted, by_hand, atol=1e-5)


def test_a_stored_session_knows_the_adapter(tmp_path):
    base = KIT / "llama" / "hf"
    make_adapter(tmp_path / "adapter", base)
    plain = identity(engine.load_model(base, selftest=False))
    adapted = identity(engine.load_model(base, selftest=False, lora=[(tmp_path / "adapter", 1.0)]))
    assert "adapters" not in plain and adapted["adapters"][0]["adapter"] == "adapter" and plain != adapted


@pytest.mark.parametrize("config,error,match", [
    ({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True}, UnsupportedModel, "DoRA"),
    ({"peft_type": "PREFIX_TUNING", "r": 4}, UnsupportedModel, "peft_type"),
    ({"peft_type": "LORA", "r": 4, "modules_to_save": ["lm_head"]}, UnsupportedModel, "modules_to_save"),
    ({"peft_type": "LORA", "lora_alpha": 8}, ModelLoadError, "r / lora_alpha"),
])
def test_adapters_that_cannot_be_merged_are_refused(tmp_path, config, error, match):
    make_adapter(tmp_path / "adapter", KIT / "llama" / "hf", layers=[0], config=config)
    with pytest.raises(error, match=match):
        engine.load_model(KIT / "llama" / "hf", selftest=False, lora=[(tmp_path / "adapter", 1.0)])


def test_an_adapter_for_another_model_is_refused(tmp_path):
    a, b = (np.ones((4, 256), np.float32), np.ones((256, 4), np.float32))
    for name, shapes in (("deeper", {"model.layers.7.self_attn.q_proj": (a, b)}),  # layer 7 of a 2-layer model
                         ("wider", {"model.layers.0.mlp.down_proj": (a, b)})):  # down_proj reads 512, not 256
        (tmp_path / name).mkdir()
        save_file({f"base_model.model.{m}.lora_{x}.weight": w for m, (wa, wb) in shapes.items()
                   for x, w in (("A", wa), ("B", wb))}, str(tmp_path / name / "adapter_model.safetensors"))
        (tmp_path / name / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 4}')
        with pytest.raises(ModelLoadError, match="another model"):
            engine.load_model(KIT / "llama" / "hf", selftest=False, lora=[(tmp_path / name, 1.0)])
    with pytest.raises(ModelLoadError, match="no such adapter directory"):
        engine.load_model(KIT / "llama" / "hf", selftest=False, lora=[(tmp_path / "missing", 1.0)])


def test_the_chat_command_answers_with_the_adapter(tmp_path):
    base = KIT / "llama" / "hf"
    pairs = make_adapter(tmp_path / "adapter", base)
    merged = merged_checkpoint(tmp_path / "merged", base, pairs, 2.0)

    def chat(*args):
        out = subprocess.run([sys.executable, "-m", "goinfer_cli.app", "chat", "--temp", "0", "--max", "12",
                              "--no-selftest", "--prompt", "Hello there", *args], capture_output=True, text=True,
                             timeout=300)
        return out

    adapted = chat("--model", str(base), "--lora", str(tmp_path / "adapter"))
    assert adapted.returncode == 0, adapted.stderr[-2000:]
    assert adapted.stdout == chat("--model", str(merged)).stdout
    assert adapted.stdout != chat("--model", str(base)).stdout
    bad = chat("--model", str(base), "--lora", str(tmp_path / "adapter") + ",scale=big")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].startswith("goinfer: error: --lora")
    missing = chat("--model", str(base), "--lora", str(tmp_path / "nowhere"))
    assert missing.returncode != 0 and "no such adapter directory" in missing.stderr.strip().splitlines()[-1]


def test_serve_names_the_adapted_model_and_answers_with_it(tmp_path):
    import httpx

    from tests.test_server import start_server, stop

    base = KIT / "llama" / "hf"
    pairs = make_adapter(tmp_path / "tuned", base)
    merged = merged_checkpoint(tmp_path / "merged", base, pairs, 2.0)
    s = start_server(tmp_path / "serve.log", "--model", f"{base},lora={tmp_path / 'tuned'}", "--model",
                     f"by-hand={merged}", "--no-selftest")
    try:
        names = [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=30).json()["data"]]
        assert names == ["hf+tuned", "by-hand"]
        assert "+ LoRA tuned (scale 2)" in s.log.read_text()  # the banner says what runs: alpha / r = 2

        def complete(model):
            body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "logprobs": 1}
            return httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]

        adapted, by_hand = complete("hf+tuned"), complete("by-hand")
        assert adapted["text"] == by_hand["text"] and adapted["logprobs"] == by_hand["logprobs"]
    finally:
        stop(s)
    bad = subprocess.run([sys.executable, "-m", "goinfer_cli.app", "serve", "--model", f"{base},lora-scale=2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == (
        f"goinfer: error: --model {base}: lora-scale= goes with lora=DIR")
