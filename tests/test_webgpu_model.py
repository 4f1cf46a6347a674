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
from tests.conftest import KIT, in_reference, needs_kit
from tests.fidelity import assert_in_noise_band, assert_mean_kl, vs_llama_cpp
from tests import test_webgpu

pytestmark = test_webgpu.pytestmark  # the same skip: no adapter outside CI

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
    reference = json.loads(in_reference(f"{stem}.json").read_text())
    kls = []
    for case in (c for c in reference["cases"] if c["name"] in cases):
        cut = {**case, "positions": case["positions"][:POSITIONS]}
        rows = _prompt_rows(model, case, POSITIONS) if case["name"] != "code_a" else _decoded_rows(model, case, 4)
        cut["positions"] = cut["positions"][: len(rows)]
        mean, worst, misses, case_kls = vs_llama_cpp(rows, cut)
        assert_in_noise_band(mean, worst, misses)
        kls += case_kls
    assert_mean_kl(kls)


@needs_kit
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


def test_the_self_test_passed_and_its_figures_are_reported(smollm2_gguf):
    placement = _resident(smollm2_gguf).placement
    result = placement["selftest"]
    assert result["status"] == "passed" and result["adapter"] == placement["adapter"]["adapter"]
    assert result["worst_cosine"] >= 0.995 and result["worst_rel_l2"] <= 0.10
    assert result["bars"] == {"cosine": 0.995, "rel_l2": 0.10}


def test_a_failed_self_test_leaves_the_model_on_the_cpu_with_one_warn_line(smollm2_gguf, monkeypatch, capfd):
    """A wrong kernel (the gated activation scaled by 1.5) on a fresh device: the tiny checkpoints disagree with
    the CPU, and the model runs on the CPU, saying why."""
    from engine.kernels import registry
    from engine.kernels.webgpu import shaders
    from engine.loading import gpu_selftest

    wrong = shaders.ACT_MUL.replace("y[i] = act * u", "y[i] = 1.5 * act * u")
    assert wrong != shaders.ACT_MUL
    monkeypatch.setitem(shaders.SOURCES, "act_mul", wrong)
    monkeypatch.setattr(gpu_selftest, "_RESULTS", {})
    monkeypatch.setattr(registry, "_GPUS", {})
    capfd.readouterr()
    model = engine.load_model(smollm2_gguf, backend="webgpu")
    err = capfd.readouterr().err
    warns = [line for line in err.splitlines() if "WARN" in line]
    assert len(warns) == 1 and warns[0].startswith("goinfer: WARN: self-test: the WebGPU self-test failed on "), err
    assert "cosine" in warns[0] and warns[0].endswith("the model runs on the CPU")
    assert model.backend.name == "cpu" and model.placement["backend"] == "cpu" and model.placement["asked"] == "webgpu"
    assert model.placement["selftest"]["status"] == "failed" and "self-test failed" in model.placement["reason"]
    assert model.placement["selftest"]["worst_cosine"] < 0.995 or model.placement["selftest"]["worst_rel_l2"] > 0.10
    ids = model.tokenizer.encode("The capital of France is")
    assert model.tokenizer.decode([int(model.next_logprobs(ids).argmax())]).strip() == "Paris"


def test_the_device_cache_forks_rewinds_and_round_trips():
    """On the self-test's tiny Llama: a fork continues on its own, a rewound cache recomputes the same numbers, and
    keys/values written from the host (a saved session) read back as they were; each decode equals the CPU's exact
    path's (within the f16 cache's rounding)."""
    from engine.loading import gpu_selftest
    from engine.kernels.cpu.backend import cpu_backend
    from engine.kernels.webgpu.device import pick
    from engine.models import dense
    from engine.loading.placement import place_on_webgpu

    config, weights, names = gpu_selftest._checkpoint("llama", 11)
    resident = place_on_webgpu(pick(test_webgpu.FOUND, "webgpu"), config, weights, names, {}, selftest=False)
    cpu = cpu_backend("exact", selftest=False)
    head = weights.tensor("token_embd")
    ids = np.random.default_rng(5).integers(0, config.vocab_size, 30)

    def cpu_last(seq):
        cache = cpu.new_cache(config, len(seq))
        cache.reserve(len(seq))
        return cpu.matmul(dense.forward(config, weights, cpu, np.asarray(seq), cache)[-1:], head)[0]

    a = resident.new_cache(config, 64)
    a.reserve(30)
    resident.forward(config, weights, resident, ids, a)
    b = a.fork()
    la, lb = resident.decode([5], [a])[0], resident.decode([6], [b])[0]
    assert (a.length, b.length) == (31, 31)
    for got, want in ((la, cpu_last(np.append(ids, 5))), (lb, cpu_last(np.append(ids, 6)))):
        # the device cache is f16 where the adapter has shader-f16 (lavapipe has): the keys' rounding, as the CPU's
        # default cache has it, and nothing more
        assert np.linalg.norm(got - want) <= 2e-3 * np.linalg.norm(want), np.linalg.norm(got - want)
    a.truncate(10)
    a.reserve(20)
    resident.forward(config, weights, resident, ids[10:], a)
    np.testing.assert_allclose(resident.decode([5], [a])[0], la, rtol=1e-5, atol=1e-5)
    c = resident.new_cache(config, 64)
    c.reserve(31)
    for layer in range(config.n_layer):
        c.write(layer, a.keys(layer), a.values(layer))
    c.advance(31)
    assert np.array_equal(c.keys(1), a.keys(1)) and np.array_equal(c.values(0), a.values(0))
    np.testing.assert_allclose(resident.decode([7], [c])[0], resident.decode([7], [a])[0], rtol=1e-6, atol=1e-6)


