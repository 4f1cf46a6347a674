"""What constrains an answer, as the OpenAI-style wire formats write it: `tools` and `tool_choice`,
`response_format`, and a grammar of the request's own (llama.cpp's `grammar`, vLLM's guided decoding fields).

Pure functions from body fields to tool lists and grammars, shared by chat completions and completions
(openai.py), the Responses API (responses.py) and Anthropic's tools (anthropic.py). Every refusal is a
RequestError naming the field.
"""

from __future__ import annotations

import re
from typing import Any

from engine.api.fields import kind_of
from engine.constrain.grammar import Grammar, json_object_grammar, json_schema_grammar, text_grammar
from engine.errors import RequestError

__all__ = ["GRAMMAR_FIELDS", "answer_grammar", "parse_tool_choice", "parse_tools", "response_format_grammar"]

# A grammar of the request's own (llama.cpp's `grammar`; vLLM's guided decoding fields): one at most.
GRAMMAR_FIELDS = {"grammar": "grammar", "guided_grammar": "grammar", "guided_regex": "regex",
                  "guided_choice": "choice", "guided_json": "json"}


def answer_grammar(body: dict) -> Grammar | None:
    """The grammar every answer follows: response_format's, or one of the request's own (grammar, guided_regex,
    guided_choice, guided_json, guided_grammar); two of them are a 400."""
    given = [name for name in GRAMMAR_FIELDS if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        given.insert(0, "response_format")
    if len(given) > 1:
        raise RequestError(f"{given[1]}: only one of {' and '.join(given)} may constrain the answer", given[1],
                           "invalid_value")
    if not given or given[0] == "response_format":
        return response_format_grammar(fmt)
    name = given[0]
    if GRAMMAR_FIELDS[name] == "json":
        return json_schema_grammar(body[name], name)
    return text_grammar(GRAMMAR_FIELDS[name], body[name], name)


def response_format_grammar(fmt: Any, param: str = "response_format") -> Grammar | None:
    """The grammar a response_format asks for: None for text, JSON for json_object, the schema's for
    json_schema (an invalid or unsupported schema is a RequestError naming what is wrong)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError(f"{param}: must be an object, not {kind_of(fmt)}", param, "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError(f"{param}.json_schema: required, an object with a schema", f"{param}.json_schema",
                               "missing_required_parameter")
        if "schema" not in spec:
            raise RequestError(f"{param}.json_schema.schema: required", f"{param}.json_schema.schema",
                               "missing_required_parameter")
        return json_schema_grammar(spec["schema"], f"{param}.json_schema.schema")
    raise RequestError(f"{param}.type: must be text, json_object or json_schema (got {kind!r})", f"{param}.type",
                       "unsupported_value")


def parse_tools(value: Any, param: str = "tools") -> tuple[dict, ...] | None:
    """OpenAI `tools` -> ({"name", "description", "parameters"}, ...); each schema is checked."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise RequestError(f"{param}: must be an array of tools", param, "invalid_type")
    out, names = [], set()
    for i, t in enumerate(value):
        at = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise RequestError(f'{at}: must be {{"type": "function", "function": {{...}}}} (only function tools '
                               "are supported)", at, "invalid_value")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise RequestError(f"{at}.function.name: must be 1-64 letters, digits, _ . or - (got {name!r})",
                               f"{at}.function.name", "invalid_value")
        if name in names:
            raise RequestError(f"{at}.function.name: {name!r} is given twice", f"{at}.function.name", "invalid_value")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        json_schema_grammar(params, f"{at}.function.parameters")  # refuse a schema we cannot enforce, now
        tool = {"name": name, "parameters": params}
        if isinstance(fn.get("description"), str):
            tool["description"] = fn["description"]
        out.append(tool)
    return tuple(out)


def parse_tool_choice(value: Any, tools: tuple[dict, ...] | None) -> tuple[str, tuple[dict, ...] | None]:
    """(mode, tools the answer may call): none / auto / required, or "function" with the one named tool."""
    if value is None:
        return "auto", tools
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise RequestError("tool_choice: 'required' needs tools", "tool_choice", "invalid_value")
        return value, tools
    name = None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
    if not isinstance(name, str):
        raise RequestError('tool_choice: must be none, auto, required or {"type": "function", "function": '
                           '{"name": ...}}', "tool_choice", "invalid_value")
    chosen = tuple(t for t in tools or () if t["name"] == name)
    if not chosen:
        raise RequestError(f"tool_choice.function.name: names tool {name!r}, which is not in tools",
                           "tool_choice.function.name",
                           "invalid_value")
    return "function", chosen
