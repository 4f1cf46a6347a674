"""`goinfer check --hardware` and the kernel self-test (tier step-down, WARN line, /health `selftest`)."""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from engine.kernels.cpu import selftest
from engine.kernels.quant_types import COMPUTE_TYPES, GGMLType
from goinfer_cli.app import app
from testdata import make_fixtures as mf


@pytest.fixture
def fresh_selftest(monkeypatch):
    """A process that has not run the self-test yet (restored afterwards)."""
    monkeypatch.setattr(selftest, "_STATE", selftest.SelfTest())
    monkeypatch.setattr(selftest, "KERNELS", dict(selftest._cpu_kernels()))
    monkeypatch.delenv("GOINFER_NO_SELFTEST", raising=False)


def _break_q4_k_matvec(monkeypatch):  # the int8 path's matvec: the kernel a default load checks
    real = selftest.KERNELS["matvec_q8"]

    def wrong(w, x, ids):
        got, want = real(w, x, ids)
        if w.ggml_type == GGMLType.Q4_K:
            got = got * 1.5  # a quietly wrong kernel
        return got, want

    monkeypatch.setitem(selftest.KERNELS, "matvec_q8", wrong)


def test_every_kernel_agrees_with_the_reference(fresh_selftest):
    result = selftest.run_selftest()
    assert result.status == "ok"
    assert {r.kernel for r in result.results} == {"matvec", "matvec_q8", "dequantize", "embed", "packed_q8"}
    assert {r.type for r in result.results} == {t.name for t in COMPUTE_TYPES}
    assert {r.type for r in result.results if r.kernel == "packed_q8"} == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
    assert all(r.ok and r.max_rel_err < selftest.TOLERANCE for r in result.results)


def test_a_disagreeing_kernel_steps_its_type_down_with_one_warn_line(fresh_selftest, monkeypatch, tmp_path,
                                                                     capsys):
    from engine.loading.load import load_model

    _break_q4_k_matvec(monkeypatch)
    model = load_model(mf.write_llama_fixture(tmp_path / "tiny.gguf"))
    warn = [line for line in capsys.readouterr().err.splitlines() if "WARN" in line]
    assert len(warn) == 1, warn
    assert "matvec" in warn[0] and "Q4_K" in warn[0] and "tier reference" in warn[0] and "0.5" in warn[0]
    report = selftest.report()
    assert report["status"] == "stepped_down" and report["stepped_down"] == {"Q4_K": "reference"}
    assert [(f["kernel"], f["type"]) for f in report["failed"]] == [("matvec_q8", "Q4_K")]
    # The model's Q4_K weights now run on the reference tier; other types stay on the fast one.
    backend = model.backend.kernels
    q4k = next(model.weights.tensor(n[: -len(".weight")]) for n, e in model.weights._file.entries.items()
               if e.type_id == GGMLType.Q4_K)
    assert backend._pick(q4k) is backend._slow
    x = np.random.default_rng(0).normal(size=(2, q4k.cols)).astype(np.float32)
    from engine.kernels import reference

    np.testing.assert_array_equal(backend.matmul(x, q4k), reference.matmul(x, q4k))
    q8 = model.weights.tensor("token_embd")
    assert backend._pick(q8) is backend._fast
    assert model.backend.step is None  # the compiled decode step runs every type's int8 kernel: off while one is suspect
    # The self-test runs once per process: a second load neither repeats it nor warns again.
    load_model(tmp_path / "tiny.gguf")
    assert "WARN" not in capsys.readouterr().err


def test_a_load_checks_what_its_path_runs_and_check_hardware_the_rest(fresh_selftest, tmp_path):
    # Each checked kernel compiles on the first run, per weight type: a default (int8) load leaves the exact
    # path's f32 matvec alone, an exact-path load checks it, both on the model's matrix types only (a packed
    # matrix's packed kernels, another's plain ones), and `check --hardware` adds whatever is left without
    # repeating.
    from engine.loading.load import load_model

    path = mf.write_llama_fixture(tmp_path / "tiny.gguf")
    model = load_model(path)
    assert {r.kernel for r in selftest.report_results()} == {"matvec_q8", "packed_q8", "dequantize", "embed"}
    load_model(path, quant="f32")
    assert {r.kernel for r in selftest.report_results()} == {"matvec_q8", "packed_q8", "dequantize", "embed", "matvec"}
    matrices = [model.weights.tensor(n[: -len(".weight")]) for n in model.weights._file.entries
                if n.endswith(".weight")]
    model_types = {t.ggml_type.name for t in matrices if t.rows > 1}
    assert {r.type for r in selftest.report_results()} == model_types != {t.name for t in COMPUTE_TYPES}
    n = len(selftest.report_results())
    assert selftest.run_selftest().status == "ok"  # check --hardware: every kernel on every type
    results = selftest.report_results()
    assert {r.type for r in results} == {t.name for t in COMPUTE_TYPES} and len(results) > n
    assert len({(r.kernel, r.type) for r in results}) == len(results)  # none checked twice
    assert selftest.run_selftest().status == "ok" and len(selftest.report_results()) == len(results)  # nothing left


