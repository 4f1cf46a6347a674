"""engine.constrain: grammars from schemas, the token mask as a logits processor, tool-call grammars.

The property test drives the real tokenizer's masks with random logits (a model that could say anything):
whatever is sampled, a finished answer must validate. The server tests (test_structured.py) do the same
with the real model's logits."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

import engine
from engine.constrain import grammar_processor, json_object_grammar, json_schema_grammar
from engine.constrain.tools import tool_call_grammar
from engine.errors import RequestError
from engine.templates.tools import parse_tool_calls, render_messages


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    return engine.load_model(str(smollm2_gguf))


def sample_constrained(model, grammar, rng: np.random.Generator, max_tokens: int = 512, eos_boost: float = 4.0):
    """Sample from random logits through the grammar's mask: (text, finished)."""
    tok = model.tokenizer
    proc = grammar_processor(tok, grammar)
    history, out = [0], []
    for _ in range(max_tokens):
        logits = rng.standard_normal(tok.vocab_size).astype(np.float32) * 3
        logits[list(tok.eog_ids)] += eos_boost  # a model that ends when it may, as instruct models do
        logits = proc(logits, history)
        assert np.isfinite(logits).any(), "the mask allowed nothing"
        p = np.exp(logits - logits.max())
        t = int(rng.choice(len(p), p=p / p.sum()))
        history.append(t)
        proc.accept(t)
        if t in tok.eog_ids:
            return tok.decode(out, skip_special=True), True
        out.append(t)
    return tok.decode(out, skip_special=True), False


def random_schema(r: random.Random, depth: int = 0) -> dict:
    """A schema from the subset we promise (types, enum, const, bounds, nesting, required, arrays)."""
    kinds = ["string", "integer", "number", "boolean", "enum", "null"] + (["object", "array"] if depth < 2 else [])
    k = r.choice(kinds)
    if k == "string":
        s = {"type": "string", "maxLength": r.randint(0, 12)}
        if r.random() < 0.3:
            s["pattern"] = r.choice(["^[a-z]+$", "^[A-Z][a-z]*$", "^[0-9]{3}$"])
            s["minLength"] = 1
        return s
    if k == "integer":
        lo = r.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 1000)}
    if k == "number":
        return {"type": "number", "minimum": 0, "maximum": 100}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "enum":
        return {"enum": r.sample(["red", "green", "blue", 1, 2, True, None, "x y"], r.randint(1, 4))}
    if k == "array":
        return {"type": "array", "items": random_schema(r, depth + 1), "maxItems": r.randint(0, 3)}
    props = {f"k{i}": random_schema(r, depth + 1) for i in range(r.randint(1, 4))}
    return {"type": "object", "properties": props, "required": r.sample(sorted(props), r.randint(0, len(props))),
            "additionalProperties": False}


def test_random_schemas_always_validate_when_finished(model):
    r, rng = random.Random(1234), np.random.default_rng(1234)
    finished = 0
    for i in range(60):
        schema = random_schema(r)
        text, done = sample_constrained(model, json_schema_grammar(schema), rng)
        if done:
            finished += 1
            jsonschema.validate(json.loads(text), schema)  # never a finished answer that fails
    assert finished >= 0.9 * 60, finished


def test_the_model_under_random_schemas_always_validates_when_finished(model):
    # The model's own logits this time: 50 random schemas from the supported subset, each asked for in a chat
    # turn and sampled (temperature 0.7, seeded) with up to 512 tokens. Every finished reply must parse and
    # validate; at least 90 % must finish (a reply cut by max_tokens is the only excuse).
    r = random.Random(99)
    finished = 0
    for i in range(50):
        schema = random_schema(r)
        prompt = model.tokenizer.encode(model.render_chat([{"role": "user", "content":
                                        f"Reply with a JSON value matching this JSON schema: {json.dumps(schema)}"}]))
        proc = grammar_processor(model.tokenizer, json_schema_grammar(schema))
        events = list(engine.generate(model, prompt, max_tokens=512, temperature=0.7, seed=i, processors=[proc]))
        if events[-1].finish_reason == "stop":
            finished += 1
            text = "".join(e.text for e in events)
            jsonschema.validate(json.loads(text), schema)
    assert finished >= 45, f"only {finished} of 50 replies finished within 512 tokens"


