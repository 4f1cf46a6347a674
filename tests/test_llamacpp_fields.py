"""llama.cpp's request fields on /v1/chat/completions and /v1/completions do what docs/server.md's table says
("llama.cpp's request fields"): read into OpenAI's, run as llama.cpp's samplers, accepted without effect, or
refused naming the field; and a body as llama.cpp's web UI sends it gets an answer from the real server."""

from __future__ import annotations

import json
import math

import httpx
import pytest

import engine
from engine.api.llamacpp_fields import NO_LIMIT
from engine.api.openai import parse_chat_request, parse_completion_request
from engine.errors import RequestError
from engine.generation.sampler_chain import DEFAULT_ORDER as DEFAULT_SAMPLERS
from engine.requests.request import prepare
from tests.conftest import SERVER_KEY

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def chat(**fields):
    return parse_chat_request({"messages": ASK, **fields})


def completion(**fields):
    return parse_completion_request({"prompt": "Once", **fields})


def test_fields_read_into_openais():
    assert chat(n_predict=7).options.max_tokens == 7 and chat(n_predict=-1).options.max_tokens == NO_LIMIT
    assert chat(n_predict=7, max_tokens=7).options.max_tokens == 7
    r = chat(n_probs=3)
    assert r.logprobs and r.top_logprobs == 3
    c = completion(n_probs=2)
    assert c.logprobs and c.top_logprobs == 2
    assert chat(repeat_penalty=1.2).options.repetition_penalty == 1.2
    assert chat(repeat_last_n=16).options.penalty_last_n == 16
    assert chat(ignore_eos=True).ignore_eos and not chat().ignore_eos
    assert chat(sse_ping_interval=1).keepalive_s == 1.0 and chat(sse_ping_interval=-1).keepalive_s == math.inf
    assert chat().keepalive_s is None
    assert chat(timings_per_token=True).timings_per_token and not chat().timings_per_token
    assert chat(return_progress=True).return_progress and not chat().return_progress
    assert chat(max_tokens=-1).options.max_tokens == NO_LIMIT  # llama.cpp's (and its web UI's) "no limit"
    assert chat(chat_template_kwargs={"enable_thinking": False}).thinking == "off"


@pytest.mark.parametrize("fields", [
    {"cache_prompt": True}, {"cache_prompt": False}, {"id_slot": -1}, {"id_slot": 0}, {"reasoning_control": True},
    {"n_indent": 0}, {"t_max_predict_ms": 0},
    {"typical_p": 1.0}, {"top_n_sigma": -1}, {"dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2,
                                              "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":"]},
    {"xtc_probability": 0, "xtc_threshold": 0.1}, {"mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1},
    {"dynatemp_range": 0, "dynatemp_exponent": 1}, {"samplers": list(DEFAULT_SAMPLERS)},
    {"samplers": "edskypmxt"}, {"return_tokens": False}, {"return_progress": False}, {"typ_p": 1},
    {"backend_sampling": True},
    {"post_sampling_probs": False},
])
def test_no_ops_and_neutral_samplers_change_nothing(fields):
    assert chat(**fields) == chat() and completion(**fields) == completion()


@pytest.mark.parametrize("fields, param", [
    ({"typical_p": -0.1}, "typical_p"), ({"top_n_sigma": "wide"}, "top_n_sigma"),
    ({"dry_multiplier": -1}, "dry_multiplier"), ({"dry_base": 0.5}, "dry_base"),
    ({"dry_allowed_length": -1}, "dry_allowed_length"), ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"xtc_probability": 1.5}, "xtc_probability"), ({"xtc_threshold": -0.1}, "xtc_threshold"),
    ({"mirostat": 3}, "mirostat"), ({"mirostat_tau": -1}, "mirostat_tau"), ({"dynatemp_range": -0.5}, "dynatemp_range"),
    ({"min_keep": -1}, "min_keep"), ({"typ_p": 0.5, "typical_p": 0.9}, "typ_p"),
    ({"samplers": ["top_k", "magic"]}, "samplers"), ({"samplers": ["top_k", "top_k"]}, "samplers"),
    ({"samplers": 3}, "samplers"), ({"samplers": "kpq"}, "samplers"),
    ({"timings_per_token": "yes"}, "timings_per_token"), ({"return_tokens": "yes"}, "return_tokens"),
    ({"post_sampling_probs": 1}, "post_sampling_probs"),
    ({"n_predict": 0}, "n_predict"), ({"n_predict": 5, "max_tokens": 6}, "n_predict"),
    ({"n_probs": 21}, "n_probs"), ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repeat_penalty"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"sse_ping_interval": "1s"}, "sse_ping_interval"),
    ({"n_keep": 4}, "n_keep"),  # outside both dialects: still unknown
])
def test_refusals_name_the_field(fields, param):
    with pytest.raises(RequestError) as e:
        chat(**fields)
    assert e.value.param == param


