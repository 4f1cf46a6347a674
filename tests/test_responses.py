"""The OpenAI Responses API on `goinfer serve`, driven by the official openai SDK on the real default model:
non-stream, the stream's event types, text.format json_schema, previous_response_id continuing a
conversation, GET /v1/responses/{id}, function tools."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest


ASK = "What is the capital of France? Answer in one sentence."


def test_a_response_non_stream_and_stored(client, name):
    r = client.responses.create(model=name, input=ASK, max_output_tokens=8, temperature=0,
                                instructions="Answer briefly.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message" and r.usage.output_tokens <= 8
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text


def test_stream_event_types(client, name):
    kinds = [ev.type for ev in client.responses.create(model=name, input=ASK, max_output_tokens=6, temperature=0,
                                                       stream=True)]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"] or kinds[-1] == "response.completed"


def test_text_format_json_schema(client, name):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "country": {"enum": ["France", "Spain", "Italy"]}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model=name, input="Name a city in Europe as JSON.", max_output_tokens=40,
                                temperature=0, text={"format": {"type": "json_schema", "name": "city",
                                                                "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_continues_the_conversation(client, name):
    first = client.responses.create(model=name, input="My name is Zorblat. Say hello.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=name, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    alone = client.responses.create(model=name, input="What is my name?", max_output_tokens=8, temperature=0,
                                    store=False)
    # the earlier turn is in the prompt: the continued request counts its tokens
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store: false is not kept
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=name, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    assert "previous_response_id" in str(e.value)


def test_function_tools_produce_a_function_call_item(client, name):
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                           "required": ["city"], "additionalProperties": False}}
    ask = dict(model=name, input="Weather in Paris?", tools=[tool], tool_choice="required",
               parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    r = client.responses.create(**ask)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    # streamed: the arguments arrive as .delta pieces that join up to the non-streamed ones
    events = list(client.responses.create(stream=True, **ask))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == 1 and added[0].arguments == "" and added[0].name == "get_weather"
    assert len(pieces) >= 2 and "".join(pieces) == done[0] == calls[0].arguments, pieces
    final = [o for o in events[-1].response.output if o.type == "function_call"]
    assert [(o.call_id, o.arguments) for o in final] == [(added[0].call_id, calls[0].arguments)]
