"""Structured output and tool calling through `goinfer serve`, driven by the official openai SDK on the real
default model: json_schema replies validate, json_object parses, named / required tool choices produce calls
whose arguments validate, tool results round-trip, streamed tool_calls deltas, invalid schemas are 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "calm"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
}, "required": ["name", "age", "mood", "address", "tags"], "additionalProperties": False}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


PROMPTS = ["Invent a person.", "Describe a pirate.", "A teacher from Lyon.", "Make up a child who loves cats.",
           "Describe your neighbour.", "A sad old sailor.", "Someone from Tokyo.", "A calm librarian.",
           "Invent a happy baker.", "Describe a famous painter."]


def test_json_schema_replies_validate_over_ten_prompts(client, name):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i, p in enumerate(PROMPTS):
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": p}], max_tokens=60,
                                           temperature=0.7, seed=i, response_format=fmt)
        choice = r.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_parses_and_completions_take_a_schema_too(client, name):
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "A cat as JSON."}],
                                       max_tokens=40, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    c = client.completions.create(model=name, prompt="Is the sky blue? Answer in JSON:", max_tokens=20, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "a", "schema": schema}}})
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].text), schema)


def test_an_invalid_schema_is_400_naming_what_is_wrong(client, name):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "strnig"}}}}})
    err = e.value.body
    assert err["param"] == "response_format.json_schema.schema" and "strnig" in err["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choice_produce_a_valid_call(client, name, choice):
    r = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       parallel_tool_calls=False, max_tokens=50, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    call = c.message.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id and call.type == "function"


def test_tool_calls_stream_as_deltas(client, name):
    ask = dict(model=name, messages=ASK, tools=[WEATHER], max_tokens=50, parallel_tool_calls=False, temperature=0,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls[0].function.arguments
    firsts, pieces, finish = [], [], None
    for chunk in client.chat.completions.create(stream=True, **ask):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:  # OpenAI's shape: id, type and name once, then the arguments alone
                    firsts.append((tc.type, tc.function.name, tc.function.arguments))
                else:
                    assert tc.type is None and tc.function.name is None
                    pieces.append(tc.function.arguments)
            finish = ch.finish_reason or finish
    assert firsts == [("function", "get_weather", "")] and finish == "tool_calls"
    # the arguments arrive as they are generated, and join up to the non-streamed call's exactly
    assert len(pieces) >= 2 and "".join(pieces) == whole, pieces
    assert not any("<" in p or "tool_call" in p for p in pieces)
    jsonschema.validate(json.loads(whole), WEATHER["function"]["parameters"])


def test_tool_results_round_trip(client, name):
    first = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=50, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=name, messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    alone = client.chat.completions.create(model=name, messages=ASK, tool_choice="none", tools=[WEATHER],
                                           max_tokens=1, temperature=0)
    # the call and its result are in the prompt: as many tokens as the call's JSON and the result at least
    assert r.usage.prompt_tokens >= alone.usage.prompt_tokens + len(call.function.arguments) // 4 + 8


# ------------------------------------------------------------------ a request's own grammar (llama.cpp, vLLM)

PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def test_gbnf_regex_and_choice_constrain_every_answer(client, name):
    import re

    ask = [{"role": "user", "content": "Is the sky blue? Then give a phone number. Write freely."}]
    gbnf = 'root ::= answer " because " reason "."\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,30}'
    for body, check in (
            ({"grammar": gbnf}, lambda t: re.fullmatch(r"(yes|no) because [a-z ]{3,30}\.", t)),
            ({"guided_regex": PHONE}, lambda t: re.fullmatch(PHONE, t)),
            ({"guided_choice": ["red", "green", "blue (dark)"]}, lambda t: t in ("red", "green", "blue (dark)")),
            ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}},
                              "required": ["n"], "additionalProperties": False}},
             lambda t: isinstance(json.loads(t)["n"], int))):
        for seed in (1, 2):
            r = client.chat.completions.create(model=name, messages=ask, max_tokens=60, temperature=1, seed=seed,
                                               extra_body=body)
            assert check(r.choices[0].message.content), (body, r.choices[0].message.content)
    done = client.completions.create(model=name, prompt="My number is ", max_tokens=40, temperature=0,
                                     extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, done.choices[0].text)


@pytest.mark.parametrize("body,param", [
    ({"grammar": "root ::= ((("}, "grammar"), ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"), ({"guided_choice": "red"}, "guided_choice"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_regex": "a+", "grammar": 'root ::= "a"'}, "guided_regex"),
    ({"guided_regex": "a+", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools")])
def test_a_bad_or_conflicting_grammar_is_400_naming_it(client, name, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body
