"""What a new user meets first: compiled kernels kept in the goinfer home (and shown, removed, warmed by
`goinfer cache`), the "compiling" line only when something compiles, and a server that listens at once, says
"loading" on /health until it can answer, holds the requests that come meanwhile, and stops promptly mid-load
with nothing left running (engine/kernels/kernel_cache.py, engine/server/loading.py, commands/serve.py)."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.kernels.cpu import kernel_cache

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France? Answer in one sentence."


def _fresh_home(tmp_path: Path) -> Path:
    """A goinfer home with no compiled kernels, whose models are the real cache's (linked, not fetched)."""
    real = Path(os.environ.get("GOINFER_HOME", Path.home() / ".cache" / "goinfer"))
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(real / "models")
    return home


def _env(home: Path) -> dict:
    env = dict(os.environ, GOINFER_HOME=str(home), NO_COLOR="1")
    env.pop("NUMBA_CACHE_DIR", None)  # the user's override would win over the home
    env.pop("GOINFER_API_KEY", None)
    return env


def _compiled_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.suffix in (".nbi", ".nbc")]


def _compiles_tied_to(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"engine.loading.precompile .*--tied {pid}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


# ---------------------------------------------------------------------------------------------------- the cache


def test_a_fresh_home_gets_its_own_kernel_cache_and_the_source_tree_stays_clean(tmp_path):
    home = _fresh_home(tmp_path)
    script = ("import numpy as np, numba\n"
              "from engine.kernels import vmath\n"
              "x = np.ones(8, np.float32)\n"
              "vmath.exp_inplace(x, np.empty(8, np.int32))\n"
              "print(numba.config.CACHE_DIR)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(home), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    where = Path(done.stdout.strip())
    assert where.is_relative_to(home / "kernels")  # <home>/kernels/<tier>-<cpu>/<sources>
    assert where.parent.name.split("-")[0] in ("generic", "avx2", "vnni")
    assert any(p.name.startswith("vmath.exp_inplace") for p in _compiled_files(where))
    assert _compiled_files(ROOT / "engine") == []  # nothing written beside the sources


def test_the_cache_is_keyed_on_the_kernel_sources(tmp_path, monkeypatch):
    tree = tmp_path / "engine"
    shutil.copytree(ROOT / "engine" / "kernels" / "cpu", tree / "kernels" / "cpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("quant_types.py", "vmath.py", "threads.py"):
        shutil.copy(ROOT / "engine" / "kernels" / name, tree / "kernels")
    monkeypatch.setattr(kernel_cache, "_ENGINE", tree)
    before = kernel_cache.sources_hash()
    assert kernel_cache.sources_hash() == before
    callee = tree / "kernels" / "vmath.py"  # a module whose functions others call
    callee.write_text(callee.read_text() + "\n# changed\n")
    assert kernel_cache.sources_hash() != before  # a new directory: no stale code loaded


def test_the_compiling_line_is_said_only_when_something_compiles(tmp_path, monkeypatch):
    module = tmp_path / f"fresh_kernel_{os.getpid()}_{time.monotonic_ns()}.py"  # never compiled before
    module.write_text("import numba\n\n@numba.njit(cache=True)\ndef add_one(x):\n    return x + 1\n\n"
                      "@numba.njit\ndef uncached(x):\n    return x - 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    said = []
    monkeypatch.setattr(kernel_cache._watch, "_fired", False)
    kernel_cache.announce_compiles(lambda: said.append("compiling"))
    try:
        fresh = importlib.import_module(module.stem)
        before = kernel_cache._watch.seconds
        fresh.uncached(1)  # an uncached helper compiles every process: no disk to miss, nothing to say
        assert said == []
        assert fresh.add_one(1) == 2  # a cache miss: said once
        assert fresh.add_one(1.5) == 2.5  # a second compile: not said again
        assert said == ["compiling"]
        assert kernel_cache._watch.seconds > before  # the time spent compiling, counted
    finally:
        kernel_cache.announce_compiles(None)


def test_the_compiling_line_expects_what_this_machine_took_last(tmp_path, monkeypatch):
    monkeypatch.setenv("GOINFER_HOME", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_empty_at_start", True)  # a first run: the whole compile is its figure
    assert kernel_cache.expected_seconds("prompt", 10) == 10  # nothing recorded: the dev VM's figure
    monkeypatch.setattr(kernel_cache._watch, "seconds", 0.4)
    kernel_cache.record_compile_time("prompt")  # everything came from the cache: no figure
    assert kernel_cache.expected_seconds("prompt", 10) == 10
    monkeypatch.setattr(kernel_cache._watch, "seconds", 42.4)
    kernel_cache.record_compile_time("prompt")
    monkeypatch.setattr(kernel_cache._watch, "seconds", 95.0)
    kernel_cache.record_compile_time("step", from_empty=False)
    monkeypatch.setattr(kernel_cache, "_empty_at_start", False)  # a process that found kernels compiled
    monkeypatch.setattr(kernel_cache._watch, "seconds", 3.0)
    kernel_cache.record_compile_time("prompt")  # compiled a part of what a first run compiles: not the figure
    assert (kernel_cache.expected_seconds("prompt", 10), kernel_cache.expected_seconds("step", 90)) == (42, 95)
    (tmp_path / "kernels" / "compile-times.json").write_text("{not json")
    assert kernel_cache.expected_seconds("step", 90) == 90


def test_a_warm_one_shot_says_nothing_about_compiling(smollm2_gguf):
    cmd = [sys.executable, "-m", "goinfer_cli.app", "chat", "--model", str(smollm2_gguf), "--prompt", PROMPT,
           "--temp", "0", "--max", "8"]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=600)  # whatever it compiles, it compiles here
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "compiling" not in done.stderr


def test_goinfer_cache_lists_and_removes_the_kernels(tmp_path):
    home = tmp_path / "home"
    cached = home / "kernels" / "avx2-test" / "0123456789abcdef" / "vmath.exp_inplace-1.py311.nbi"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"x" * 2000)
    run = lambda *args: subprocess.run([sys.executable, "-m", "goinfer_cli.app", "cache", *args], cwd=ROOT,  # noqa
                                       env=_env(home), capture_output=True, text=True, timeout=120)
    listed = run()
    assert listed.returncode == 0, listed.stderr
    (line,) = [line for line in listed.stdout.splitlines() if line.startswith("kernels")]
    assert str(home / "kernels") in line and "complete" in line
    removed = run("rm", "kernels")
    assert removed.returncode == 0, removed.stderr
    assert f"removed {home / 'kernels'}" in removed.stderr
    assert not (home / "kernels").exists()
    again = run("rm", "kernels")
    assert again.returncode == 2 and "'kernels' is not in the cache" in again.stderr


# ---------------------------------------------------------------------------------------------------- serving


def _serve(home: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str, float]:
    """`goinfer serve` on the default model with an empty kernel cache; returns when it listens."""
    started = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "goinfer_cli.app", "serve", "--addr", "127.0.0.1:0", *args],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT,
                                env=_env(home))
    while time.monotonic() - started < 60:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            return proc, m.group(1), started
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"goinfer serve did not listen within 60 s:\n{log.read_text()}")


