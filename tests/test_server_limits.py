"""Server limits as a hostile or careless client meets them (a real `goinfer serve`, the real default model): a
cap on open connections (503 with Retry-After beyond it), a deadline for a request's headers and body
(slowloris), a bound on chunked trailers, a Host check on a keyless loopback server (DNS rebinding), and
admission before a request's tokenising (a request that gets a 429 costs no prompt work), and answers sent without
waiting on the client's delayed ACK (TCP_NODELAY)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

import engine
from engine.server import ServedModel, Server, ServerConfig
from tests.test_server import start_server, stop


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf):
    s = start_server(tmp_path_factory.mktemp("log") / "serve.log", "--model", str(smollm2_gguf),
                     "--max-connections", "3", "--read-deadline", "1.5")
    yield s
    stop(s)


def _connect(url: str) -> socket.socket:
    host, port = url.split("//")[1].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            break
        if not data:
            break
        out += data
    return out


def test_connections_past_the_cap_get_503_with_retry_after(served):
    idle = [_connect(served.url) for _ in range(3)]
    try:
        time.sleep(0.3)
        r = httpx.get(served.url + "/health", timeout=10)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections"
    finally:
        for s in idle:
            s.close()
    time.sleep(0.3)
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200  # the places came back


def test_a_client_that_sends_its_request_too_slowly_is_cut_off(served):
    s = _connect(served.url)
    t0 = time.monotonic()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        for _ in range(20):  # a header byte now and then, each well within any per-read timeout
            s.sendall(b"X")
            time.sleep(0.25)
    except OSError:
        pass  # cut off: what this test wants
    s.settimeout(5)
    _read_all(s)
    assert time.monotonic() - t0 < 4.5  # the 1.5 s deadline, not the 5 s this client wanted
    s.close()
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200


def test_endless_chunked_trailers_are_refused(served):
    s = _connect(served.url)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n"
              + b"X-Trailer: y\r\n" * 150 + b"\r\n")
    s.settimeout(10)
    reply = _read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]


@pytest.mark.parametrize("host, status", [("evil.example", 403), ("localhost:8080", 200), ("127.0.0.1", 200),
                                          ("[::1]:9", 200)])
def test_a_keyless_loopback_server_answers_only_to_loopback_host_names(served, host, status):
    r = httpx.get(served.url + "/health", headers={"Host": host}, timeout=10)
    assert r.status_code == status
    if status == 403:
        assert r.json()["error"]["code"] == "host_not_allowed"


def test_a_request_refused_for_a_full_queue_is_not_tokenised(monkeypatch, smollm2_gguf):
    import engine.server.generating as generating

    model = engine.load_model(smollm2_gguf)
    server = Server([ServedModel.of("m", model, 512)], ServerConfig(port=0, max_queue=0, max_concurrent=1),
                    log=lambda line: None)
    server.start()
    prepared = []
    real = generating.prepare
    monkeypatch.setattr(generating, "prepare", lambda *a, **k: prepared.append(1) or real(*a, **k))
    try:
        long = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                kwargs={"json": {"prompt": "Count slowly:", "max_tokens": 200, "temperature": 0,
                                                 "logit_bias": {"0": -100, "2": -100}}, "timeout": 120})
        long.start()
        deadline = time.monotonic() + 60
        while not server.state.schedulers["m"].health()["running_requests"] and time.monotonic() < deadline:
            time.sleep(0.02)
        before = len(prepared)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 2000, "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 429 and json.loads(r.text)["error"]["code"] == "queue_full"
        assert len(prepared) == before  # refused before its 2,000 words were tokenised
        long.join(120)
    finally:
        server.stop()


def test_each_model_takes_its_own_ctx_and_a_bad_option_is_one_line(tmp_path, smollm2_gguf):
    import httpx

    from engine.server.config import ServerConfigError, split_model_options
    from tests.test_cli import goinfer
    from tests.test_server import start_server, stop

    assert split_model_options("a,b.gguf,ctx=512,quant=f32") == ("a,b.gguf", {"ctx": "512", "quant": "f32"})
    assert split_model_options("m.gguf,colour=red") == ("m.gguf,colour=red", {})  # not an option: part of REF
    with pytest.raises(ServerConfigError):
        split_model_options("m.gguf,ctx=1,ctx=2")
    s = start_server(tmp_path / "serve.log", "--model", f"small={smollm2_gguf},ctx=256", "--model",
                     f"big={smollm2_gguf}", "--ctx", "2048", "--no-selftest")
    try:
        windows = {m["id"]: m["context_window"] for m in httpx.get(s.url + "/v1/models", timeout=30).json()["data"]}
        assert windows == {"small": 256, "big": 2048}
    finally:
        stop(s)
    for option in ("ctx=8", "quant=q2", "backend=tpu"):
        r = goinfer("serve", "--model", f"{smollm2_gguf},{option}")
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and option.split("=")[0] in r.stderr


def test_an_api_key_file_holds_several_keys(tmp_path, smollm2_gguf):
    from engine.server import ServerConfigError
    from tests.test_cli import goinfer

    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nalpha-key\n\n  beta-key  \n")
    model = engine.load_model(smollm2_gguf, selftest=False)
    server = Server([ServedModel.of("m", model, 512)], ServerConfig(port=0, api_key="cli-key", api_key_file=keys),
                    log=lambda line: None)
    server.start()
    try:
        for key, status in (("alpha-key", 200), ("beta-key", 200), ("cli-key", 200), ("# team keys", 401),
                            ("gamma", 401)):
            r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert r.status_code == status, key
    finally:
        server.stop()
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n")
    for path in (empty, tmp_path / "absent.txt"):
        with pytest.raises(ServerConfigError, match="--api-key-file"):
            ServerConfig(port=0, api_key_file=path).check()
    r = goinfer("serve", "--api-key-file", str(empty), "--addr", "0.0.0.0:0")
    assert r.returncode == 2 and "--api-key-file" in r.stderr and r.stderr.strip().count("\n") == 0
    assert ServerConfig(host="0.0.0.0", api_key_file=keys).check() is None  # a key file makes a public address ok


def test_connections_send_without_waiting_for_the_clients_ack(monkeypatch, smollm2_gguf):
    """Every accepted connection has TCP_NODELAY: without it Nagle's algorithm holds an answer's body until the
    client ACKs its headers, which clients delay by up to 40 ms, so every request took >= 40 ms."""
    import engine.server.handler as handler

    flags = []
    real_setup = handler.Handler.setup

    def setup(self):
        real_setup(self)
        flags.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(handler.Handler, "setup", setup)
    server = Server([ServedModel.of("m", engine.load_model(smollm2_gguf), 512)], ServerConfig(port=0),
                    log=lambda line: None)
    server.start()
    try:
        with httpx.Client(timeout=30) as c:
            assert c.get(server.url + "/v1/models").status_code == 200
            assert c.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
    assert flags and all(flags)
