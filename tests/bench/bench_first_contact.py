"""What a new user meets first, timed from process start (issue "ready in seconds"; docs/benchmarks.md):

  serve   `goinfer serve` started, /health polled; one /v1/chat/completions request sent as soon as /health says
          200, and one sent right at start (it waits while the models load): when each was answered, after the
          serve command started. Then SIGTERM: how long the server took to exit.
  cold    the one-shot `goinfer chat --prompt ... --temp 0` with its own empty goinfer home (the model linked in):
          its wall time, and when the compile it leaves behind ended.
  warm    the same one-shot, everything cached: wall time per run, beside llama.cpp's own load-and-answer on the
          same GGUF (`llama-cli`-like: llama-cpp-python's Llama(...) + create_chat_completion, in a fresh process),
          when that is installed.

Each case runs with its own goinfer home (GOINFER_HOME; the model file linked in from the real cache) and so its
own kernel cache: `cold` and `serve` start from an empty one. Prints one JSON object.
  python tests/bench/bench_first_contact.py [--model smollm2-135m] [--warm-runs 5] [--cases serve,cold,warm]
      [--llama-python PYTHON]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is the capital of France? Answer in one sentence."


def _home_with_model(model: str) -> Path:
    """A fresh goinfer home whose models/ links to the real cache's (no download, no kernels)."""
    real = Path(os.environ.get("GOINFER_HOME", Path.home() / ".cache" / "goinfer"))
    home = Path(tempfile.mkdtemp(prefix="goinfer-first-contact-"))
    (home / "models").symlink_to(real / "models")
    return home


def _env(home: Path) -> dict:
    env = dict(os.environ, GOINFER_HOME=str(home), NO_COLOR="1")
    env.pop("NUMBA_CACHE_DIR", None)
    return env


def _compiles_running() -> int:
    out = subprocess.run(["pgrep", "-f", "engine.loading.precompile"], capture_output=True, text=True).stdout
    return len(out.split())


def _wait_compiles(limit: float = 400) -> float | None:
    t0 = time.monotonic()
    while _compiles_running() and time.monotonic() - t0 < limit:
        time.sleep(0.5)
    return None if _compiles_running() else time.monotonic() - t0


def serve_case(model: str) -> dict:
    home = _home_with_model(model)
    cmd = [str(ROOT / ".venv/bin/goinfer"), "serve", "--model", model, "--addr", "127.0.0.1:0"]
    log = home / "serve.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f, env=_env(home))
    url = None
    while url is None and time.monotonic() - t0 < 120:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
        url = m.group(1) if m else None
        time.sleep(0.05)
    result = {"listening_s": round(time.monotonic() - t0, 2)}
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 32}
    early: dict = {}

    import threading

    def send_early() -> None:  # a request sent before the server is ready: it waits, then is answered
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        early.update(status=r.status_code, answered_s=round(time.monotonic() - t0, 2))

    sender = threading.Thread(target=send_early)
    sender.start()
    statuses = set()
    while time.monotonic() - t0 < 300:
        status = httpx.get(f"{url}/health", timeout=30).status_code
        statuses.add(status)
        if status == 200:
            break
        time.sleep(0.1)
    result["health_200_s"] = round(time.monotonic() - t0, 2)
    result["health_statuses_seen"] = sorted(statuses)
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    result["first_answer_s"] = round(time.monotonic() - t0, 2)
    result["answer"] = r.json()["choices"][0]["message"]["content"]
    sender.join()
    result["early_request"] = early
    t1 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    result["sigterm_exit_s"] = round(time.monotonic() - t1, 2)
    result["compiles_left_running"] = _compiles_running()
    return result


def cold_case(model: str) -> dict:
    home = _home_with_model(model)
    t0 = time.monotonic()
    done = subprocess.run([str(ROOT / ".venv/bin/goinfer"), "chat", "--model", model, "--prompt", PROMPT, "--temp",
                           "0"], capture_output=True, text=True, env=_env(home))
    wall = time.monotonic() - t0
    left = _wait_compiles()
    return {"wall_s": round(wall, 2), "answer": done.stdout.strip(), "stderr": done.stderr.strip().splitlines(),
            "background_compile_ended_s": None if left is None else round(wall + left, 1)}


def warm_case(model: str, runs: int, llama_python: str) -> dict:
    home = _home_with_model(model)
    cmd = [str(ROOT / ".venv/bin/goinfer"), "chat", "--model", model, "--prompt", PROMPT, "--temp", "0"]
    subprocess.run(cmd, capture_output=True, env=_env(home))  # first run: compiles
    _wait_compiles()
    subprocess.run(cmd, capture_output=True, env=_env(home))  # the step taken from the cache
    goinfer, llama = [], []
    gguf = _gguf_path(model)
    for _ in range(runs):
        t0 = time.monotonic()
        subprocess.run(cmd, capture_output=True, env=_env(home), check=True)
        goinfer.append(round(time.monotonic() - t0, 3))
        t = _llama_cpp_once(gguf, llama_python)
        if t is not None:
            llama.append(t)
    return {"goinfer_s": goinfer, "llama_cpp_s": llama or None}


def _gguf_path(model: str) -> Path:
    real = Path(os.environ.get("GOINFER_HOME", Path.home() / ".cache" / "goinfer"))
    return next((real / "models" / model).glob("*.gguf"))


_LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], temperature=0, max_tokens=32)
print(out["choices"][0]["message"]["content"])
"""


def _llama_cpp_once(gguf: Path, python: str) -> float | None:
    t0 = time.monotonic()
    done = subprocess.run([python, "-c", _LLAMA, str(gguf), PROMPT], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return round(time.monotonic() - t0, 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--warm-runs", type=int, default=5)
    p.add_argument("--cases", default="serve,cold,warm")
    p.add_argument("--llama-python", default=sys.executable,
                   help="a Python with llama-cpp-python installed (its Llama is llama.cpp's load-and-answer)")
    args = p.parse_args()
    out = {"model": args.model, "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    for case in args.cases.split(","):
        out[case] = {"serve": lambda: serve_case(args.model), "cold": lambda: cold_case(args.model),
                     "warm": lambda: warm_case(args.model, args.warm_runs, args.llama_python)}[case]()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
