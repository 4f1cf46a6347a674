"""`goinfer serve` as clients use it: a real server process on the real default model, driven by the
official openai SDK (the happy paths) and by raw HTTP (every error, auth, limits, disconnects)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engine.api.openai import parse_completion_request
from engine.server import ServerConfig, ServerConfigError, body_cap, is_loopback, parse_addr, parse_model_spec

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-9f2c"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
MAX_QUEUE = 3  # small, so that 8 concurrent clients meet a full queue
MAX_CONCURRENT = 2  # sequences decoded together: 8 clients fill them, the queue, and get 429s
KEEPALIVE_S = 0.2  # short, so that a prompt's prefill is long enough to show keep-alives


def _env() -> dict:
    env = dict(os.environ, NO_COLOR="1")
    env.pop("GOINFER_API_KEY", None)
    return env


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text()


def start_server(log: Path, *args: str, timeout: float = 180) -> Served:
    cmd = [sys.executable, "-m", "goinfer_cli.app", "serve", "--addr", "127.0.0.1:0", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT,
                                env=_env())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        m = re.search(r"listening on (https?://127\.0\.0\.1:\d+)", text)
        if m and "ready: answering requests" in text:  # listening from the start; its models loaded
            return Served(proc, m.group(1), log)
        if proc.poll() is not None:
            pytest.fail(f"goinfer serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"goinfer serve did not start in {timeout} s:\n{log.read_text()}")


def stop(served: Served, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if served.proc.poll() is None:
        served.proc.send_signal(sig)
    try:
        return served.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        raise


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf):
    """One server for the module (the model loads once): the file under its own name, and again as
    "second", behind an API key."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    s = start_server(log, "--model", str(smollm2_gguf), "--model", f"second={smollm2_gguf}", "--api-key", KEY,
                     "--max-queue", str(MAX_QUEUE), "--max-concurrent", str(MAX_CONCURRENT),
                     "--sse-keepalive", str(KEEPALIVE_S))
    yield s
    stop(s)


@pytest.fixture(scope="module")
def name(smollm2_gguf) -> str:
    return smollm2_gguf.stem  # a file is served under its file name


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def raw(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def capital(client, name):
    """The greedy answer to QUESTION, with logprobs: the reference several tests compare against."""
    return client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=8,
                                          logprobs=True, top_logprobs=2)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def sse_lines(r: httpx.Response) -> tuple[list[dict], list[str]]:
    """(data objects, comment lines) of an SSE response, [DONE] checked and dropped."""
    events, comments, done = [], [], False
    for line in r.iter_lines():
        if line.startswith(":"):
            comments.append(line)
        elif line.startswith("data: "):
            assert not done, "data after [DONE]"
            if line == "data: [DONE]":
                done = True
            else:
                events.append(json.loads(line[6:]))
    assert done, "the stream did not end with [DONE]"
    return events, comments


def health(raw) -> dict:
    r = raw.get("/health")
    assert r.status_code == 200, r.text
    return r.json()


def model_health(raw, model: str) -> dict:
    return next(m for m in health(raw)["models"] if m["name"] == model)


# ------------------------------------------------------------------------------------------- the SDK, happy paths

def test_models_list_names_every_served_model_with_its_window(client, name):
    models = client.models.list().data
    assert [m.id for m in models] == [name, "second"]
    assert all(m.model_extra["context_window"] == 4096 for m in models)  # --ctx default, under the model's 8192
    assert client.models.retrieve("second").id == "second"


