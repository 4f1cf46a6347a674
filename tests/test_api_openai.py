"""The OpenAI wire layer: request bodies -> engine requests (pure), and the response objects on the real model."""

from __future__ import annotations

import math

import pytest

import engine
from engine.api.openai import parse_chat_request, parse_completion_request, parse_request
from engine.api.openai_objects import error_body
from engine.batch.runner import run_request
from engine.errors import RequestError
from engine.requests.prompts import encode_prompt
from engine.requests.request import API_DEFAULTS, SamplingOptions, apply_defaults

USER = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def refused(parse, body) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(body)
    return e.value


# ------------------------------------------------------------------------------------------- parsing (no model)

def test_chat_body_maps_onto_the_engine_request():
    req = parse_chat_request({"model": "whatever", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c"}],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": "\n",
        "presence_penalty": 0.1, "frequency_penalty": -0.2, "logit_bias": {"42": -100}, "logprobs": True,
        "top_logprobs": 3, "n": 1, "user": "u1"})
    assert req.kind == "chat"
    assert req.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": ""}, {"role": "user", "content": "c"})
    o = req.options
    assert (o.max_tokens, o.temperature, o.top_p, o.top_k, o.seed, o.stop) == (7, 0.5, 0.9, 5, 3, ("\n",))
    assert (o.presence_penalty, o.frequency_penalty, o.logit_bias) == (0.1, -0.2, {42: -100.0})
    assert req.logprobs and req.top_logprobs == 3 and req.model == "whatever"
    assert o.min_p is None and o.repetition_penalty is None  # unset stays unset, for the runner to fill


def test_unset_settings_fall_through_flags_then_api_defaults():
    body_says = parse_chat_request({"messages": USER, "temperature": 0.3, "max_tokens": 9})
    flags = SamplingOptions(temperature=0.0, max_tokens=100, seed=7)
    req = apply_defaults(body_says, flags, system="sys")
    assert req.options.temperature == 0.3 and req.options.max_tokens == 9  # the body wins
    assert req.options.seed == 7  # the flag fills what the body left unset
    final = req.options.fill(API_DEFAULTS)
    assert final.top_p == 1.0 and final.top_k == 0 and final.seed == 7
    assert parse_chat_request({"messages": USER}).options.fill(API_DEFAULTS).temperature == 1.0
    assert parse_chat_request({"messages": USER}).options.fill(API_DEFAULTS).max_tokens == 512
    assert req.messages[0] == {"role": "system", "content": "sys"}
    with_own = apply_defaults(parse_chat_request({"messages": [{"role": "system", "content": "mine"}] + USER}),
                              system="sys")
    assert [m["content"] for m in with_own.messages] == ["mine", USER[0]["content"]]


@pytest.mark.parametrize("body, param, words", [
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions", "functions"),
    ({"messages": USER + [{"role": "function", "content": "x", "name": "f"}]}, "messages[1].role", "function"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "data:"}}]}]},
     "messages[0].content[1]", "image"),
    ({"messages": USER, "n": 17}, "n", "at most 16"),
    ({"messages": USER, "response_format": {"type": "grammar"}}, "response_format.type", "json_schema"),
    ({"messages": USER, "frobnicate": 1}, "frobnicate", "unknown parameter"),
])
def test_what_the_runner_cannot_do_is_refused_by_name(body, param, words):
    e = refused(parse_chat_request, body)
    assert e.param == param and words in str(e)
    assert e.code in ("unsupported_parameter", "unsupported_value")


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": USER, "temperature": 3}, "temperature"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": True}, "max_tokens"),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]},
     "tools[0].function.parameters"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls[0]"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z"}}}}}},
     "response_format.json_schema.schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
])
def test_invalid_fields_are_named(body, param):
    e = refused(parse_chat_request, body)
    assert e.param == param, str(e)
    assert str(e).startswith(param.split("[")[0])
    assert error_body(e)["error"] == {"message": str(e), "type": "invalid_request_error", "param": param,
                                      "code": e.code}


def test_completion_body():
    req = parse_completion_request({"prompt": ["Hello"], "max_tokens": 3, "logprobs": 2, "echo": True})
    assert req.kind == "completion" and req.prompt == "Hello" and req.echo
    assert req.logprobs and req.top_logprobs == 2 and req.options.max_tokens == 3
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    assert not parse_completion_request({"prompt": "x"}).logprobs
    assert refused(parse_completion_request, {"prompt": ["a", "b"]}).param == "prompt"
    assert refused(parse_completion_request, {"prompt": "a", "best_of": 3}).param == "best_of"
    assert refused(parse_completion_request, {"prompt": "a", "n": 17}).param == "n"
    assert parse_completion_request({"prompt": "a", "n": 3}).n == 3
    assert refused(parse_completion_request, {"prompt": "a", "n": 2, "best_of": 1}).param == "best_of"
    assert refused(parse_completion_request, {"prompt": "a", "suffix": "z"}).param == "suffix"
    assert refused(parse_completion_request, {"prompt": "a", "logprobs": 6}).param == "logprobs"
    assert refused(parse_completion_request, {}).code == "missing_required_parameter"
    assert refused(lambda b: parse_request("/v1/embeddings", b), {"input": "x"}).code == "invalid_url"