def test_json_object_is_an_object(model):
    rng = np.random.default_rng(0)
    for _ in range(5):
        text, done = sample_constrained(model, json_object_grammar(), rng, eos_boost=12.0)
        if done:
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("schema, words", [
    ({"type": "wat"}, "wat"),
    ({"type": "string", "pattern": "[a-z"}, "unclosed"),
    ({"type": "string", "format": "no-such-format"}, "format"),
    ([1, 2], "object"),
])
def test_invalid_schemas_are_refused_naming_the_fault(schema, words):
    with pytest.raises(RequestError) as e:
        json_schema_grammar(schema, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" and words in str(e.value)


WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
                                           "required": ["tz"], "additionalProperties": False}}


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_always_parse_and_name_a_given_tool(model, parallel):
    rng = np.random.default_rng(7)
    g = tool_call_grammar([WEATHER, TIME], forced=True, parallel=parallel)
    for _ in range(8):
        text, done = sample_constrained(model, g, rng, eos_boost=12.0)
        assert text.startswith("<tool_call>")
        if done:
            content, calls = parse_tool_calls(text, {"get_weather", "get_time"})
            assert calls and content == "" and (parallel or len(calls) == 1)
            for c in calls:
                schema = (WEATHER if c.name == "get_weather" else TIME)["parameters"]
                jsonschema.validate(json.loads(c.arguments), schema)


def test_auto_tool_grammar_allows_text_and_constrains_calls_after_the_opener(model):
    from engine.constrain.grammar import llg_tokenizer
    from llguidance import LLMatcher

    g = tool_call_grammar([WEATHER], forced=False)
    tok = model.tokenizer

    def accepts(text):
        m = LLMatcher(llg_tokenizer(tok), g.spec, log_level=0)
        return m.consume_tokens(tok.encode(text, add_bos=False)) and m.is_accepting()

    assert accepts("Paris is sunny today.")
    assert accepts('Let me check. <tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>')
    assert not accepts('<tool_call>{"name":"get_wether","arguments":{}}</tool_call>')
    assert not accepts('<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>')  # unit required


def test_tool_prompt_replays_calls_and_results_through_a_template_without_tools():
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out, tools = render_messages(msgs, [WEATHER], "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tools is None and out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    same, tools = render_messages(msgs, [WEATHER], "{% if tools %}{{ tools }}{% endif %}")
    assert same == msgs and tools[0]["function"]["name"] == "get_weather"


def test_tool_call_formats_parse():
    hermes = 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(hermes)[1]] == [("f", {"a": 1})]
    assert parse_tool_calls(hermes)[0] == "ok"
    assert parse_tool_calls('{"name": "f", "parameters": {"a": 2}}')[1][0].arguments == '{"a": 2}'  # Llama 3
    assert [c.name for c in parse_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}, '
                                             '{"name": "g", "arguments": {}}]')[1]] == ["f", "g"]  # Mistral
    assert parse_tool_calls(hermes, {"g"}) == (hermes, [])  # a tool that was not given is not a call
    cut = hermes + '\n<tool_call>\n{"name": "f", "argu'
    assert len(parse_tool_calls(cut)[1]) == 1  # cut off by max_tokens: the complete call stands


def test_chat_schema_flag_constrains_the_reply(tmp_path, smollm2_gguf):
    from tests.test_cli import goinfer

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    path = tmp_path / "cat.json"
    path.write_text(json.dumps(schema))
    r = goinfer("chat", "--model", str(smollm2_gguf), "--prompt", "A cat as JSON", "--schema", str(path), "--temp", "0",
                "--max", "40")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)
    path.write_text('{"type": "wat"}')
    r = goinfer("chat", "--model", str(smollm2_gguf), "--prompt", "x", "--schema", str(path))
    assert r.returncode == 2 and "Invalid type: wat" in r.stderr and "Traceback" not in r.stderr
