"""Every wire format's parser, and the request preparation behind it, on generated bodies of every shape: each
body either makes a request or is refused with a client error (4xx) naming what is wrong; never an unexpected
exception (which the server would answer with a 500, and `goinfer batch` would record as an internal error).

Bodies are valid ones with random parts replaced (wrong types at every field, huge numbers, deep nesting,
unicode, nulls), known field names added with random values, or random JSON altogether. Derandomized with no
example database, so the CI run is the same every time; GOINFER_FUZZ_EXAMPLES raises the count for a long run
by hand (docs/server.md states the last one).
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine.api import anthropic, llamacpp, ollama, responses
from engine.api.openai import CHAT_URL, COMPLETIONS_URL
from engine.api.openai_objects import error_status
from engine.batch.io import read_input
from engine.errors import GoinferError
from engine.requests.prompts import prompt_ids
from engine.requests.request import prepare
from engine.server.handler import TABLE

EXAMPLES = int(os.environ.get("GOINFER_FUZZ_EXAMPLES", "500"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
VALID = {
    CHAT_URL: {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                          {"role": "assistant", "content": None, "tool_calls": [
                                              {"id": "c1", "type": "function",
                                               "function": {"name": "get_weather", "arguments": "{}"}}]},
                                          {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
               "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "stop": ["\n"], "seed": 1, "n": 1,
               "logprobs": True, "top_logprobs": 2, "logit_bias": {"1": 2}, "tools": [TOOL], "tool_choice": "auto",
               "response_format": {"type": "json_object"}, "stream": False,
               "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low",
               "reasoning_format": "deepseek", "thinking_token_budget": 8, "n_predict": 4, "cache_prompt": True,
               "samplers": "kpmt", "ignore_eos": False, "sse_ping_interval": 1, "typical_p": 1.0},
    COMPLETIONS_URL: {"model": "m", "prompt": "Once", "max_tokens": 4, "echo": True, "logprobs": 2, "stop": "x",
                      "presence_penalty": 0.1, "frequency_penalty": 0.1, "temperature": 0.7, "typical_p": 0.9,
                      "top_n_sigma": 2.0, "xtc_probability": 0.5, "xtc_threshold": 0.1, "dry_multiplier": 0.5,
                      "dry_sequence_breakers": ["\n"], "min_keep": 1, "dynatemp_range": 0.2,
                      "samplers": "edskypmxt", "post_sampling_probs": True},
    anthropic.MESSAGES_URL: {"model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
                             "messages": [{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": [
                                              {"type": "thinking", "thinking": "Greet.", "signature": ""},
                                              {"type": "text", "text": "Hello"}]},
                                          {"role": "user", "content": [{"type": "text", "text": "Weather?"}]}],
                             "stop_sequences": ["\n"], "temperature": 0.2, "top_k": 5,
                             "tools": [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}],
                             "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 16}},
    anthropic.COUNT_TOKENS_URL: {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "system": "Brief."},
    responses.RESPONSES_URL: {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                     "text": "Hi"}]}],
                              "instructions": "Be brief.", "max_output_tokens": 16, "temperature": 0.3,
                              "text": {"format": {"type": "text"}}, "tools": [{"type": "function",
                                                                              "name": "get_weather",
                                                                              "parameters": TOOL["function"][
                                                                                  "parameters"]}]},
    ollama.CHAT_URL: {"model": "m:latest", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "thinking": "Greet.",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}],
        "tools": [TOOL], "format": "json", "stream": False, "keep_alive": "5m", "think": False, "logprobs": True,
        "top_logprobs": 2, "options": {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "num_predict": 4,
                                       "stop": ["\n"], "seed": 1, "repeat_penalty": 1.1, "repeat_last_n": 32,
                                       "presence_penalty": 0.1, "num_ctx": 2048, "num_thread": 2,
                                       "typical_p": 1.0, "mirostat": 0, "mirostat_tau": 5.0}},
    llamacpp.COMPLETION_URL: {"prompt": "Once", "n_predict": 4, "temperature": 0.2, "stop": ["\n"], "n_probs": 2,
                              "cache_prompt": True, "samplers": ["top_k", "top_p", "min_p", "temperature"],
                              "top_k": 20, "repeat_penalty": 1.05, "repeat_last_n": 16, "stream": True,
                              "timings_per_token": True, "return_progress": True, "return_tokens": True,
                              "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2, "post_sampling_probs": True},
    ollama.GENERATE_URL: {"model": "m", "prompt": "Once", "system": "Be brief.", "raw": False, "stream": True,
                          "format": {"type": "object", "properties": {"a": {"type": "string"}}}, "think": "low",
                          "options": {"num_predict": -1, "temperature": 0}, "images": [], "context": []},
}
FIELDS = sorted({k for body in VALID.values() for k in body} | {
    "max_completion_tokens", "top_k", "min_p", "repetition_penalty", "stream_options", "parallel_tool_calls",
    "suffix", "user", "previous_response_id", "store", "metadata", "reasoning", "reasoning_effort", "best_of",
    "functions", "function_call", "input", "text", "instructions", "content", "role", "type", "name", "arguments",
    "tool_call_id", "tool_calls", "image_url", "source", "id", "json_schema", "schema", "strict", "disable",
    "chat_template_kwargs", "enable_thinking", "reasoning_format", "thinking_token_budget", "thinking",
    "budget_tokens", "reasoning_content", "signature", "effort", "summary", "self", "options", "num_predict",
    "raw", "images", "tool_name", "keep_alive", "think", "format", "suffix", "template", "mirostat", "typical_p",
    "n_predict", "n_probs", "ignore_eos", "samplers", "sse_ping_interval", "cache_prompt", "repeat_penalty",
    "dry_multiplier", "top_n_sigma", "xtc_probability", "dry_sequence_breakers", "min_keep", "return_tokens",
    "post_sampling_probs", "mirostat_tau", "dynatemp_range"})

leaves = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                   st.sampled_from(["user", "assistant", "system", "tool", "text", "function", "json_schema",
                                    "auto", "none", "required", "input_text", "image_url", "", "\x00", "é" * 3]))
values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.one_of(st.sampled_from(FIELDS),
                                                                                st.text(max_size=6)),
                                                                      inner, max_size=4)), max_leaves=16)


def _mutate(data, body):
    """Replace, delete or add at random places of body (a copy), a few times."""
    for _ in range(data.draw(st.integers(1, 4))):
        node, path = body, []
        while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(node, key=str) if isinstance(node, dict) else range(len(node))))
            path.append((node, key))
            node = node[key]
        if not path:
            body = data.draw(values) if data.draw(st.integers(0, 9)) == 0 else body
            if isinstance(body, dict):
                body[data.draw(st.sampled_from(FIELDS))] = data.draw(values)
            continue
        parent, key = path[-1]
        action = data.draw(st.integers(0, 2))
        if action == 0 and isinstance(parent, dict):
            del parent[key]
        elif action == 1 and isinstance(parent, dict):
            parent[data.draw(st.sampled_from(FIELDS))] = data.draw(values)
        else:
            parent[key] = data.draw(values)
    return body


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return engine.load_model(smollm2_gguf)


def dialect_for(url: str, store: responses.ResponseStore):
    """The dialect the server's route table gives POST url (a new one, as per request)."""
    return next(r for r in TABLE.routes if r.method == "POST" and r.path == url).dialect(store)


