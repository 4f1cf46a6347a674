"""The built-in chat page (GET /, engine/server/web/): its files served without the key, under a strict CSP, and
nothing else; its stream reader (stream.js) run under node on the real server's SSE bytes, cut at random places,
builds the same reply the non-streamed request returns; its conversation list (conversations.js) under node. The
page itself, in a browser: tests/test_browser.py."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import SERVER_KEY
from tests.test_server import start_server, stop

WEB = Path(__file__).resolve().parents[1] / "engine" / "server" / "web"
AUTH = {"Authorization": f"Bearer {SERVER_KEY}"}
NODE = shutil.which("node")


def test_the_page_is_served_without_the_key(server):
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp  # nothing inline runs or styles
    assert '<script type="module" src="/ui/chat.js">' in page.text
    for path, kind, file in (("/ui/chat.js", "text/javascript", "chat.js"), ("/ui/style.css", "text/css", "style.css"),
                             ("/ui/vendor/purify.es.mjs", "text/javascript", "vendor/purify.es.mjs"),
                             ("/favicon.ico", "image/svg+xml", "favicon.svg")):
        r = httpx.get(server.url + path, timeout=30)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith(kind), path
        assert r.content == (WEB / file).read_bytes()
    for path in ("/ui/../page.py", "/ui/vendor/README.md", "/ui/missing.js", "/ui/%2e%2e/page.py"):
        assert httpx.get(server.url + path, timeout=30).status_code in (401, 404), path  # only the table's files
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401  # the API still needs the key


@pytest.mark.skipif(NODE is None, reason="needs node to run the page's script")
def test_the_pages_stream_reader_builds_the_reply_the_server_returns(server, name, tmp_path):
    body = {"model": name, "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 40,
            "temperature": 0}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120).json()
    raw = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}).text
    rng = random.Random(5)
    cuts = sorted(rng.sample(range(1, len(raw)), 40))
    pieces = [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]
    module = tmp_path / "stream.mjs"
    shutil.copy(WEB / "stream.js", module)
    script = f"""
import {{ parseSSE, applyChunk, newReply }} from {json.dumps(module.as_uri())};
const pieces = {json.dumps(pieces)};
const reply = newReply(); let buffer = "";
for (const piece of pieces) {{
  const parsed = parseSSE(buffer + piece); buffer = parsed.rest;
  for (const data of parsed.data) if (data !== "[DONE]") applyChunk(reply, JSON.parse(data));
}}
console.log(JSON.stringify(reply));
"""
    out = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["content"] == whole["choices"][0]["message"]["content"] and reply["content"]
    assert reply["finish"] == whole["choices"][0]["finish_reason"] and reply["id"].startswith("chatcmpl-")
    assert reply["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


@pytest.mark.skipif(NODE is None, reason="needs node to run the page's script")
def test_reasoning_and_tool_call_pieces_are_joined(tmp_path):
    module = tmp_path / "stream.mjs"
    shutil.copy(WEB / "stream.js", module)
    chunks = [{"choices": [{"index": 0, "delta": {"reasoning_content": "Let me "}}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "think."}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                                                  "function": {"name": "f", "arguments": ""}}]}}]},
              *({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}}]}
                for piece in ('{"a":', "1}")),
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
    script = f"""
import {{ applyChunk, newReply }} from {json.dumps(module.as_uri())};
const reply = newReply();
for (const c of {json.dumps(chunks)}) applyChunk(reply, c);
console.log(JSON.stringify(reply));
"""
    out = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    reply = json.loads(out.stdout)
    assert reply["reasoning"] == "Let me think." and reply["toolCalls"] == [{"name": "f", "arguments": "{\"a\":1}"}]
    assert reply["finish"] == "tool_calls" and reply["content"] == ""


def test_no_web_turns_the_page_off(tmp_path, smollm2_gguf):
    s = start_server(tmp_path / "serve.log", "--model", str(smollm2_gguf), "--no-web", "--no-selftest")
    try:
        assert httpx.get(s.url + "/", timeout=30).status_code == 404
    finally:
        stop(s)


@pytest.mark.skipif(NODE is None, reason="needs node to run the page's script")
def test_the_conversation_list(tmp_path):
    module = tmp_path / "conversations.mjs"
    shutil.copy(WEB / "conversations.js", module)
    script = f"""
import * as c from {json.dumps(module.as_uri())};
const store = {{ data: {{}}, getItem(k) {{ return this.data[k] ?? null; }}, setItem(k, v) {{ this.data[k] = v; }} }};
const first = c.newConversation(1), second = c.newConversation(2);
const question = "  What is the tallest mountain on Earth, and how tall is it?\\nthanks";
first.messages.push({{ role: "user", content: question }});
let list = c.upsert([], first, 10);
list = c.upsert(list, second, 11);  // an empty conversation is not kept
second.messages.push({{ role: "user", content: "Hi" }}, {{ role: "assistant", content: "Hello!", stats: "x" }});
list = c.upsert(list, second, 12);
list = c.upsert(list, first, 13);  // used again: first in the list
const saved = c.saveConversations(store, list);
const full = {{ getItem() {{ return null; }}, setItem() {{ const e = new Error("full"); e.name = "QuotaExceededError";
                                                        throw e; }} }};
console.log(JSON.stringify({{ titles: c.loadConversations(store).map((x) => x.title), saved,
  refused: c.saveConversations(full, list), damaged: c.loadConversations({{ getItem: () => "{{not json" }}),
  api: c.apiMessages(second, "Be brief."), plain: c.apiMessages(second, "") }}));
"""
    out = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["titles"] == ["What is the tallest mountain on Earth, and how…", "Hi"]
    assert seen["saved"] is None and seen["damaged"] == []
    assert seen["refused"] == "could not keep the conversation in this browser (QuotaExceededError)"
    assert seen["api"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello!"}]  # the stats line stays in the page
    assert seen["plain"] == seen["api"][1:]