def test_a_fresh_server_says_loading_holds_requests_then_answers(tmp_path):
    home = _fresh_home(tmp_path)
    log = tmp_path / "serve.log"
    proc, url, started = _serve(home, log)
    try:
        early = httpx.get(url + "/health", timeout=30)
        assert early.status_code == 503 and early.json()["status"] == "loading"  # its kernels compile meanwhile
        answered = {}

        def ask() -> None:  # sent while loading: it waits, then is answered like any other
            body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 16}
            answered["r"] = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)

        waiting = threading.Thread(target=ask)
        waiting.start()
        while (health := httpx.get(url + "/health", timeout=30)).status_code == 503:
            assert health.json()["status"] == "loading"
            assert time.monotonic() - started < 300, log.read_text()
            time.sleep(0.1)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        waiting.join(300)
        assert answered["r"].status_code == 200, answered["r"].text
        assert "Paris" in answered["r"].json()["choices"][0]["message"]["content"]
        assert "ready: answering requests" in log.read_text()
        assert _compiled_files(home / "kernels")  # compiled into the fresh home
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()
    assert _compiles_tied_to(proc.pid) == []  # its decode step's compile ended with it


def test_sigterm_while_loading_exits_promptly_leaving_nothing_running(tmp_path):
    home = _fresh_home(tmp_path)
    log = tmp_path / "serve.log"
    proc, url, _ = _serve(home, log)
    try:
        while "compiling the CPU kernels" not in log.read_text():  # mid-compile
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        assert httpx.get(url + "/health", timeout=30).status_code == 503
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log.read_text()
    assert took < 5, f"{took:.1f} s to exit"
    assert "SIGTERM: shutting down" in log.read_text() and "Traceback" not in log.read_text()
    deadline = time.monotonic() + 5  # a compile tied to it watches for its parent twice a second
    while _compiles_tied_to(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _compiles_tied_to(proc.pid) == []


def test_a_one_shot_stopped_mid_compile_exits_at_once_and_says_what_it_leaves_running(tmp_path):
    home = _fresh_home(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "goinfer_cli.app", "chat", "--prompt", PROMPT, "--temp", "0"],
                            cwd=ROOT, env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((home / "kernels").rglob("*.nbi")):  # compiling (its cache is filling)
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # a script's timeout
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
        # its detached compile is named by the model path under this home: end it here, it is this test's
        subprocess.run(["pkill", "-f", f"engine.loading.precompile {home}"], capture_output=True)
    assert proc.returncode == 130 and took < 5, (proc.returncode, took, err)
    assert "goinfer: interrupted" in err and "Traceback" not in err
    (notice,) = [line for line in err.splitlines() if "still compiling in the background" in line]
    assert "min at most" in notice