def _check(url: str, body, model) -> None:
    """Parse and prepare as the server does: a request, or a client error; anything else fails the test."""
    dialect = dialect_for(url, responses.ResponseStore())
    try:
        req = dialect.parse(body)
        if dialect.counts_tokens:
            prompt_ids(model, req)
        else:
            prepare(model, req, window=512)
    except GoinferError as e:
        assert error_status(e) < 500, (url, body, e)
        dialect.error(error_status(e), {"error": {"message": str(e)}})  # its own shape must build too


@pytest.mark.parametrize("url", sorted(VALID))
def test_valid_bodies_are_valid(url, smol):
    _check(url, json.loads(json.dumps(VALID[url])), smol)  # and make requests
    dialect = dialect_for(url, responses.ResponseStore())
    dialect.parse(json.loads(json.dumps(VALID[url])))


@pytest.mark.parametrize("url", sorted(VALID))
def test_every_route_refuses_bad_bodies_with_a_client_error(url, smol):
    @FUZZ
    @given(st.data())
    def run(data):
        _check(url, _mutate(data, json.loads(json.dumps(VALID[url]))), smol)

    run()


@pytest.fixture(scope="module")
def thinker():
    """The kit's tiny qwen3 with the real Qwen3.5 template: a model that thinks (replayed reasoning rendered,
    budgets planned, prefills continued)."""
    import copy

    from engine.templates import ChatTemplate
    from tests import reference_templates as ref
    from tests.conftest import in_kit

    model = copy.copy(engine.load_model(str(in_kit("qwen3", "tiny-qwen3-a.Q8_0.gguf")),
                                        selftest=False))
    model.template = ChatTemplate(ref.reference_template("Qwen3.5-4B"), eos_token="<|im_end|>")
    return model