def test_a_sampler_chain_that_leaves_samplers_out_turns_them_off():
    r = chat(samplers=["top_k", "temperature"], top_k=40, top_p=0.5, min_p=0.1, temperature=0.7)
    assert (r.options.top_k, r.options.top_p, r.options.min_p, r.options.temperature) == (40, 1.0, 0.0, 0.7)
    assert chat(samplers="kpm", temperature=0.2).options.temperature == 1.0  # no temperature in the chain
    assert chat(samplers="top_k;top_p;min_p;temperature", top_p=0.9).options.top_p == 0.9


def test_ignore_eos_bans_the_end_of_generation_tokens(smollm2_gguf):
    model = engine.load_model(smollm2_gguf, selftest=False)
    prep = prepare(model, chat(ignore_eos=True, n_predict=4), window=256)
    bias = prep.choices[0].sampling.logit_bias
    assert set(model.tokenizer.eog_ids) <= set(bias) and all(bias[t] == -math.inf for t in model.tokenizer.eog_ids)


# ---------------------------------------------------------------------------------------------- over HTTP

# A chat as llama.cpp's web UI sends it (tools/server/webui: chat.service.ts builds the body, its settings'
# defaults from settings-config.ts; read at ggml-org/llama.cpp 00fce05): streamed with return_progress, the
# sampler settings and chain from the settings, max_tokens -1 (no limit)
WEB_UI = {"stream": True, "return_progress": True, "reasoning_format": "auto", "temperature": 0.8, "max_tokens": -1,
          "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
          "xtc_probability": 0.0, "xtc_threshold": 0.1, "typ_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0,
          "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75,
          "dry_allowed_length": 2, "dry_penalty_last_n": -1,
          "samplers": ["top_k", "typ_p", "top_p", "min_p", "temperature"],
          "backend_sampling": False}


