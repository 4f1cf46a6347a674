"""Prompt-prefix reuse as clients of `goinfer serve` see it (a real server process, the real default model):
`cached_tokens` on every route (OpenAI chat/completions and completions, streamed or not, Responses, Anthropic
Messages), /health's session figures, warm sessions that survive a restart with --session-dir, and a damaged
session file skipped with one warning line."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.test_server import ROOT, _env, sse_lines, start_server, stop

SYSTEM = ("You are the help desk of a public library. You answer questions about opening hours, borrowing, "
          "renewals, fines, study rooms and events, briefly and precisely, and you never guess. ") * 10


def chat_body(model: str, *turns: str, **extra) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def served(tmp_path_factory, session_dir, smollm2_gguf):
    s = start_server(tmp_path_factory.mktemp("log") / "serve.log", "--model", f"lib={smollm2_gguf}",
                     "--session-dir", str(session_dir))
    yield s
    stop(s)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_route_reports_the_tokens_a_warm_session_gave(served):
    url = served.url
    first = post(url, "/v1/chat/completions", chat_body("lib", "When do you open on Monday?"))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answer = first["choices"][0]["message"]["content"]
    second = post(url, "/v1/chat/completions", chat_body("lib", "When do you open on Monday?", answer,
                                                         "And on Sunday?"))
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 64 == 0 and second["usage"]["prompt_tokens"] - cached < 200

    # streamed, with the usage chunk
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300,
                      json=chat_body("lib", "Can I renew a book online?", stream=True,
                                     stream_options={"include_usage": True})) as r:
        chunks, _ = sse_lines(r)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128  # the system prompt

    # completions: a raw prompt that continues an earlier one
    text = SYSTEM + "Question: how many books can I borrow?\nAnswer:"
    post(url, "/v1/completions", {"model": "lib", "prompt": text, "max_tokens": 8, "temperature": 0})
    again = post(url, "/v1/completions", {"model": "lib", "prompt": text + " Ten.\nQuestion: for how long?\nAnswer:",
                                          "max_tokens": 8, "temperature": 0})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256

    # Responses
    resp = post(url, "/v1/responses", {"model": "lib", "instructions": SYSTEM, "input": "Are there study rooms?",
                                       "max_output_tokens": 8, "temperature": 0})
    assert resp["usage"]["input_tokens_details"]["cached_tokens"] >= 128

    # Anthropic Messages: input_tokens counts what was not read from the cache
    msg = {"model": "lib", "system": SYSTEM, "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "user", "content": "Do you have events for children?"}]}
    m = post(url, "/v1/messages", msg)
    read = m["usage"]["cache_read_input_tokens"]
    assert read >= 128
    count = post(url, "/v1/messages/count_tokens", {k: v for k, v in msg.items() if k not in ("max_tokens",
                                                                                               "temperature")})
    assert m["usage"]["input_tokens"] + read == count["input_tokens"]
    with httpx.stream("POST", url + "/v1/messages", json={**msg, "stream": True}, timeout=300) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]  # no [DONE] here
    delta = [e for e in events if e.get("type") == "message_delta"][-1]
    assert delta["usage"]["cache_read_input_tokens"] >= 128
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == count["input_tokens"]

    health = httpx.get(url + "/health").json()
    lib = health["models"][0]
    assert lib["reuse_hits"] >= 5 and lib["reused_tokens"] >= 5 * 128
    assert 0 < lib["sessions"] <= lib["max_sessions"] == health["limits"]["kv_sessions"] == 8
    assert 0 < lib["session_bytes"] <= lib["session_budget_bytes"]
    assert lib["warmed_tokens"] > 0  # idle time evaluated the replies through the prompt pass


def test_warm_sessions_survive_a_restart_and_a_damaged_file_is_skipped(served, session_dir, tmp_path, smollm2_gguf):
    url = served.url
    body = chat_body("lib", "Where do I return books after hours?")
    before = post(url, "/v1/chat/completions", body)
    follow = chat_body("lib", "Where do I return books after hours?", before["choices"][0]["message"]["content"],
                       "Is there a fee?")
    stop(served)
    assert "warm sessions to" in served.log_text()
    files = sorted(session_dir.iterdir())
    assert files and all(f.suffix == ".kvsession" for f in files)

    log2 = tmp_path / "again.log"
    again = start_server(log2, "--model", f"lib={smollm2_gguf}", "--session-dir", str(session_dir))
    try:
        assert "restored" in log2.read_text()
        warm = post(again.url, "/v1/chat/completions", follow)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    finally:
        stop(again)
    # the same turn on a server without sessions: the same answer
    cold_log = tmp_path / "cold.log"
    cold = start_server(cold_log, "--model", f"lib={smollm2_gguf}", "--kv-sessions", "0")
    try:
        plain = post(cold.url, "/v1/chat/completions", follow)
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert plain["choices"][0]["message"] == warm["choices"][0]["message"]
    finally:
        stop(cold)

    # damage every file the last server wrote: the next start skips each with one warning line, and serves
    written = sorted(session_dir.iterdir())
    assert written
    for f in written:
        data = bytearray(f.read_bytes())
        f.write_bytes(bytes(data[: len(data) // 2]))
    log3 = tmp_path / "damaged.log"
    third = start_server(log3, "--model", f"lib={smollm2_gguf}", "--session-dir", str(session_dir))
    try:
        text = log3.read_text()
        warnings = [line for line in text.splitlines() if "skipped session file" in line]
        assert len(warnings) == len(written) and "Traceback" not in text
        ok = post(third.url, "/v1/chat/completions", follow)
        assert ok["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert ok["choices"][0]["message"] == warm["choices"][0]["message"]
    finally:
        stop(third)


def test_a_prefill_chunk_off_the_prompt_tiles_is_refused():
    r = subprocess.run([sys.executable, "-m", "goinfer_cli.app", "serve", "--prefill-chunk", "100"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--prefill-chunk" in r.stderr and "multiple of 64" in r.stderr
    assert "Traceback" not in r.stderr