def test_no_selftest_skips_it(fresh_selftest, monkeypatch, tmp_path):
    from engine.loading.load import load_model

    _break_q4_k_matvec(monkeypatch)
    model = load_model(mf.write_llama_fixture(tmp_path / "tiny.gguf"), selftest=False)
    assert selftest.report()["status"] == "skipped"
    assert not isinstance(model.backend.kernels, selftest.TieredKernels)


def test_health_carries_the_selftest(fresh_selftest, tmp_path):
    from engine.loading.load import load_model
    from engine.server import ServedModel, Server
    from engine.server.config import ServerConfig

    model = load_model(mf.write_llama_fixture(tmp_path / "tiny.gguf"))
    server = Server([ServedModel.of("tiny", model, 64)], ServerConfig(host="127.0.0.1", port=0), log=lambda s: None)
    server.start()
    try:
        body = httpx.get(f"{server.url}/health", timeout=10).json()
    finally:
        server.stop()
    # the int8 path's kernels on the model's matrix types: packed_q8 for a type with packed matrices, matvec_q8,
    # dequantize and embed for a type with matrices (or rows) outside the packed layout
    matrices = [model.weights.tensor(n[: -len(".weight")]) for n in model.weights._file.entries
                if n.endswith(".weight")]
    matrices = [t for t in matrices if t.rows > 1]
    packed_types = {t.ggml_type for t in matrices if t.packed is not None}
    plain_types = {t.ggml_type for t in matrices if t.packed is None or t.rows % 8}
    assert len(packed_types | plain_types) >= 10 and packed_types  # the fixture spreads types over the layers
    assert body["selftest"]["status"] == "ok"
    assert body["selftest"]["kernels_checked"] == len(packed_types) + 3 * len(plain_types)
    assert body["selftest"]["failed"] == []


