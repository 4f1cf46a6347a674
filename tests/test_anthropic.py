"""The Anthropic Messages API on `goinfer serve`, driven by the official anthropic SDK on the real default
model: non-stream and stream (the exact event order), system as string or blocks, stop_sequences,
tool_choice tool -> a tool_use block whose input validates, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import SERVER_KEY

KEY = SERVER_KEY
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments any more; the API still takes them


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def test_a_message_non_stream(client, name):
    m = client.messages.create(model=name, max_tokens=8, messages=ASK, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens > 5
    assert 1 <= m.usage.output_tokens <= 8


def test_system_as_string_or_blocks_is_the_same_prompt(client, name):
    s = client.messages.count_tokens(model=name, system="Answer in one word.", messages=ASK)
    b = client.messages.count_tokens(model=name, system=[{"type": "text", "text": "Answer in one word."}],
                                     messages=ASK)
    short = client.messages.count_tokens(model=name, system="Hi.", messages=ASK)
    assert s.input_tokens == b.input_tokens == short.input_tokens + 3 > 5  # "Answer in one word." (5 tokens) vs "Hi." (2)
    m1 = client.messages.create(model=name, max_tokens=6, system="Answer in one word.", messages=ASK, extra_body=GREEDY)
    m2 = client.messages.create(model=name, max_tokens=6, system=[{"type": "text", "text": "Answer in one word."}],
                                messages=ASK, extra_body=GREEDY)
    assert m1.content[0].text == m2.content[0].text and m1.usage.input_tokens == s.input_tokens


def test_stream_events_come_in_the_documented_order(server, client, name):
    # on the wire (the SDK hides ping): each event's name line matches its data's type
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      json={"model": name, "max_tokens": 8, "messages": ASK, "stream": True, **GREEDY}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        names, datas = [], []
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                datas.append(json.loads(line[6:]))
    assert names == [d["type"] for d in datas]
    n = names.count("content_block_delta")
    assert n >= 1 and names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * n + \
        ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta")
    # the SDK's stream builds the same message
    with client.messages.stream(model=name, max_tokens=8, messages=ASK, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == datas[-2]["delta"]["stop_reason"]
    assert final.usage.output_tokens == datas[-2]["usage"]["output_tokens"]


def test_stop_sequences_give_stop_reason_stop_sequence(client, name):
    full = client.messages.create(model=name, max_tokens=12, messages=ASK, extra_body=GREEDY).content[0].text
    word = full.split()[1] if len(full.split()) > 1 else full[1:3]
    m = client.messages.create(model=name, max_tokens=12, messages=ASK, extra_body=GREEDY, stop_sequences=[word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text and full.startswith(m.content[0].text)


def test_tool_choice_tool_gives_a_tool_use_block_whose_input_validates(client, name):
    m = client.messages.create(model=name, max_tokens=50, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, WEATHER["input_schema"])
    # the result goes back as a tool_result block and the conversation continues
    follow = client.messages.create(model=name, max_tokens=6, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "sunny, 21 C"}]}],
        tool_choice={"type": "none"})
    alone = client.messages.count_tokens(model=name, tools=[WEATHER], tool_choice={"type": "none"},
                                         messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    # the call and its result are replayed into the prompt
    assert follow.content[0].type == "text" and follow.usage.input_tokens >= alone.input_tokens + 15


def test_errors_take_anthropics_shape(server, name):
    with httpx.Client(base_url=server.url, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      timeout=60) as c:
        r = c.post("/v1/messages", json={"model": name, "max_tokens": 5, "messages": [
            {"role": "system", "content": "x"}, *ASK]})
        assert r.status_code == 400
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "messages.0.role" in body["error"]["message"]
        r = c.post("/v1/messages", json={"model": name, "messages": ASK})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        r = c.post("/v1/messages", json={"model": "no-such-model", "max_tokens": 5, "messages": ASK})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": name, "max_tokens": 5, "messages": ASK},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_sdk_raises_typed_errors(client, name):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=name, max_tokens=5, messages=ASK, tools=[{**WEATHER, "input_schema": {
            "type": "object", "properties": {"a": {"type": "strnig"}}}}])
    assert "tools.0.input_schema" in str(e.value) and "strnig" in str(e.value)


def test_overloaded_maps_to_529():
    from engine.api.anthropic import error_body, error_status
    assert error_status(429) == 529 and error_body(529, "busy")["error"]["type"] == "overloaded_error"


def test_json_in_tool_use_survives_streaming(client, name):
    ask = dict(model=name, max_tokens=50, extra_body=GREEDY, tools=[WEATHER],
               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
               messages=[{"role": "user", "content": "Weather in Rome?"}])
    whole = client.messages.create(**ask).content[-1]
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [ev.type for ev in events]
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER["input_schema"])
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds
    start = next(ev for ev in events if ev.type == "content_block_start" and ev.content_block.type == "tool_use")
    assert start.content_block.input == {} and start.content_block.name == "get_weather"
    # the input arrives in pieces as it is generated, and joins up to the non-streamed block's input
    pieces = [ev.delta.partial_json for ev in events
              if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta"]
    assert len(pieces) >= 2 and json.loads("".join(pieces)) == whole.input == final.content[-1].input, pieces
