"""Tools in prompts and tool calls in answers.

Rendering: a template that reads `tools` gets them (with assistant `tool_calls` and `tool` messages as
transformers passes them). Any other template (SmolLM2's ChatML, Gemma's built-in) gets the built-in
Hermes-style prompt: the tools described in the system message, earlier calls written back as
`<tool_call>` blocks and tool results as `<tool_response>` blocks in a user turn (every template has one).

Parsing: Hermes `<tool_call>{...}</tool_call>` blocks (inside them, Qwen3.5's `<function=NAME><parameter=K>`
form too, typed by the tools' schemas), Mistral `[TOOL_CALLS][...]`, and a Llama-3 style answer that is one bare
JSON object `{"name": ..., "parameters"|"arguments": {...}}`. The same calls read while
they are generated (for streams): engine/templates/tool_stream.py.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from engine.templates.markup import partial_suffix

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.S)

TOOL_PROMPT = """\
You are a function calling AI model. You are provided with function signatures within <tools></tools> XML \
tags. You may call one or more functions to assist with the user query. Don't make assumptions about what \
values to plug into functions. Here are the available tools:
<tools>
{tools}
</tools>
For each function call return a json object with function name and arguments within <tool_call></tool_call> \
XML tags as follows:
<tool_call>
{{"name": <function-name>, "arguments": <args-dict>}}
</tool_call>"""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = new_call_id()


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def template_supports_tools(source: str) -> bool:
    """Whether a chat template renders `tools` itself (transformers' convention: a `tools` variable)."""
    return re.search(r"\btools\b", source) is not None


# The Hermes JSON call as a template's own instructions spell it (Qwen2.5, Qwen3: `<tool_call>\n{"name": ...`).
_ASKS_HERMES_JSON = re.compile(r'<tool_call>(?:\\n|\n)?\{\\?"name\\?"')


def asks_hermes_json(source: str) -> bool:
    """Whether a template that renders tools asks for Hermes JSON calls (which the tool grammar writes), rather
    than a form of its own (Qwen3.5's XML, Gemma 4's, gpt-oss's)."""
    return _ASKS_HERMES_JSON.search(source) is not None


def _function(tool: dict) -> dict:
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def render_messages(messages: list[dict], tools: list[dict] | None, template_source: str) -> tuple[list[dict], list | None]:
    """(messages, tools) to hand the template: as they are when it renders tools, else rewritten for the
    built-in tool prompt. `tools` are {"name", "description", "parameters"} each."""
    if template_supports_tools(template_source):
        if _OBJECT_ARGUMENTS.search(template_source):
            messages = [with_object_arguments(m) for m in messages]
        return messages, [_function(t) for t in tools] if tools else None
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "tool":
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + text  # parallel results: one user turn
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        elif m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps(_call_json(c), ensure_ascii=False)}\n</tool_call>"
                              for c in m["tool_calls"])
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(_function(t), ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


# A template that walks a call's arguments as a mapping (Qwen3.5: `arguments|items`; Gemma 4: `['arguments'] is
# mapping`) needs them as an object; the OpenAI wire sends a JSON string (llama.cpp converts them the same way).
_OBJECT_ARGUMENTS = re.compile(r"arguments\s*\|\s*items|arguments\.items\(\)|arguments'\]\s*is\s+mapping")


def with_object_arguments(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def _call_json(call: dict) -> dict:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": fn.get("name"), "arguments": args}


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content before the calls, calls) from an answer. Calls that do not parse, or name a tool that was
    not given, are left in the content."""
    if GEMMA4_OPEN in text:
        reader = Gemma4Calls()
        content, calls = _parse(reader.push(text) + reader.finish(), tool_names)
        return (content, calls) if calls else (text, [])
    return _parse(text, tool_names)


def _parse(text: str, tool_names: Collection[str] | None) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    if "<tool_call>" in text:
        head = text[: text.index("<tool_call>")]
        for block, closed in _HERMES.findall(text):
            call = read_call(block, tool_names)
            if call is None and not closed and calls:
                break  # a last call cut off (max_tokens): the complete ones stand
            if call is None:
                return text, []
            calls.append(call)
        return (head.strip(), calls) if calls else (text, [])
    stripped = text.strip()
    if stripped.startswith("[TOOL_CALLS]"):  # Mistral
        try:
            items = json.loads(stripped[len("[TOOL_CALLS]"):])
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (read_call(json.dumps(i), tool_names) for i in items) if c is not None]
        return ("", calls) if len(calls) == len(items) else (text, [])
    if stripped.startswith("{") and stripped.endswith("}"):  # Llama-3: the whole answer is one call
        call = read_call(stripped, tool_names)
        if call is not None:
            return "", [call]
    if stripped.startswith("{") and tool_names is not None:  # a call without its wrapper, more text after it
        call = _unwrapped_call(stripped, tool_names)
        if call is not None:
            return "", [call]
    return text, []


def _unwrapped_call(text: str, tool_names: Collection[str]) -> ToolCall | None:
    """The call an answer's first JSON object makes, when it names a given tool and its arguments are an object
    (Qwen2.5-Coder often leaves the <tool_call> wrapper out and goes on writing): that one call, the rest dropped as
    text after a Hermes block is."""
    try:
        obj, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
    if not isinstance(args, dict) or obj.get("name") not in tool_names:
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def read_call(block: str, tool_names: Collection[str] | None) -> ToolCall | None:
    """The call one block makes (its JSON, or Qwen3.5's XML form), its arguments re-written by json.dumps; None
    if it makes none. `tool_names` may map each name to its parameters' schema (the XML form's values are typed by
    it)."""
    if block.startswith("<function="):
        return read_xml_call(block, tool_names)
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if tool_names is not None and obj["name"] not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


# Qwen3.5's own form (its template asks for it): <function=NAME> then <parameter=KEY>\nvalue\n</parameter> per argument.
_XML_CALL = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def read_xml_call(block: str, tool_names: Collection[str] | None) -> ToolCall | None:
    """The call a `<function=NAME>...</function>` block makes, each value typed by the tool's schema: a string
    parameter keeps its text as it is ("123" stays a string), any other type is read as JSON (its text where that
    fails), and a parameter the schema does not name is JSON where it parses as a non-string, else text."""
    m = _XML_CALL.fullmatch(block.strip())
    if m is None:
        return None
    name = m.group(1).strip()
    if tool_names is not None and name not in tool_names:
        return None
    schema = tool_names.get(name) if isinstance(tool_names, Mapping) else None
    properties = (schema or {}).get("properties") or {}
    args, at, body = {}, 0, m.group(2)
    for p in _XML_PARAMETER.finditer(body):
        if body[at:p.start()].strip():
            return None  # text between parameters: not this form
        key = p.group(1).strip()
        args[key] = _typed(p.group(2), properties.get(key))
        at = p.end()
    if body[at:].strip():
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _typed(text: str, schema: dict | None):
    kinds = (schema or {}).get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if "string" in kinds:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) and not kinds else value


# Gemma 4's own form: <|tool_call>call:NAME{key:value,...}<tool_call|>; strings between <|"|> marks, keys bare.
GEMMA4_OPEN, GEMMA4_CLOSE, _QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_GEMMA4_CALL = re.compile(r"\s*call:([^{\s]+)\s*(\{.*\})\s*", re.S)
_SCALAR = re.compile(r"[^,}\]]*")


class Gemma4Calls:
    """Gemma 4's call blocks rewritten into the Hermes blocks every reader of calls reads, each as it closes; text
    around them, and a block that does not parse, pass as they are. push(text) -> text, finish() at the end."""

    def __init__(self):
        self._buf, self._inside = "", False

    def push(self, text: str) -> str:
        self._buf += text
        out = []
        while True:
            mark = GEMMA4_CLOSE if self._inside else GEMMA4_OPEN
            at = self._buf.find(mark)
            if at < 0:
                if not self._inside:  # hold only what may still become an opener
                    keep = partial_suffix(self._buf, GEMMA4_OPEN)
                    out.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                return "".join(out)
            out.append(_as_hermes(self._buf[:at]) if self._inside else self._buf[:at])
            self._buf, self._inside = self._buf[at + len(mark):], not self._inside

    def finish(self) -> str:
        """A block cut off (max_tokens) still counts when it parses, as a cut-off Hermes call does."""
        buf, self._buf = self._buf, ""
        return _as_hermes(buf, closed=False) if self._inside else buf


def _as_hermes(block: str, closed: bool = True) -> str:
    call = read_gemma4_call(block)
    if call is None:
        return GEMMA4_OPEN + block + (GEMMA4_CLOSE if closed else "")
    name, args = call
    return f'<tool_call>{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ' \
           f'{json.dumps(args, ensure_ascii=False)}}}</tool_call>'


def read_gemma4_call(block: str) -> tuple[str, dict] | None:
    """(name, arguments) of one Gemma 4 call block's text (`call:NAME{...}`), or None."""
    m = _GEMMA4_CALL.fullmatch(block)
    if m is None:
        return None
    try:
        args, end = _gemma4_value(m.group(2), 0)
    except (ValueError, IndexError):
        return None
    return (m.group(1), args) if end == len(m.group(2)) and isinstance(args, dict) else None


def _gemma4_value(text: str, i: int):
    """The value at text[i:] in Gemma 4's notation, and where it ends (ValueError where it is not one)."""
    if text.startswith(_QUOTE, i):
        end = text.index(_QUOTE, i + len(_QUOTE))
        return text[i + len(_QUOTE):end], end + len(_QUOTE)
    if text[i] in "{[":
        close, out = ("}", {}) if text[i] == "{" else ("]", [])
        i += 1
        while text[i] != close:
            if isinstance(out, dict):
                if text.startswith(_QUOTE, i):
                    key, i = _gemma4_value(text, i)
                else:
                    colon = text.index(":", i)
                    key, i = text[i:colon].strip(), colon
                if text[i] != ":":
                    raise ValueError("a key without a value")
                out[key], i = _gemma4_value(text, i + 1)
            else:
                value, i = _gemma4_value(text, i)
                out.append(value)
            if text[i] == ",":
                i += 1
        return out, i + 1
    word = _SCALAR.match(text, i).group(0)
    return json.loads(word.strip()), i + len(word)  # numbers, true, false, null