def test_chat_non_stream_and_stream_agree(client, capital, name):
    choice = capital.choices[0]
    assert capital.object == "chat.completion" and capital.model == name and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    events = list(client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=8,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"  # role first
    assert len({e.id for e in events}) == 1 and events[0].id.startswith("chatcmpl-")
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == choice.message.content  # streamed text equals the non-streamed at temperature 0
    finishes = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    streamed_lp = [t for e in events if e.choices and e.choices[0].logprobs for t in e.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed_lp] == \
           [(t.token, round(t.logprob, 4)) for t in choice.logprobs.content]
    assert events[-1].choices == [] and events[-1].usage == capital.usage  # include_usage: the last chunk
    assert all(e.usage is None for e in events[:-1])


def test_max_tokens_ends_with_length(client, capital, name):
    r = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert capital.choices[0].message.content.startswith(r.choices[0].message.content)


def test_stop_string_cuts_the_answer(client, capital, name):
    text = capital.choices[0].message.content
    word = text.split()[2]
    r = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=8, stop=[word, "zzz"])
    assert r.choices[0].message.content == text[: text.index(word)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_follow_the_answer(capital):
    choice = capital.choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)  # greedy
    assert all(t.logprob <= 0 for t in content)


def test_seed_makes_sampling_reproducible(client, name):
    a, b = (client.completions.create(model=name, prompt="My favourite animal is", temperature=1.0, seed=1234,
                                      max_tokens=5) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_n_choices(client, capital, name):
    r = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=8, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content == capital.choices[0].message.content for c in r.choices)
    assert r.usage.completion_tokens == 2 * capital.usage.completion_tokens
    assert r.usage.prompt_tokens == capital.usage.prompt_tokens


def test_developer_role_is_the_system_role(client, name):
    def ask(role):
        return client.chat.completions.create(model=name, temperature=0, max_tokens=4, messages=[
            {"role": role, "content": "You answer in French."}, *QUESTION]).choices[0].message.content
    assert ask("developer") == ask("system")


def test_completions_stream_and_echo(client, name):
    prompt = "Once upon a time"
    plain = client.completions.create(model=name, prompt=prompt, temperature=0, max_tokens=5)
    assert plain.object == "text_completion" and plain.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=name, prompt=prompt, temperature=0, max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    echoed = client.completions.create(model=name, prompt=[prompt], temperature=0, max_tokens=5, echo=True,
                                       logprobs=1)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    assert "".join(lp.tokens) == echoed.choices[0].text and lp.token_logprobs[0] is None


def test_requests_route_on_model(client):
    r = client.completions.create(model="second", prompt="Hello", temperature=0, max_tokens=2)
    assert r.model == "second" and r.usage.completion_tokens == 2


# ------------------------------------------------------------------------------------------- batch and serve agree