def test_check_hardware_json_holds_the_fields_and_nothing_personal(tmp_path):
    model = mf.write_llama_fixture(tmp_path / "tiny.gguf")
    # --webgpu-selftest: the WebGPU self-test on a software adapter too (lavapipe in CI), which check alone skips
    r = CliRunner().invoke(app, ["check", "--json", "--webgpu-selftest", "--fit", str(model), "--ctx", "128"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["goinfer"] and report["python"]["version"] and report["numpy"]["version"]
    if (Path(__file__).resolve().parents[1] / ".git").exists():  # a checkout: the version names its commit
        assert re.fullmatch(r"\S+ \([0-9a-f]{4,}\)", report["goinfer"]), report["goinfer"]
    assert report["numpy"]["blas"]["name"] and report["numba"] and report["llvmlite"]
    assert report["os"]["system"] and report["os"]["kernel"]
    assert report["cpu"]["logical_cores"] >= 1 and isinstance(report["cpu"]["isa"], list)
    assert report["kernels"]["tier"].startswith("cpu") and report["kernels"]["tiers"] == ["cpu", "reference"]
    assert "/kernels/" in report["kernels"]["cache"] or "NUMBA_CACHE_DIR" in os.environ  # where they compile to
    assert report["memory"]["total_bytes"] > 0
    assert set(report["gpu"]) == {"cuda", "webgpu"}
    for backend in report["gpu"].values():  # importable with a device, or the reason why not
        assert backend["available"] or backend["reason"]
    assert report["selftest"]["status"] in ("ok", "stepped_down")
    webgpu = report["gpu"]["webgpu"]
    if webgpu.get("adapters"):  # the WebGPU self-test on the adapter --backend webgpu takes (lavapipe in CI)
        t = webgpu["selftest"]
        assert t["status"] == "passed" and t["adapter"] == webgpu["adapters"][0]["adapter"], t
        assert t["worst_cosine"] >= t["bars"]["cosine"] and t["worst_rel_l2"] <= t["bars"]["rel_l2"]
    fit = report["fit"]
    assert fit["model"] == "tiny.gguf" and fit["context"] == 128
    assert fit["total_bytes"] == fit["weights_bytes"] + fit["kv_cache_bytes"] + fit["working_bytes_estimate"]
    # K and V, 2 layers, 128 positions, in the default path's f16 cache (it once counted f32: twice too much)
    assert fit["kv_cache_bytes"] == 2 * 2 * 128 * mf.LLAMA["n_head_kv"] * mf.LLAMA["head_dim"] * 2
    assert isinstance(fit["fits"], bool)
    text = r.stdout
    for word in {socket.gethostname(), socket.getfqdn(), getpass.getuser()} - {"", "localhost"}:
        assert not re.search(rf"(?<![\w.-]){re.escape(word)}(?![\w-])", text), word  # as a word, not inside one
    for path in (str(Path.home()), str(tmp_path)):
        assert f'"{path}' not in text and f"{path}/" not in text, path
    assert "127.0.0.1" not in text


def test_check_hardware_plain_output_and_usage(monkeypatch):
    r = CliRunner().invoke(app, ["check", "--hardware", "--no-selftest"])
    assert r.exit_code == 0, r.output
    for label in ("goinfer", "cpu", "isa", "kernel tier", "memory", "gpu cuda", "gpu webgpu", "self-test"):
        assert label in r.stdout
    assert "self-test: passed" not in r.stdout  # --no-selftest runs neither self-test
    assert "self-test:" not in r.stderr  # nor says it starts one


def _fake_adapter(kind: str):
    from engine.kernels.webgpu.device import AdapterInfo

    return AdapterInfo(name=f"fake {kind}", adapter_type=kind, backend="Vulkan", max_binding_bytes=2**27,
                       max_buffer_bytes=2**28, features=())


@pytest.mark.parametrize("kind, flags, runs", [("CPU", [], False), ("CPU", ["--webgpu-selftest"], True),
                                               ("DiscreteGPU", [], True)])
def test_check_alone_reports_with_progress_and_tests_webgpu_on_real_gpus_only(monkeypatch, kind, flags, runs):
    """`goinfer check` with no flag prints the report (it once printed its help and exited 2); each self-test says
    on stderr that it starts; the WebGPU one runs on a real GPU, on a software adapter only when asked, and says
    why it was skipped. The self-tests themselves are stubs here: the JSON test above runs the real ones."""
    import importlib.util
    import sys
    import types

    import engine.kernels.webgpu.device as device
    import engine.loading.placement as placement

    ran = []
    monkeypatch.setattr(selftest, "run_selftest", lambda warn=None: None)
    if "wgpu" not in sys.modules and importlib.util.find_spec("wgpu") is None:
        # the report only needs the package to import; the adapters are fakes
        monkeypatch.setitem(sys.modules, "wgpu", types.SimpleNamespace(__version__="0.0"))
    monkeypatch.setattr(device, "adapters", lambda: [_fake_adapter(kind)])
    monkeypatch.setattr(placement, "webgpu_selftest", lambda a: ran.append(a.name) or {
        "backend": "webgpu", "adapter": a.name, "status": "passed", "worst_cosine": 1.0, "worst_rel_l2": 0.0,
        "bars": {"cosine": 0.995, "rel_l2": 0.1}, "elapsed_ms": 1.0})
    r = CliRunner().invoke(app, ["check", *flags])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("goinfer ") and "gpu webgpu   fake " in r.stdout and "kernel tier" in r.stdout
    assert "self-test: CPU kernels ..." in r.stderr
    assert ran == ([f"fake {kind}"] if runs else [])
    assert (f"self-test: WebGPU on fake {kind} ..." in r.stderr) == runs
    if runs:
        assert f"self-test: passed on fake {kind}: worst cosine" in r.stdout
    else:
        assert "self-test: skipped on fake CPU: a software adapter" in r.stdout and "--webgpu-selftest" in r.stdout
    r = CliRunner().invoke(app, ["check", "--hardware", "--json", *flags])  # --hardware: still accepted
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["gpu"]["webgpu"]["selftest"]["status"] == ("passed" if runs else "skipped")


def test_cuda_is_reported_without_advice_to_install_what_does_nothing():
    from engine.loading.hardware import gpu_backends

    cuda = gpu_backends()["cuda"]
    assert cuda["available"] is False and cuda["reason"].startswith("no CUDA backend yet")
    assert "pip install" not in cuda["reason"]
