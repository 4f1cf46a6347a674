"""The chat page (GET /) in a real headless browser: tests/browser/flows.mjs drives Debian's chromium through
playwright-core against a real `goinfer serve`, one user flow per test, asserting what the page shows; these tests
check what it saw against the API itself. Screenshots of each flow's end land in $GOINFER_SHOTS when that is set
(.ci/run keeps them)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import BROWSER_DIR, CHROMIUM, SERVER_KEY, in_kit, needs_browser
from tests.test_server import start_server, stop

pytestmark = needs_browser

WEB = Path(__file__).resolve().parents[1] / "engine" / "server" / "web"
PYTHON_PROMPT = "Write a Python function that adds two numbers, with a short explanation."


def flow(name: str, url: str, tmp_path: Path, key: str | None = None) -> dict:
    shots = os.environ.get("GOINFER_SHOTS") or str(tmp_path / "shots")
    out = subprocess.run(["node", "flows.mjs", name, url + "/", *([key] if key else [])], cwd=BROWSER_DIR,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CHROMIUM": CHROMIUM, "SHOTS": shots})
    assert out.returncode == 0, f"the {name} flow failed in the browser:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def page_server(tmp_path_factory, smollm2_gguf, gemma_gguf):
    """Two real models and no key: the page as `goinfer serve` shows it on loopback."""
    s = start_server(tmp_path_factory.mktemp("serve") / "serve.log", "--model", str(smollm2_gguf),
                     "--model", str(gemma_gguf))
    yield s
    stop(s)


def greedy_reply(url: str, model: str, prompt: str, max_tokens: int, headers=None) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=300)
    return r.json()["choices"][0]["message"]["content"]


def test_a_message_streams_in_and_is_rendered_as_markdown(page_server, smollm2_gguf, tmp_path):
    seen = flow("chat", page_server.url, tmp_path)
    assert seen["model"] == smollm2_gguf.stem  # the first model is picked unasked
    kept = seen["conversation"]["messages"]
    assert kept[0] == {"role": "user", "content": PYTHON_PROMPT}
    # What the page kept is what the API answers to the same request: the stream was read whole and in order.
    assert kept[1]["content"] == greedy_reply(page_server.url, seen["model"], PYTHON_PROMPT, 256)
    assert "```python" in kept[1]["content"] and kept[1]["stats"] == seen["meta"]


def test_the_picked_model_answers(page_server, gemma_gguf, tmp_path):
    assert flow("pick", page_server.url, tmp_path)["model"] == gemma_gguf.stem


def test_stop_keeps_the_text_so_far(page_server, smollm2_gguf, tmp_path):
    stopped = flow("stop", page_server.url, tmp_path)["stopped"]
    full = greedy_reply(page_server.url, smollm2_gguf.stem, "List all the numbers from 1 to 1000 separated by commas.",
                        400)
    assert full.startswith(stopped) and len(stopped) < len(full)  # a prefix of the reply, cut where Stop was pressed


def test_a_conversation_outlives_a_reload(page_server, tmp_path):
    flow("reload", page_server.url, tmp_path)


def test_the_layout_holds_from_360_to_1600_px_in_light_and_dark(page_server, tmp_path):
    seen = flow("layout", page_server.url, tmp_path)["seen"]
    assert [s["width"] for s in seen] == [360, 768, 1200, 1600]


def test_html_in_a_reply_runs_nothing(page_server, tmp_path):
    html = flow("sanitize", page_server.url, tmp_path)["html"]
    assert "<strong>bold</strong>" in html and "onerror" not in html and "javascript:" not in html


def test_a_keyed_server_asks_for_the_key(tmp_path, smollm2_gguf):
    s = start_server(tmp_path / "serve.log", "--model", str(smollm2_gguf), "--api-key", SERVER_KEY)
    try:
        assert flow("keyed", s.url, tmp_path, key=SERVER_KEY)["model"] == smollm2_gguf.stem
    finally:
        stop(s)


def test_answer_now_ends_the_thinking(tmp_path, smollm2_gguf):
    """The kit's tiny qwen3 thinks thousands of tokens a second: served beside SmolLM2 while that writes a long reply
    (the two models take turns), its thinking lasts seconds, time enough to press the button mid-thought."""
    s = start_server(tmp_path / "serve.log", "--model", str(in_kit("qwen3", "tiny-qwen3-a.Q8_0.gguf")),
                     "--model", str(smollm2_gguf))
    body = {"model": smollm2_gguf.stem, "messages": [{"role": "user", "content": "List all the numbers from 1 to "
            "1000 separated by commas."}], "temperature": 0, "max_tokens": 3000, "stream": True}
    busy = threading.Event()

    def keep_busy():
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                busy.set()
                if done.is_set():
                    return  # closing the stream cancels the reply

    done = threading.Event()
    other = threading.Thread(target=keep_busy)
    other.start()
    try:
        assert busy.wait(120)
        seen = flow("answerNow", s.url, tmp_path)
    finally:
        done.set()
        other.join(60)
        stop(s)
    assert seen["reasoning"] > 0 and seen["content"] > 0


def test_the_vendored_libraries_are_their_npm_releases():
    """engine/server/web/vendor/ holds marked and DOMPurify byte for byte as tests/browser/package.json pins them:
    refreshing them is `npm install` there and a copy (engine/server/web/vendor/README.md)."""
    modules = BROWSER_DIR / "node_modules"
    pins = json.loads((BROWSER_DIR / "package.json").read_text())["dependencies"]
    for package, inside, vendored in (("marked", "lib/marked.esm.js", "marked.esm.js"),
                                      ("dompurify", "dist/purify.es.mjs", "purify.es.mjs")):
        installed = json.loads((modules / package / "package.json").read_text())["version"]
        assert installed == pins[package]
        assert (WEB / "vendor" / vendored).read_bytes() == (modules / package / inside).read_bytes(), package