def test_batch_and_server_answer_the_same_bodies_identically(tmp_path, raw, smollm2_gguf, name):
    bodies = [
        ("/v1/chat/completions", {"model": name, "messages": QUESTION, "temperature": 0, "max_tokens": 4,
                                  "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"model": name, "messages": [{"role": "developer", "content": "Be brief."},
                                                              {"role": "user", "content": "Name a colour."}],
                                  "temperature": 0, "max_tokens": 3, "n": 2}),
        ("/v1/completions", {"model": name, "prompt": "The sky is", "temperature": 0, "max_tokens": 3, "echo": True,
                             "logprobs": 2}),
        ("/v1/completions", {"model": name, "prompt": [1, 2, 3], "temperature": 0, "max_tokens": 3,
                             "stop": [","]}),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}) + "\n"
                           for i, (url, body) in enumerate(bodies)))
    r = subprocess.run([sys.executable, "-m", "goinfer_cli.app", "batch", str(inp), "-o", str(out), "--model",
                        str(smollm2_gguf)], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    batch = {rec["custom_id"]: rec["response"]["body"] for rec in map(json.loads, out.read_text().splitlines())}
    for i, (url, body) in enumerate(bodies):
        resp = raw.post(url, json=body)
        assert resp.status_code == 200, resp.text
        served = resp.json()
        drop = ("id", "created", "timings")  # (the server's llama.cpp timings: wall-clock figures, like created)
        assert {k: v for k, v in served.items() if k not in drop} == \
               {k: v for k, v in batch[f"r{i}"].items() if k not in drop}, (url, body)


# ------------------------------------------------------------------------------------------- errors, raw HTTP

@pytest.mark.parametrize("body, param, words", [
    ({"messages": QUESTION, "temperature": "hot"}, "temperature", "number"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"temperature": 0}, "messages", "required"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": QUESTION, "frobnicate": 1}, "frobnicate", "unknown parameter"),
    ({"messages": QUESTION, "n": 99}, "n", "at most"),
    ({"messages": QUESTION, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]},
     "tools[0].function.parameters", "foo"),
    ({"messages": QUESTION, "functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_fields_are_400_naming_the_field(raw, name, body, param, words):
    err = error_of(raw.post("/v1/chat/completions", json={"model": name, **body}), 400)
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"


def test_completion_suffix_is_refused_by_name(raw, name):
    err = error_of(raw.post("/v1/completions", json={"model": name, "prompt": "def f(", "suffix": "return 1"}), 400)
    assert err["param"] == "suffix" and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize("content", [b'{"messages": [', b"", b"\xff\xfe{", b"nul"])
def test_malformed_json_is_400(raw, content):
    err = error_of(raw.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"}),
                   400)
    assert err["code"] == "invalid_json"


def test_a_body_that_is_not_an_object_is_400(raw):
    assert "JSON object" in error_of(raw.post("/v1/chat/completions", json=[1, 2]), 400)["message"]


def test_unknown_model_is_404_naming_it_and_the_served_models(raw, name):
    err = error_of(raw.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": QUESTION}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert "gpt-4o" in err["message"] and name in err["message"] and "second" in err["message"]
    assert error_of(raw.get("/v1/models/gpt-4o"), 404)["code"] == "model_not_found"


def test_model_is_required_when_several_are_served(raw):
    err = error_of(raw.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}), 400)
    assert err["param"] == "model"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_window_is_400_with_both_counts_before_any_stream(raw, name, stream):
    before = model_health(raw, name)
    r = raw.post("/v1/chat/completions", json={"model": name, "stream": stream, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hello " * 5000}]})
    err = error_of(r, 400)
    assert err["code"] == "context_length_exceeded"
    n_prompt = int(re.search(r"prompt has (\d+) tokens", err["message"]).group(1))
    assert n_prompt > 4096 and "context window is 4096" in err["message"]
    assert model_health(raw, name)["completed"] == before["completed"]  # refused before any work


def test_unknown_route_and_wrong_method(raw):
    err = error_of(raw.get("/v1/images/generations"), 404)
    assert err["code"] == "not_found" and "/v1/chat/completions" in err["message"]
    assert "POST /v1/embeddings" in err["message"]
    r = raw.get("/v1/chat/completions")
    assert error_of(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"


def _raw_exchange(url: str, head: bytes, body_parts=(), read_timeout: float = 30) -> tuple[int, dict, bytes]:
    """Send a request by hand (whatever the body framing), then read the whole answer."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as s:
        s.sendall(head)
        try:
            for part in body_parts:
                s.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head_text, _, body = data.partition(b"\r\n\r\n")
    lines = head_text.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def test_body_over_the_cap_is_413_from_content_length_before_reading(server, raw):
    cap = health(raw)["limits"]["max_body_bytes"]
    assert cap == 4 << 20  # derived: 32 bytes per token of a 4096 window is under the 4 MiB floor
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {cap + 1}\r\n\r\n").encode()
    status, headers, body = _raw_exchange(server.url, head)  # no body sent at all: the answer comes anyway
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert headers["connection"] == "close"


def test_chunked_body_over_the_cap_is_cut_off_with_413(server, raw):
    cap = health(raw)["limits"]["max_body_bytes"]
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    piece = b"x" * (256 << 10)
    parts = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (cap // len(piece) + 4) + [b"0\r\n\r\n"]
    status, _, body = _raw_exchange(server.url, head, parts)
    assert status == 413 and "chunked" in json.loads(body)["error"]["message"]
    # a chunked body under the cap is read as usual
    ok = json.dumps({"model": "second", "prompt": "Hi", "max_tokens": 1}).encode()
    status, _, body = _raw_exchange(server.url, head.replace(b"chat/completions", b"completions"),
                                    [b"%x\r\n%s\r\n0\r\n\r\n" % (len(ok), ok)])
    assert status == 200, body


def test_http_1_0_client_gets_a_stream_ended_by_close(server):
    body = json.dumps({"model": "second", "prompt": "Hi", "max_tokens": 1, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.0\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    status, headers, data = _raw_exchange(server.url, head, [body])
    assert status == 200 and "transfer-encoding" not in headers  # HTTP/1.0 has no chunked encoding
    assert data.rstrip().endswith(b"data: [DONE]")


# ------------------------------------------------------------------------------------------- auth

@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/chat/completions", "/nope"])
def test_every_route_needs_the_key(server, path):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        method = c.post if path == "/v1/chat/completions" else c.get
        err = error_of(method(path), 401)
        assert err["code"] == "invalid_api_key" and "missing" in err["message"]
        for headers in ({"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Bearer {KEY}x"}):
            assert error_of(method(path, headers=headers), 401)["code"] == "invalid_api_key", headers


def test_bearer_and_x_api_key_both_work(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert c.get("/health", headers={"authorization": f"bearer {KEY}"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_wrong_sdk_key_is_an_authentication_error(server, name):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=name, messages=QUESTION, max_tokens=1)


# ------------------------------------------------------------------------------------------- scheduling

def _completion(c: httpx.Client, body: dict) -> tuple[int, dict | None, str]:
    """(status, the answer as the client assembles it, raw text): a stream's pieces joined into choices."""
    if not body.get("stream"):
        r = c.post("/v1/completions", json=body)
        return r.status_code, (r.json() if r.status_code == 200 else None), r.text
    with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None, r.text
        events, _ = sse_lines(r)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for e in events:
        for ch in e["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            finish[ch["index"]] = ch["finish_reason"] or finish.get(ch["index"])
    return 200, {"choices": [{"index": i, "text": texts[i], "finish_reason": finish[i]} for i in sorted(texts)]}, ""


def _choices(answer: dict) -> list:
    return [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]]


def test_concurrent_requests_get_their_solo_replies(server, raw, name):
    # Greedy and seeded sampling, streamed and not, side by side (MAX_CONCURRENT at once, the rest queued):
    # each reply is, to the character, what the same body gets alone.
    bodies = [{"model": name, "prompt": f"Story {i}: once upon a time, in a land of {w},", "max_tokens": 24,
               "temperature": t, "seed": 40 + i, "stream": i % 2 == 0}
              for i, (w, t) in enumerate([("ice", 0), ("fire", 0.8), ("sand", 0.9), ("rain", 0)])]
    before = model_health(raw, name)
    results: list = [None] * len(bodies)

    def one(i):
        with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=300) as c:
            results[i] = _completion(c, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = model_health(raw, name)
    steps = after["decode_steps"] - before["decode_steps"]
    assert after["decoded_tokens"] - before["decoded_tokens"] > 1.3 * steps  # they shared decode steps
    for body, (status, answer, text) in zip(bodies, results):
        assert status == 200, text
        status, solo, text = _completion(raw, body)
        assert status == 200 and _choices(answer) == _choices(solo), body


def test_n_choices_equal_requests_with_successive_seeds(raw, name):
    # n = 3 evaluates the prompt once and decodes the three choices together; choice i samples with seed + i.
    body = {"model": name, "prompt": "My favourite fruit is", "max_tokens": 12, "temperature": 1.0, "seed": 7}
    status, many, text = _completion(raw, {**body, "n": 3})
    assert status == 200, text
    singles = [_completion(raw, {**body, "seed": 7 + i})[1]["choices"][0]["text"] for i in range(3)]
    assert [c["text"] for c in many["choices"]] == singles and len(set(singles)) > 1


def test_eight_mixed_clients_a_disconnect_and_429s_leave_the_server_serving(server, raw, name):
    # 8 clients at once (streams and plain answers) against MAX_CONCURRENT slots and MAX_QUEUE places: some get
    # 429, one stream's client leaves mid-way, the rest get exactly their solo replies (a token of one sequence
    # in another's reply would show), and afterwards the server serves as before.
    log_at = len(server.log_text())
    bodies = [{"model": name, "prompt": f"Count from {10 * i} to {10 * i + 5}:", "temperature": 0,
               "max_tokens": 24 + i, "stream": i % 2 == 1} for i in range(8)]
    leaver = {"model": name, "prompt": "Write a long story about a dragon.", "temperature": 0, "max_tokens": 200,
              "stream": True}
    results: list = [None] * 8
    barrier = threading.Barrier(9)

    def one(i):
        with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=300) as c:
            barrier.wait()
            results[i] = _completion(c, bodies[i])

    def leave():
        with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=300) as c:
            barrier.wait()
            with c.stream("POST", "/v1/completions", json=leaver) as r:
                if r.status_code == 200:
                    for n, _ in enumerate(r.iter_lines()):
                        if n >= 6:
                            break  # gone after a few tokens: the connection closes with the context

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)] + [threading.Thread(target=leave)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = [r[0] for r in results]
    assert all(s in (200, 429) for s in statuses), results
    assert 1 <= statuses.count(200) <= MAX_CONCURRENT + MAX_QUEUE and statuses.count(429) >= 1, statuses
    h = _wait_idle(raw, name)
    assert h["queued"] == 0 and h["running_sequences"] == 0 and h["rejected"] >= statuses.count(429)
    for body, (status, answer, text) in zip(bodies, results):
        if status == 429:
            continue
        assert _choices(answer) == _choices(_completion(raw, body)[1]), body
    assert "failed" not in server.log_text()[log_at:]
    status, answer, text = _completion(raw, bodies[0])  # still serving
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", text


def _wait_idle(raw, name: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = model_health(raw, name)
        if not h["busy"] and h["queued"] == 0:
            return h
        time.sleep(0.1)
    pytest.fail(f"{name} still busy after {timeout} s: {h}")


def _stopped_after(server: Served, since: int) -> list[int]:
    text = server.log_text()[since:]
    return [int(n) for n in re.findall(r"stopped after (\d+) tokens \(client disconnected\)", text)]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_stops_its_generation(server, raw, name, stream):
    before = _wait_idle(raw, name)
    log_at = len(server.log_text())
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                       "temperature": 0, "max_tokens": 200, "stream": stream}).encode()
    host, port = server.url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=120)
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    if stream:
        seen = b""
        while seen.count(b"data: ") < 4:  # a few tokens arrive, then the client goes away
            seen += s.recv(4096)
            assert b"[DONE]" not in seen and b"finish_reason\":\"" not in seen, seen
    else:
        deadline = time.monotonic() + 120
        while model_health(raw, name)["running_tokens"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    s.close()
    after = _wait_idle(raw, name)
    assert after["cancelled"] == before["cancelled"] + 1 and after["completed"] == before["completed"]
    stopped = _stopped_after(server, log_at)
    assert len(stopped) == 1 and stopped[0] < 200, server.log_text()[log_at:]
    assert "client disconnected" in server.log_text()[log_at:]


def test_a_long_prompt_gets_keep_alives_before_its_first_token(raw, name):
    story = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(30))
    with raw.stream("POST", "/v1/completions", json={"model": name, "prompt": story, "temperature": 0,
                                                     "max_tokens": 1, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = []
        for line in lines:
            if line:
                first.append(line)
            if line.startswith("data: "):
                break
        assert first[0] == ": keep-alive", first[:3]  # the prompt took longer than --sse-keepalive
        assert "data: [DONE]" in list(lines)


def test_a_cancelled_request_stops_between_prompt_chunks(monkeypatch, smollm2_gguf):
    # In process: the hook the server's disconnect detection relies on during a long prompt.
    import engine
    import engine.models.base as base
    from engine.errors import Cancelled
    from engine.requests.request import prepare, run

    model = engine.load_model(smollm2_gguf)
    monkeypatch.setattr(base, "PREFILL_CHUNK", 4)
    calls = []
    forward = model._forward
    model._forward = lambda *a: (calls.append(len(a[3])), forward(*a))[1]
    stop = threading.Event()
    req = parse_completion_request({"prompt": "one two three four five six seven eight nine ten", "max_tokens": 2})
    prep = prepare(model, req)
    stop.set()  # the client leaves before the prompt is processed
    with pytest.raises(Cancelled):
        list(run(model, prep, should_stop=stop.is_set))
    assert calls == [4]  # one chunk of the 10-token prompt, then it stopped


# ------------------------------------------------------------------------------------------- settings (no model)

def test_addresses():
    assert parse_addr("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_addr("[::1]:9000") == ("::1", 9000) and parse_addr("8081") == ("127.0.0.1", 8081)
    for bad in ("localhost", "127.0.0.1:99999", "::1:80", "[::1]", "host:port"):
        with pytest.raises(ServerConfigError):
            parse_addr(bad)
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.5.5", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.1"))


def test_settings_are_checked_before_anything_loads(tmp_path):
    with pytest.raises(ServerConfigError, match="API key"):
        ServerConfig(host="0.0.0.0").check()
    ServerConfig(host="0.0.0.0", api_key="k").check()
    with pytest.raises(ServerConfigError, match="both"):
        ServerConfig(tls_cert=tmp_path / "c.pem").check()
    with pytest.raises(ServerConfigError, match="no such file"):
        ServerConfig(tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem").check()
    with pytest.raises(ServerConfigError, match="max-queue"):
        ServerConfig(max_queue=-1).check()


def test_body_cap_is_derived_from_the_largest_window():
    class M:
        def __init__(self, window):
            self.window = window
    assert body_cap(ServerConfig(), [M(4096)]) == 4 << 20  # the floor
    assert body_cap(ServerConfig(), [M(4096), M(262144)]) == 32 * 262144
    assert body_cap(ServerConfig(max_body_bytes=1000), [M(262144)]) == 1000


def test_model_specs():
    assert parse_model_spec("small=smollm2-135m") == ("small", "smollm2-135m")
    assert parse_model_spec("/models/a.gguf") == (None, "/models/a.gguf")
    assert parse_model_spec("./x=y.gguf") == (None, "./x=y.gguf")  # a path holding '=' is not a name


# ------------------------------------------------------------------------------------------- startup and shutdown

def test_non_loopback_address_without_a_key_refuses_to_start(tmp_path):
    r = subprocess.run([sys.executable, "-m", "goinfer_cli.app", "serve", "--addr", "0.0.0.0:0", "--model",
                        str(tmp_path / "absent.gguf")], capture_output=True, text=True, cwd=ROOT, env=_env(),
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "API key" in r.stderr and "absent.gguf" not in r.stderr  # refused before the model is looked at


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_without_a_key_warns_serves_https_and_stops_on_sigint(tmp_path, smollm2_gguf):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    s = start_server(tmp_path / "tls.log", "--model", f"tiny={smollm2_gguf}", "--tls-cert", str(cert), "--tls-key",
                     str(key), "--max-body-bytes", "1000", "--max-queue", "0")
    try:
        banner = s.log_text()
        assert s.url.startswith("https://") and "no API key" in banner and "tiny" in banner
        assert "context 4096" in banner and "1000 bytes" in banner
        ctx = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=s.url, verify=ctx, timeout=60) as c:
            assert c.get("/health").json()["models"][0]["name"] == "tiny"  # no key needed without --api-key
            big = c.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 2000})
            assert big.status_code == 413
            tls_client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0,
                                       http_client=httpx.Client(verify=ctx))
            r = tls_client.completions.create(model="tiny", prompt="Hi", max_tokens=1, temperature=0)
            assert r.usage.completion_tokens == 1
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port is dropped, the server lives on
            httpx.get(s.url.replace("https", "http") + "/health", timeout=10)
        assert s.proc.poll() is None
    finally:
        rc = stop(s, signal.SIGINT)
    assert rc == 0, s.log_text()
    assert "SIGINT: shutting down" in s.log_text() and "Traceback" not in s.log_text()


def test_sigterm_stops_the_server_cleanly(server, raw):
    # Runs last in this module: it ends the shared server.
    assert health(raw)["status"] == "ok"
    assert stop(server, signal.SIGTERM) == 0
    log = server.log_text()
    assert "SIGTERM: shutting down" in log and log.rstrip().endswith("stopped") and "Traceback" not in log