# ------------------------------------------------------------------------------------------- responses (real model)

@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return engine.load_model(smollm2_gguf)


def test_chat_completion_object_matches_plain_generation(smol):
    body = run_request(smol, parse_chat_request({"messages": USER, "temperature": 0, "max_tokens": 4}))
    ids = encode_prompt(smol, smol.render_chat(USER))
    events = list(engine.generate(smol, ids, max_tokens=4, temperature=0))
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int) and body["model"] == smol.name
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "".join(e.text for e in events)
    assert choice["finish_reason"] == events[-1].finish_reason == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 4, "total_tokens": len(ids) + 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # run alone: nothing reused


def test_chat_logprobs_follow_openai_shape(smol):
    body = run_request(smol, parse_chat_request({"messages": USER, "temperature": 0, "max_tokens": 3,
                                                 "logprobs": True, "top_logprobs": 3}))
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    ids = encode_prompt(smol, smol.render_chat(USER))
    first = smol.next_logprobs(ids)  # an independent forward pass: the numbers must agree
    entry = content[0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(entry["bytes"]).decode() == entry["token"]
    assert len(entry["top_logprobs"]) == 3
    best = entry["top_logprobs"]
    assert [t["logprob"] for t in best] == sorted((t["logprob"] for t in best), reverse=True)
    assert best[0]["token"] == entry["token"]  # greedy picks the most likely token
    assert math.isclose(entry["logprob"], float(first.max()), abs_tol=1e-3)
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]


def test_completion_with_echo_and_logprobs(smol):
    body = run_request(smol, parse_completion_request({"prompt": "Once upon a time", "temperature": 0,
                                                       "max_tokens": 2, "logprobs": 2, "echo": True}))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"].startswith("Once upon a time") and len(choice["text"]) > len("Once upon a time")
    lp = choice["logprobs"]
    n_prompt = body["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 2 == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"]) == choice["text"]


def test_stop_string_and_seed(smol):
    greedy = run_request(smol, parse_chat_request({"messages": USER, "temperature": 0, "max_tokens": 8}))
    text = greedy["choices"][0]["message"]["content"]
    word = text.split()[1]
    cut = run_request(smol, parse_chat_request({"messages": USER, "temperature": 0, "max_tokens": 8,
                                                "stop": [word]}))
    assert cut["choices"][0]["message"]["content"] == text[: text.index(word)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    a, b = (run_request(smol, parse_completion_request({"prompt": "The sky", "max_tokens": 4, "seed": 11}))
            for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_token_prompt_outside_the_vocabulary_is_refused(smol):
    with pytest.raises(RequestError) as e:
        run_request(smol, parse_completion_request({"prompt": [1, smol.vocab_size], "max_tokens": 1}))
    assert e.value.param == "prompt" and str(smol.vocab_size) in str(e.value)


def test_generate_reports_top_logprobs_only_when_asked(smol):
    ids = smol.tokenizer.encode("Once upon a time")
    plain = list(engine.generate(smol, ids, max_tokens=2, temperature=0))
    asked = list(engine.generate(smol, ids, max_tokens=2, temperature=0, top_logprobs=4))
    assert all(e.top_logprobs is None for e in plain)
    assert [e.token for e in asked] == [e.token for e in plain]
    row = smol.next_logprobs(ids)
    top = asked[0].top_logprobs
    assert [t for t, _ in top] == [int(i) for i in (-row).argsort(kind="stable")[:4]]
    assert all(math.isclose(lp, float(row[t]), abs_tol=1e-3) for t, lp in top)


def test_tools_tool_messages_and_response_formats_parse():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    req = parse_chat_request({"messages": msgs, "tools": tools, "tool_choice": "required"})
    assert req.tool_choice == "required" and req.tool_names == {"get_weather"} and req.grammar.what == "tool_calls"
    assert req.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert req.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert parse_chat_request({"messages": USER, "tools": tools, "tool_choice": "none"}).grammar is None
    assert parse_chat_request({"messages": USER, "response_format": {"type": "json_object"}}).grammar.what == "json_object"
    assert parse_completion_request({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "integer"}}}}).grammar.what == "json_schema"