@pytest.mark.parametrize("url", [CHAT_URL, anthropic.MESSAGES_URL, responses.RESPONSES_URL])
def test_a_thinking_model_refuses_bad_bodies_with_a_client_error(url, thinker):
    @settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
    @given(st.data())
    def run(data):
        _check(url, _mutate(data, json.loads(json.dumps(VALID[url]))), thinker)

    run()


def test_batch_lines_become_requests_or_error_records(tmp_path):
    @FUZZ
    @given(st.data())
    def run(data):
        url = data.draw(st.sampled_from([CHAT_URL, COMPLETIONS_URL]))
        line = {"custom_id": "a", "method": "POST", "url": url, "body": json.loads(json.dumps(VALID[url]))}
        line = _mutate(data, line)
        path = tmp_path / "in.jsonl"
        path.write_text(json.dumps(line) + "\n")
        (parsed,) = read_input(path)
        assert (parsed.request is None) != (parsed.error is None)

    run()


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": {}, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}, "messages[0].content[0].type"),
])
def test_the_shapes_that_once_reached_a_500_name_their_field(body, param):
    from engine.api.openai import parse_request
    from engine.errors import RequestError

    with pytest.raises(RequestError) as e:
        parse_request(CHAT_URL, body)
    assert e.value.param == param


BAD = [None, True, 0, -1, 2**70, 1e308, float("nan"), "", "x", "\x00é", [], [None], {}, {"type": []}, [[[[]]]]]


def _paths(node, path=()):
    """Every place in a body: each key of each object, each item of each array."""
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


@pytest.mark.parametrize("url", sorted(VALID))
def test_every_field_of_a_valid_body_takes_every_type(url, smol):
    # deterministic: each place of the valid body replaced by each value of BAD (an object's key also removed)
    for path in _paths(VALID[url]):
        for bad in BAD + ["<delete>"]:
            body = json.loads(json.dumps(VALID[url]))
            if not path:
                if bad != "<delete>":
                    _check(url, bad, smol)
                continue
            parent = body
            for k in path[:-1]:
                parent = parent[k]
            if bad == "<delete>":
                if isinstance(parent, dict):
                    del parent[path[-1]]
                else:
                    continue
            else:
                parent[path[-1]] = bad
            _check(url, body, smol)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, smollm2_gguf):
    from tests.test_server import start_server, stop

    # a 64-token window: a generated body that is valid generates little
    s = start_server(tmp_path_factory.mktemp("fuzzlog") / "serve.log", "--model", str(smollm2_gguf), "--ctx", "64")
    yield s
    stop(s)


HTTP_EXAMPLES = int(os.environ.get("GOINFER_FUZZ_HTTP_EXAMPLES", "40"))


@pytest.mark.parametrize("url", sorted(VALID))
def test_through_http_no_body_gets_a_5xx_or_a_dropped_connection(url, small_server):
    import httpx

    @settings(max_examples=HTTP_EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        body = _mutate(data, json.loads(json.dumps(VALID[url])))
        raw = json.dumps(body).encode()  # NaN and Infinity as Python writes them: the server reads them too
        r = httpx.post(small_server.url + url, content=raw, headers={"Content-Type": "application/json"},
                       timeout=120)  # a dropped connection raises here
        assert r.status_code < 500, (body, r.status_code, r.text[:300])
        if r.headers.get("content-type", "").startswith("application/json"):
            r.json()

    run()
    assert "Traceback" not in small_server.log_text()
