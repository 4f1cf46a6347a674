"""`--backend cpu|webgpu|auto` as a user meets it: refused in one line when unknown (chat, serve, batch, and
load_model itself), and reported where the model is served (the banner, /health's `placement`, /v1/models'
`backend`). Only cpu and auto run here: this machine's one WebGPU adapter is a software one, which auto declines."""

from __future__ import annotations

import json

import httpx
import pytest

from commands.ui import placement_text
from engine import load_model
from engine.errors import InvalidRequest
from engine.server.state import _backend_fields
from tests.test_cli import goinfer
from tests.test_server import start_server, stop


@pytest.mark.parametrize("command", ["chat", "serve", "batch"])
def test_an_unknown_backend_is_refused_in_one_line(command, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    args = {"chat": ["chat", "--prompt", "hi"], "serve": ["serve", "--addr", "127.0.0.1:0"],
            "batch": ["batch", str(src), "-o", str(tmp_path / "out.jsonl")]}[command]
    r = goinfer(*args, "--backend", "nope", timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr
    assert "--backend must be one of cpu, webgpu, auto, got 'nope'" in r.stderr
    assert r.stdout == ""
    assert not (tmp_path / "out.jsonl").exists()  # refused before the batch touched its output


def test_load_model_refuses_an_unknown_backend_naming_the_choices(smollm2_gguf):
    with pytest.raises(InvalidRequest, match=r"unknown backend 'bogus' \(choose from: cpu, webgpu, auto\)"):
        load_model(smollm2_gguf, backend="bogus")


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf):
    """One server: the default model on --backend cpu, and an embedding model (whose entry must not change)."""
    s = start_server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(smollm2_gguf),
                     "--backend", "cpu", "--embed-model", "minilm-l6")
    yield s
    stop(s)


def test_health_and_models_say_where_a_served_model_runs(served, smollm2_gguf):
    name = smollm2_gguf.stem
    (model,) = httpx.get(f"{served.url}/health", timeout=30).json()["models"]
    assert model["name"] == name and model["placement"] == {"backend": "cpu", "asked": "cpu"}
    entries = {e["id"]: e for e in httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]}
    assert entries[name]["backend"] == "cpu" and "adapter" not in entries[name]
    assert httpx.get(f"{served.url}/v1/models/{name}", timeout=30).json()["backend"] == "cpu"
    embedder = entries["minilm-l6"]
    assert embedder["type"] == "embedding" and "backend" not in embedder and "adapter" not in embedder
    banner = next(line for line in served.log_text().splitlines() if line.startswith(f"goinfer serve: model {name}:"))
    assert banner.endswith(" threads, backend cpu"), banner  # nothing asked for that it did not get: no reason


def test_auto_without_a_real_gpu_runs_on_the_cpu_and_says_why(smollm2_gguf):
    placement = load_model(smollm2_gguf, backend="auto", selftest=False).placement
    assert placement["backend"] == "cpu" and placement["asked"] == "auto"
    assert isinstance(placement["reason"], str) and placement["reason"]
    assert json.loads(json.dumps(placement)) == placement  # /health sends it as it is
    assert placement_text(placement) == f"backend cpu — auto: {placement['reason']}"
    assert _backend_fields(placement) == {"backend": "cpu"}  # a declined adapter is not named as the one at work


def test_chat_answers_on_auto(smollm2_gguf):
    r = goinfer("chat", "--model", str(smollm2_gguf), "--backend", "auto", "--temp", "0", "--max", "16",
                "--prompt", "What is the capital of France? Answer in one sentence.")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_a_webgpu_placement_names_its_adapter():
    placement = {"backend": "webgpu", "asked": "auto",
                 "adapter": {"adapter": "NVIDIA H200", "adapter_type": "DiscreteGPU", "backend": "Vulkan",
                             "software": False, "max_binding_bytes": 1 << 31, "max_buffer_bytes": 1 << 40,
                             "features": ["shader-f16"]}}
    assert placement_text(placement) == "backend webgpu (NVIDIA H200)"
    assert _backend_fields(placement) == {"backend": "webgpu", "adapter": "NVIDIA H200"}
    software = {**placement, "asked": "webgpu", "adapter": {**placement["adapter"], "adapter": "llvmpipe",
                                                            "software": True}}
    assert placement_text(software) == "backend webgpu (llvmpipe, software)"
