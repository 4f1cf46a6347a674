"""Browsers: which web pages may read the server's answers (engine/server/cors.py), over real HTTP on the shared
server (the default model, an API key, no --cors-origin: this machine's pages only)."""

from __future__ import annotations

import httpx
import pytest

from engine.server.cors import CorsPolicy, parse_origins
from tests.conftest import SERVER_KEY
from tests.test_cli import goinfer

LOCAL_UI = "http://localhost:5173"  # e.g. a web UI's dev server on this machine
FOREIGN = "https://evil.example"
AUTH = {"Authorization": f"Bearer {SERVER_KEY}"}


def preflight(server, origin: str) -> httpx.Response:
    return httpx.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_a_local_pages_preflight_needs_no_key_and_is_answered(server):
    r = preflight(server, LOCAL_UI)
    assert r.status_code == 204 and r.content == b""
    assert r.headers["Access-Control-Allow-Origin"] == LOCAL_UI
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"


def test_a_foreign_pages_preflight_is_refused(server):
    r = preflight(server, FOREIGN)
    assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers
    assert r.json()["error"]["code"] == "origin_not_allowed" and "--cors-origin" in r.json()["error"]["message"]


def test_answers_name_an_allowed_origin_streamed_or_not(server, name):
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120,
                   headers={**AUTH, "Origin": "http://127.0.0.1:3000"})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "http://127.0.0.1:3000"
    assert r.headers["Vary"] == "Origin" and "X-Request-Id" in r.headers["Access-Control-Expose-Headers"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120,
                      headers={**AUTH, "Origin": LOCAL_UI}) as s:
        assert s.status_code == 200 and s.headers["Access-Control-Allow-Origin"] == LOCAL_UI
        assert b"[DONE]" in s.read()
    # a refusal is readable too (the page can show why), and the key is still required
    r = httpx.get(server.url + "/v1/models", headers={"Origin": LOCAL_UI}, timeout=30)
    assert r.status_code == 401 and r.headers["Access-Control-Allow-Origin"] == LOCAL_UI


def test_a_foreign_page_gets_no_permission_to_read(server):
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "Origin": FOREIGN}, timeout=30)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers


def test_cors_origin_adds_origins_and_refuses_what_is_not_one():
    policy = CorsPolicy(parse_origins(["https://App.Example.com/"]))
    assert policy.allowed("https://app.example.com") and not policy.allowed("https://other.example.com")
    assert policy.allowed("http://[::1]:8000") and not policy.allowed("http://localhost.evil.example")
    assert CorsPolicy(parse_origins(["*"])).allowed(FOREIGN)
    for bad in ("ftp://x.example", "https://x.example/app", "localhost:3000"):
        with pytest.raises(ValueError, match="--cors-origin"):
            parse_origins([bad])
    r = goinfer("serve", "--cors-origin", "https://x.example/app", "--addr", "127.0.0.1:0")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--cors-origin" in r.stderr
