"""Models loaded and unloaded while the server runs (`serve --allow-admin`, engine/server/admin.py), over real
HTTP: a loaded model answers as the same model loaded at start would; an unloaded one is a 404 at once; a running
request finishes within the drain wait; refusals are clear."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import KIT as FAMILIES, in_kit, needs_kit
from tests.test_cli import goinfer
from tests.test_server import start_server, stop

KEY = "admin-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
KIT = FAMILIES / "qwen3" / "tiny-qwen3-a.Q8_0.gguf"
ASK = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def admin(tmp_path_factory, smollm2_gguf):
    s = start_server(tmp_path_factory.mktemp("serve-admin") / "serve.log", "--model", f"smol={smollm2_gguf}",
                     "--api-key", KEY, "--allow-admin", "--unload-drain-wait", "120", "--no-selftest")
    yield s
    stop(s)


def post(server, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=timeout)


@needs_kit
def test_a_model_loaded_at_runtime_answers_and_an_unloaded_one_is_gone(admin):
    import engine
    from engine.api.openai import parse_chat_request
    from engine.requests.request import execute

    r = post(admin, "/admin/models/load", {"model": str(KIT), "name": "kit", "ctx": 512})
    assert r.status_code == 200 and r.json()["id"] == "kit" and r.json()["context_window"] == 512
    names = [m["id"] for m in httpx.get(admin.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]]
    assert names == ["smol", "kit"]
    answer = post(admin, "/v1/chat/completions", {"model": "kit", **ASK})
    want = execute(engine.load_model(str(KIT), selftest=False), parse_chat_request(ASK)).choices[0].text
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == want
    listed = httpx.get(admin.url + "/admin/models", headers=AUTH, timeout=30).json()["data"]
    assert [m["name"] for m in listed] == ["smol", "kit"] and listed[1]["path"] == str(KIT)

    r = post(admin, "/admin/models/unload", {"name": "kit"})
    assert r.status_code == 200 and r.json() == {"name": "kit", "unloaded": True, "drained": True}
    gone = post(admin, "/v1/chat/completions", {"model": "kit", **ASK})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert post(admin, "/v1/chat/completions", {"model": "smol", **ASK}).status_code == 200  # the other stays


def test_an_unload_lets_a_running_request_finish(admin, smollm2_gguf):
    assert post(admin, "/admin/models/load", {"model": str(smollm2_gguf), "name": "second"}).status_code == 200
    long = {"model": "second", "messages": [{"role": "user", "content": "Count on and on"}], "max_tokens": 300,
            "temperature": 0, "logit_bias": {"0": -100, "1": -100, "2": -100}}  # no end of text: all 300 tokens
    running = {}
    t = threading.Thread(target=lambda: running.setdefault("r", post(admin, "/v1/chat/completions", long)))
    t.start()
    deadline = time.monotonic() + 60
    while not httpx.get(admin.url + "/health", headers=AUTH, timeout=10).json()["models"][-1]["running_requests"]:
        assert time.monotonic() < deadline and t.is_alive(), "the long request never ran"
        time.sleep(0.02)
    r = post(admin, "/admin/models/unload", {"name": "second"})  # drain wait 120 s: a loaded 2-core machine
    t.join(180)
    assert r.status_code == 200 and r.json()["drained"] is True
    assert running["r"].status_code == 200 and running["r"].json()["usage"]["completion_tokens"] == 300


@pytest.mark.parametrize("path,body,status,param", [
    pytest.param("/admin/models/load", {"model": str(KIT), "name": "smol"}, 409, "name", marks=needs_kit),
    ("/admin/models/load", {"name": "x"}, 400, "model"),
    ("/admin/models/load", {"model": "/no/such/model.gguf"}, 400, "model"),
    ("/admin/models/unload", {"name": "nope"}, 404, "name")])
def test_admin_refusals(admin, path, body, status, param):
    r = post(admin, path, body)
    assert r.status_code == status, r.text
    assert param is None or r.json()["error"]["param"] == param


def test_admin_needs_the_flag_and_a_key(admin, smollm2_gguf, tmp_path):
    assert httpx.get(admin.url + "/admin/models", timeout=10).status_code == 401  # the key guards it
    r = goinfer("serve", "--model", str(smollm2_gguf), "--allow-admin")
    assert r.returncode == 2 and "--allow-admin needs an API key" in r.stderr
    s = start_server(tmp_path / "plain.log", "--model", str(smollm2_gguf), "--api-key", KEY, "--no-selftest")
    try:
        assert httpx.get(s.url + "/admin/models", headers=AUTH, timeout=10).status_code == 404  # no flag: no route
    finally:
        stop(s)


def test_a_model_loaded_with_a_lora_adapter_answers_as_the_merge_by_hand(admin, tmp_path):
    import engine
    from engine.api.openai import parse_chat_request
    from engine.requests.request import execute
    from tests.test_lora import make_adapter, merged_checkpoint

    base = in_kit("llama", "hf")
    pairs = make_adapter(tmp_path / "tuned", base)
    r = post(admin, "/admin/models/load", {"model": str(base), "lora": str(tmp_path / "tuned"), "lora_scale": 0.5})
    assert r.status_code == 200 and r.json()["id"] == "hf+tuned"
    answer = post(admin, "/v1/chat/completions", {"model": "hf+tuned", **ASK}).json()["choices"][0]["message"]
    by_hand = engine.load_model(merged_checkpoint(tmp_path / "merged", base, pairs, 2.0 * 0.5), selftest=False)
    assert answer["content"] == execute(by_hand, parse_chat_request(ASK)).choices[0].text
    assert post(admin, "/admin/models/unload", {"name": "hf+tuned"}).status_code == 200
    for body, param in (({"model": str(base), "lora": str(tmp_path / "nowhere")}, "lora"),
                        ({"model": str(base), "lora_scale": 2}, "lora_scale")):
        bad = post(admin, "/admin/models/load", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
