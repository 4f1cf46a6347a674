"""llama.cpp's utility routes (/tokenize, /detokenize, /apply-template) and Prometheus /metrics, over real HTTP on
the shared server (the default model): their answers equal the engine's own tokenizer and template, bad bodies are
400s naming the field."""

from __future__ import annotations

import re

import httpx
import pytest

from engine.api.openai import parse_chat_request
from engine.requests.prompts import render_request
from tests.conftest import SERVER_KEY

AUTH = {"Authorization": f"Bearer {SERVER_KEY}"}
TEXT = "Hello world — ça va? 日本"


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    import engine

    return engine.load_model(str(smollm2_gguf), selftest=False)


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)


def test_tokenize_and_detokenize_round_trip_as_the_engine_tokenizes(server, smol):
    tok = smol.tokenizer
    r = post(server, "/tokenize", {"content": TEXT})
    assert r.status_code == 200 and r.json() == {"tokens": tok.encode(TEXT, add_bos=False, add_eos=False)}
    assert post(server, "/tokenize", {"content": TEXT, "add_special": True}).json()["tokens"] == tok.encode(TEXT)
    pieces = post(server, "/tokenize", {"content": TEXT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r.json()["tokens"]
    # a piece that is part of a character comes as its bytes; all of them together are the text
    data = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert data.decode() == TEXT and any(isinstance(p["piece"], list) for p in pieces)
    back = post(server, "/detokenize", {"tokens": r.json()["tokens"]})
    assert back.status_code == 200 and back.json() == {"content": TEXT}


def test_apply_template_is_the_prompt_a_chat_request_renders(server, smol):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    r = post(server, "/apply-template", body)
    assert r.status_code == 200
    assert r.json()["prompt"] == render_request(smol, parse_chat_request(body)).text
    assert r.json()["prompt"].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "content"), ("/tokenize", {"content": 3}, "content"),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
    ("/tokenize", {"content": "x", "colour": 1}, "colour"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens[1]"), ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/apply-template", {"messages": "hi"}, "messages")])
def test_bad_bodies_are_400s_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_unknown_model_and_wrong_method(server):
    r = post(server, "/tokenize", {"model": "nope", "content": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/detokenize", headers=AUTH, timeout=30).status_code == 405


def test_metrics_count_what_the_server_did(server, name):
    done = post(server, "/v1/chat/completions", {"model": name, "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert done.status_code == 200
    r = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = r.text
    assert "# TYPE goinfer_requests_completed_total counter" in text and "goinfer_up 1" in text
    completed = re.search(rf'^goinfer_requests_completed_total{{model="{re.escape(name)}"}} (\d+)$', text, re.M)
    decoded = re.search(rf'^goinfer_decoded_tokens_total{{model="{re.escape(name)}"}} (\d+)$', text, re.M)
    assert completed and int(completed.group(1)) >= 1 and decoded and int(decoded.group(1)) >= 2
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 401  # the key guards it as every route