def test_a_web_ui_body_streams_an_answer_with_progress_and_timings(server, name):
    # a seed and ignore_eos with a limit (custom parameters in the web UI): the test's reply is short and its own
    body = {**WEB_UI, "messages": ASK, "model": name, "seed": 3, "max_tokens": 12, "ignore_eos": True}
    events = _events(server, "/v1/chat/completions", body)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress and progress[-1]["processed"] == progress[-1]["total"] > 10
    assert all(e["choices"] == [] for e in events if "prompt_progress" in e)
    assert events.index(next(e for e in events if "prompt_progress" in e)) < \
        events.index(next(e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert text and [e["choices"][0]["finish_reason"] for e in finish] == ["length"]  # ignore_eos: all 12
    _timings_ok(finish[0]["timings"], predicted_n=12)


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120, headers={"Authorization": f"Bearer {SERVER_KEY}"})


def _events(server, path, body):
    with httpx.stream("POST", server.url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {SERVER_KEY}"}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _timings_ok(t, prompt_n=None, predicted_n=None):
    assert set(t) == {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                      "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert predicted_n is None or t["predicted_n"] == predicted_n
    assert prompt_n is None or t["prompt_n"] + t["cache_n"] == prompt_n


def test_answers_carry_llamacpps_timings(server, name):
    body = {"model": name, "messages": ASK, "temperature": 0, "max_tokens": 6}
    whole = _post(server, "/v1/chat/completions", body).json()
    _timings_ok(whole["timings"], whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"])
    events = _events(server, "/v1/chat/completions", {**body, "stream": True})
    timed = [e for e in events if "timings" in e]
    assert len(timed) == 1 and timed[0]["choices"][0]["finish_reason"] == "length"  # the finish chunk only
    _timings_ok(timed[0]["timings"], predicted_n=6)
    events = _events(server, "/v1/chat/completions", {**body, "stream": True, "timings_per_token": True})
    assert all("timings" in e for e in events)
    assert [e["timings"]["predicted_n"] for e in events][-1] == 6


def test_the_completion_route_answers_in_llamacpps_shape(server, name):
    whole = _post(server, "/completion", {"prompt": "The capital of France is", "n_predict": 5, "temperature": 0})
    assert whole.status_code == 200, whole.text
    r = whole.json()
    assert r["stop"] is True and r["content"] and r["tokens_predicted"] == 5 and r["stop_type"] == "limit"
    assert r["model"] == name and r["tokens_evaluated"] > 3
    _timings_ok(r["timings"], r["tokens_evaluated"], 5)
    events = _events(server, "/completion", {"prompt": "The capital of France is", "n_predict": 5, "temperature": 0,
                                             "stream": True})
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == r["content"] and events[-1]["tokens_predicted"] == 5
    stopped = _post(server, "/completion", {"prompt": "The capital of France is", "n_predict": 20, "temperature": 0,
                                            "stop": [r["content"].split()[-1]]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == r["content"].split()[-1]
    bad = _post(server, "/completion", {"prompt": "x", "mirostat": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mirostat"


def test_the_completion_route_returns_token_ids_and_probabilities(server, name):
    body = {"prompt": "The capital of France is", "n_predict": 5, "temperature": 0, "n_probs": 3}
    r = _post(server, "/completion", {**body, "return_tokens": True}).json()
    ids, probs = r["tokens"], r["completion_probabilities"]
    assert len(ids) == 5 and [p["id"] for p in probs] == ids
    assert "".join(bytes(p["bytes"]).decode("utf-8", "replace") for p in probs) == r["content"]
    for p in probs:  # greedy: each token is the likeliest, its top_logprobs the model's own (log-softmax)
        assert p["top_logprobs"][0]["id"] == p["id"] and len(p["top_logprobs"]) == 3
        assert p["logprob"] == p["top_logprobs"][0]["logprob"] < 0
        assert sum(math.exp(t["logprob"]) for t in p["top_logprobs"]) < 1
    assert _post(server, "/completion", body).json()["tokens"] == []  # only when asked for, as llama.cpp's
    events = _events(server, "/completion", {**body, "stream": True})
    assert [t for e in events for t in e["tokens"]] == ids and events[-1]["tokens"] == []
    assert [p["id"] for e in events for p in e.get("completion_probabilities", [])] == ids
    # post_sampling_probs: the probabilities of what each token was drawn from, after the samplers
    post = _post(server, "/completion", {**body, "post_sampling_probs": True}).json()["completion_probabilities"]
    assert all(p["prob"] == 1.0 and p["top_probs"] == [{**p["top_probs"][0], "prob": 1.0}] for p in post)
    sampled = _post(server, "/completion", {**body, "post_sampling_probs": True, "temperature": 1.0, "top_k": 3,
                                            "seed": 5}).json()["completion_probabilities"]
    for p in sampled:  # top_k 3: the three kept share all the probability; the drawn one is among them
        assert len(p["top_probs"]) == 3 and math.isclose(sum(t["prob"] for t in p["top_probs"]), 1.0, rel_tol=1e-6)
        assert p["prob"] == next(t["prob"] for t in p["top_probs"] if t["id"] == p["id"]) > 0


def test_post_sampling_probs_on_the_openai_routes(server, name):
    body = {"model": name, "messages": ASK, "max_tokens": 4, "temperature": 0.7, "top_k": 2, "seed": 1,
            "logprobs": True, "top_logprobs": 2, "post_sampling_probs": True}
    content = _post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"} and 0 < entry["prob"] <= 1
        assert math.isclose(sum(t["prob"] for t in entry["top_probs"]), 1.0, rel_tol=1e-6)
    streamed = [c for e in _events(server, "/v1/chat/completions", {**body, "stream": True}) if e["choices"]
                for c in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [e["id"] for e in streamed] == [e["id"] for e in content]  # the same seed: the same draws


# A prompt that repeats itself: greedy decoding goes on repeating; DRY pushes the continuing token down
LOOP = "red green blue red green blue red green blue red green"


@pytest.mark.parametrize("route", ["/completion", "/v1/completions"])
def test_llamacpps_samplers_change_what_is_drawn(server, name, route):
    body = {"model": name, "prompt": LOOP, "max_tokens": 1, "temperature": 0}
    plain = _post(server, route, body).json()
    text = plain["content"] if route == "/completion" else plain["choices"][0]["text"]
    assert text.strip() == "blue"
    dry = _post(server, route, {**body, "dry_multiplier": 4.0, "dry_base": 2.0, "dry_allowed_length": 2}).json()
    assert (dry["content"] if route == "/completion" else dry["choices"][0]["text"]).strip() != "blue"
    for fields in ({"typical_p": 0.5}, {"top_n_sigma": 1.0}, {"xtc_probability": 1.0, "xtc_threshold": 0.05},
                   {"mirostat": 2, "mirostat_tau": 3.0}, {"dynatemp_range": 0.5}, {"samplers": "tkp", "top_p": 0.5}):
        r = _post(server, route, {**body, "temperature": 0.8, "seed": 2, "max_tokens": 6, **fields})
        assert r.status_code == 200, (fields, r.text)


def test_props_and_slots(server, name):
    headers = {"Authorization": f"Bearer {SERVER_KEY}"}
    props = httpx.get(server.url + "/props", headers=headers).json()
    settings = props["default_generation_settings"]
    assert props["model_alias"] == name and settings["n_ctx"] > 0 and "im_start" in props["chat_template"]
    assert props["total_slots"] >= 1 and props["modalities"] == {"vision": False, "audio": False}
    assert set(DEFAULT_SAMPLERS) >= set(settings["params"]["samplers"])
    slots = httpx.get(server.url + "/slots", params={"model": name}, headers=headers).json()
    assert len(slots) == props["total_slots"] and all(s["n_ctx"] == settings["n_ctx"] for s in slots)
    assert not any(s["is_processing"] for s in slots)
    assert httpx.get(server.url + "/props", params={"model": "nope"}, headers=headers).status_code == 404