def test_a_served_chat_streams_from_a_webgpu_resident_model(tmp_path, smollm2_gguf):
    import httpx

    from tests.test_server import start_server, stop

    s = start_server(tmp_path / "serve.log", "--model", str(smollm2_gguf), "--backend", "webgpu")
    try:
        (model,) = httpx.get(f"{s.url}/health", timeout=30).json()["models"]
        assert model["placement"]["backend"] == "webgpu" and model["placement"]["selftest"]["status"] == "passed"
        entry = httpx.get(f"{s.url}/v1/models/{smollm2_gguf.stem}", timeout=30).json()
        assert entry["backend"] == "webgpu" and entry["adapter"] == model["placement"]["adapter"]["adapter"]
        body = {"model": smollm2_gguf.stem, "messages": [{"role": "user", "content": "Name the capital of France."}],
                "max_tokens": 4, "temperature": 0, "stream": True}
        chunks, text = [], ""
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert len(chunks) >= 3 and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks
        assert text.strip(), chunks
        banner = next(line for line in s.log_text().splitlines() if " backend webgpu (" in line)
        assert "software" in banner
    finally:
        stop(s)


def test_logits_over_the_binding_limit_come_in_runs_of_rows_and_a_cache_stops_at_it():
    """On a device opened with a 128 KiB binding limit: 120 rows of a 5,000-row head (2.4 MB of output) in runs of
    6 rows, equal to the reference; a layer's cache holds what one binding holds (512 positions of the tiny Llama's
    1,024), and a longer prompt is a context overflow, not a device error."""
    from engine.errors import ContextOverflow
    from engine.kernels import reference
    from engine.kernels.webgpu.device import open_device, pick
    from engine.kernels.webgpu.program import Gpu
    from engine.kernels.webgpu.resident import WebGPUResident

    info = pick(test_webgpu.FOUND, "webgpu")
    gpu = Gpu(open_device(info), 1 << 17, info.features)
    resident = WebGPUResident(gpu, info.name)
    w = test_webgpu._random(test_webgpu.GGMLType.Q8_0, 5000, 64, seed=8)
    x = np.random.default_rng(9).normal(0, 1, (120, 64)).astype(np.float32)
    np.testing.assert_allclose(resident.matmul(x, w), x @ reference.dequantize(w).T, rtol=1e-4, atol=1e-3)
    from engine.loading import gpu_selftest

    config = gpu_selftest._checkpoint("llama", 11)[0]
    cache = resident.new_cache(config, config.context_length)
    per_position = config.n_head_kv * config.head_dim * (2 if gpu.kv_f16 else 4)
    assert cache.max_tokens == (1 << 17) // per_position < config.context_length
    with pytest.raises(ContextOverflow):
        cache.reserve(cache.max_tokens + 1)


def test_a_device_that_refuses_the_model_leaves_it_on_the_cpu_with_one_warn_line(smollm2_gguf, monkeypatch, capfd):
    from engine.kernels.webgpu.resident import WebGPUResident

    def refuse(self, *args, **kwargs):
        raise RuntimeError("Device out of memory (a stand-in for the device's own refusal)")

    monkeypatch.setattr(WebGPUResident, "prepare", refuse)
    capfd.readouterr()
    model = engine.load_model(smollm2_gguf, backend="webgpu", selftest=False)
    warns = [line for line in capfd.readouterr().err.splitlines() if "WARN" in line]
    assert len(warns) == 1 and warns[0].startswith("goinfer: WARN: webgpu: the model could not go on "), warns
    assert "RuntimeError: Device out of memory" in warns[0] and warns[0].endswith("the model runs on the CPU")
    assert model.backend.name == "cpu" and model.placement["backend"] == "cpu"
    assert model.placement["reason"].startswith("the model could not go on ")
