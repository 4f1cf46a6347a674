"""Tool-call grammars: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks whose
JSON is the union of the given tools' schemas, so a call is never malformed and never names a tool that
was not given.

    forced (tool_choice required / a named tool): the answer is one call (or several, with parallel calls)
    auto: free text, or free text up to the first `<tool_call>` opener and constrained calls from there on
"""

from __future__ import annotations

import json

from engine.constrain.grammar import Grammar, lark_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call to any of `tools` ({"name", "parameters"} each)."""
    variants = [{"type": "object",
                 "properties": {"name": {"const": t["name"]}, "arguments": t.get("parameters") or {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}  # compact JSON: fewer tokens, no loops on spaces


def tool_call_grammar(tools: list[dict], *, forced: bool, parallel: bool = True) -> Grammar:
    """The grammar of an answer that calls `tools` (forced) or may call them (auto)."""
    body = f"body: %json {json.dumps(call_schema(tools))}"
    more = '("\\n"? "<tool_call>" "\\n"? body "\\n"? "</tool_call>")*' if parallel else ""
    if forced:
        source = f'start: "<tool_call>" "\\n"? body "\\n"? "</tool_call>" {more}\n{body}\n'
    else:
        # TEXT: any text without the opener; OPENER: any text up to and including the first opener.
        source = (f'start: TEXT | OPENER body "\\n"? "</tool_call>" {more}\n{body}\n'
                  'TEXT: /(.|\\n)+/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n'
                  'OPENER: /(.|\\n)*<tool_call>\\n?/ & ~/(.|\\n)*<tool_call>(.|\\n)*<tool_call>(.|\\n)*/\n')
    return lark_grammar(source, "tools", "tool_calls")
