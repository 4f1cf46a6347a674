"""The OpenAI Responses API wire format: /v1/responses bodies -> GenerationRequest, Completion -> response
objects, engine pieces -> named SSE events, and the bounded in-memory store behind `store` /
`previous_response_id` / `GET /v1/responses/{id}`.

Pure functions apart from `ResponseStore` (a locked, bounded dict). A body translates onto the same chat
request a chat completion makes: `instructions` -> a system message, input items -> messages (function_call
and function_call_output items -> tool calls and tool messages), `text.format` -> response_format's grammar.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from engine.api import thinking_controls as thinking_fields
from engine.api.fields import float_field, int_field, kind_of, str_field
from engine.api.constraints import parse_tool_choice, parse_tools, response_format_grammar
from engine.api.sse import named_event
from engine.constrain.tools import tool_call_grammar
from engine.errors import RequestError
from engine.requests.request import Completion, Delta, GenerationRequest, SamplingOptions
from engine.templates.tool_stream import CallArguments, CallStart, Text, ToolCallStream
from engine.templates.tools import ToolCall

RESPONSES_URL = "/v1/responses"
_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
           "previous_response_id", "text", "tools", "tool_choice", "parallel_tool_calls", "metadata", "user",
           "service_tier", "truncation", "reasoning", "include", "prompt_cache_key", "safety_identifier",
           "stream_options", "background", "top_logprobs"} | thinking_fields.FIELDS


class ResponseStore:
    """The last `capacity` stored responses: their objects and the conversation that led to them."""

    def __init__(self, capacity: int = 256):
        self._items: OrderedDict[str, tuple[dict, tuple[dict, ...]]] = OrderedDict()
        self._lock = threading.Lock()
        self.capacity = capacity

    def put(self, obj: dict, conversation: tuple[dict, ...]) -> None:
        with self._lock:
            self._items[obj["id"]] = (obj, conversation)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, tuple[dict, ...]] | None:
        with self._lock:
            return self._items.get(response_id)


@dataclass(frozen=True)
class ResponsesRequest:
    request: GenerationRequest
    store: bool
    previous_response_id: str | None
    instructions: str | None
    text_format: dict
    tools: list
    tool_choice: Any
    metadata: dict


def parse_responses_request(body: Any, lookup: Callable[[str], tuple[dict, tuple[dict, ...]] | None]) -> ResponsesRequest:
    """A /v1/responses body -> the engine request (with the stored conversation it continues)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {kind_of(body)}", None, "invalid_type")
    unknown = sorted(k for k in body if k not in _FIELDS)
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown parameter", unknown[0], "unsupported_parameter")
    history: tuple[dict, ...] = ()
    prev = str_field(body, "previous_response_id")
    if prev is not None:
        found = lookup(prev)
        if found is None:
            raise RequestError(f"previous_response_id: no stored response {prev!r} (stored responses are kept in "
                               "memory, the most recent ones only)", "previous_response_id", "not_found")
        history = found[1]
    instructions = str_field(body, "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        [m for m in history if m["role"] != "system"] + _input(body.get("input"))
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise RequestError("text: must be an object", "text", "invalid_type")
    fmt = text.get("format") or {"type": "text"}
    grammar = None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        grammar = response_format_grammar({"type": "json_schema", "json_schema": fmt}, "text.format")
        grammar = grammar if "schema" in fmt else None
    else:
        grammar = response_format_grammar(fmt, "text.format")
    raw_tools = body.get("tools") or []
    if not isinstance(raw_tools, list):
        raise RequestError("tools: must be an array", "tools", "invalid_type")
    for i, t in enumerate(raw_tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError(f"tools[{i}]: only function tools are supported", f"tools[{i}]", "unsupported_value")
    tools = parse_tools([{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                         for t in raw_tools])
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function" and "name" in tc:
        tc = {"type": "function", "function": {"name": tc["name"]}}
    choice, chosen = parse_tool_choice(tc, tools)
    parallel = body.get("parallel_tool_calls", True) is not False
    if chosen and choice != "none":
        grammar = tool_call_grammar(list(chosen), forced=choice != "auto", parallel=parallel)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream: must be true or false, not {kind_of(stream)}", "stream", "invalid_type")
    store = body.get("store", True) is not False
    options = SamplingOptions(max_tokens=int_field(body, "max_output_tokens", 1),
                              temperature=float_field(body, "temperature", 0.0, 2.0),
                              top_p=float_field(body, "top_p", 0.0, 1.0, low_open=True))
    req = GenerationRequest(messages=tuple(messages), options=options, stream=stream, model=str_field(body, "model"),
                            grammar=grammar, tools=chosen, tool_choice=choice, parallel_tool_calls=parallel,
                            **thinking_fields.thinking_controls(body, _effort(body.get("reasoning"))))
    return ResponsesRequest(req, store, prev, instructions, fmt, raw_tools, body.get("tool_choice", "auto"),
                            body.get("metadata") or {})


def _effort(reasoning: Any) -> Any:
    """reasoning.effort ("none" turns thinking off; any other value changes nothing, as on chat/completions)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise RequestError(f"reasoning: must be an object, not {kind_of(reasoning)}", "reasoning", "invalid_type")
    return reasoning.get("effort")


def _reasoning_text(item: dict, at: str) -> str:
    """A replayed reasoning item's text: its reasoning_text parts, else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise RequestError(f"{at}.content: must be an array of parts", f"{at}.content", "invalid_type")
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise RequestError(f"{at}.content: each part needs a text string", f"{at}.content", "invalid_value")
    return "\n".join(texts)


def _input(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("input: must be a string or a non-empty array of items", "input", "invalid_value")
    out: list[dict] = []
    reasoning = None  # a replayed reasoning item: it belongs to the assistant turn that follows it
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{at}: must be an object", at, "invalid_type")
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = _reasoning_text(item, at)
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{at}.role: must be user, assistant, system or developer (got {role!r})",
                                   f"{at}.role", "invalid_value")
            msg = {"role": "system" if role == "developer" else role,
                   "content": _content(item.get("content"), f"{at}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": str(item.get("name")), "arguments": str(item.get("arguments") or "{}")}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise RequestError(f"{at}.type: items of type {kind!r} are not supported", f"{at}.type",
                               "unsupported_value")
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or an array of parts", where, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]: parts of type {kind!r} are not supported (only input_text)",
                               f"{where}[{j}]", "unsupported_value")
        texts.append(part["text"])
    return "\n".join(texts)


# ---------------------------------------------------------------------------------------------- responses

def new_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _message_item(text: str, item_id: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str, item_id: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call) -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}


def response_object(rr: ResponsesRequest, result: Completion | None, *, response_id: str, model_name: str,
                    created: int | None = None, status: str | None = None, message_id: str | None = None,
                    reasoning_id: str | None = None) -> dict:
    """The "response" object (in progress when `result` is None)."""
    output, usage, incomplete = [], None, None
    if result is not None:
        c = result.choices[0]
        if c.reasoning:
            output.append(_reasoning_item(c.reasoning, reasoning_id or "rs_" + uuid.uuid4().hex))
        if c.text or not c.tool_calls:
            output.append(_message_item(c.text, message_id or "msg_" + uuid.uuid4().hex))
        output += [_call_item(t) for t in c.tool_calls or []]
        usage = {"input_tokens": result.prompt_tokens, "output_tokens": c.completion_tokens,
                 "total_tokens": result.prompt_tokens + c.completion_tokens,
                 "input_tokens_details": {"cached_tokens": result.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens}}
        if c.finish_reason == "length":
            incomplete = {"reason": "max_output_tokens"}
        status = status or ("incomplete" if incomplete else "completed")
    opts = rr.request.options
    return {"id": response_id, "object": "response", "created_at": created or int(time.time()),
            "status": status or "in_progress", "error": None, "incomplete_details": incomplete,
            "instructions": rr.instructions, "max_output_tokens": opts.max_tokens, "model": model_name,
            "output": output, "parallel_tool_calls": rr.request.parallel_tool_calls,
            "previous_response_id": rr.previous_response_id, "store": rr.store,
            "temperature": opts.temperature if opts.temperature is not None else 1.0,
            "top_p": opts.top_p if opts.top_p is not None else 1.0, "text": {"format": rr.text_format},
            "tool_choice": rr.tool_choice, "tools": rr.tools, "truncation": "disabled", "usage": usage,
            "metadata": rr.metadata}


def conversation(rr: ResponsesRequest, result: Completion) -> tuple[dict, ...]:
    """What a later previous_response_id continues: this request's messages and the answer."""
    c = result.choices[0]
    answer = {"role": "assistant", "content": c.text}
    if c.reasoning:
        answer["reasoning_content"] = c.reasoning  # replayed as the model's template replays it
    if c.tool_calls:
        answer["tool_calls"] = [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                                for t in c.tool_calls]
    return tuple(rr.request.messages) + (answer,)


@dataclass
class ResponseStream:
    """The events of one streamed response: response.created, response.in_progress, then a thinking model's
    reasoning item (response.output_item.added, response.reasoning_text.delta..., .done, output_item.done), the
    message item
    (response.output_item.added, response.content_part.added, response.output_text.delta...,
    response.output_text.done, response.content_part.done, response.output_item.done) and each function_call
    item (response.output_item.added, response.function_call_arguments.delta..., .done,
    response.output_item.done), then response.completed."""

    rr: ResponsesRequest
    id: str
    model: str
    created: int
    tool_names: Mapping[str, dict] | None = None  # name -> parameters' schema
    calls: list = field(default_factory=list)  # the function calls sent (ToolCall), for the final object
    _seq: int = 0
    msg_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    _open: bool = False  # the message item is open
    _msg_at: int = 0  # the message item's output_index (1 after a reasoning item)
    reasoning_id: str = field(default_factory=lambda: "rs_" + uuid.uuid4().hex)
    _reasoning: list[str] | None = None  # the reasoning item's text so far (None: no reasoning item)
    _reasoning_done: bool = False
    _items: int = 0  # output items added so far
    _text: list[str] = field(default_factory=list)
    _open_calls: dict = field(default_factory=dict)  # call index -> (ToolCall, output_index)
    _reader: ToolCallStream | None = field(init=False)  # reads the calls, when the request has tools

    def __post_init__(self):
        self._reader = None if self.tool_names is None else ToolCallStream(self.tool_names)

    def _ev(self, name: str, obj: dict) -> bytes:
        obj = {"type": name, "sequence_number": self._seq, **obj}
        self._seq += 1
        return named_event(name, obj)

    def start(self) -> bytes:
        obj = response_object(self.rr, None, response_id=self.id, model_name=self.model, created=self.created)
        return self._ev("response.created", {"response": obj}) + self._ev("response.in_progress", {"response": obj})

    def _open_message(self) -> bytes:
        if self._open:
            return b""
        out = self._close_reasoning()
        self._open, self._msg_at, self._items = True, self._items, self._items + 1
        at = self._msg_at
        return out + (self._ev("response.output_item.added", {"output_index": at, "item": {
                    "type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}})
                + self._ev("response.content_part.added", {"item_id": self.msg_id, "output_index": at,
                                                           "content_index": 0, "part": {"type": "output_text",
                                                                                        "text": "", "annotations": []}}))

    def _close_message(self) -> bytes:
        out = self._close_reasoning()
        if not self._open:
            return out
        self._open, at = False, self._msg_at
        full = "".join(self._text)
        return out + (self._ev("response.output_text.done", {"item_id": self.msg_id, "output_index": at,
                                                       "content_index": 0, "text": full, "logprobs": []})
                + self._ev("response.content_part.done", {"item_id": self.msg_id, "output_index": at,
                                                          "content_index": 0, "part": {"type": "output_text",
                                                                                       "text": full, "annotations": []}})
                + self._ev("response.output_item.done", {"output_index": at,
                                                         "item": _message_item(full, self.msg_id)}))

    def _text_delta(self, text: str) -> bytes:
        self._text.append(text)
        out = self._open_message()
        return out + self._ev("response.output_text.delta", {
            "item_id": self.msg_id, "output_index": self._msg_at, "content_index": 0, "delta": text, "logprobs": []})

    def _reasoning_delta(self, text: str) -> bytes:
        """A thinking model's reasoning: its own output item, before the message's."""
        out = b""
        if self._reasoning is None:
            self._reasoning, self._items = [], self._items + 1
            out = self._ev("response.output_item.added", {"output_index": 0, "item": {
                **_reasoning_item("", self.reasoning_id, "in_progress"), "content": []}})
        self._reasoning.append(text)
        return out + self._ev("response.reasoning_text.delta", {"item_id": self.reasoning_id, "output_index": 0,
                                                                "content_index": 0, "delta": text})

    def _close_reasoning(self) -> bytes:
        if self._reasoning is None or self._reasoning_done:
            return b""
        self._reasoning_done = True
        full = "".join(self._reasoning)
        return (self._ev("response.reasoning_text.done", {"item_id": self.reasoning_id, "output_index": 0,
                                                          "content_index": 0, "text": full})
                + self._ev("response.output_item.done", {"output_index": 0,
                                                         "item": _reasoning_item(full, self.reasoning_id)}))

    def events(self, d: Delta) -> bytes:
        out = self._reasoning_delta(d.reasoning) if d.reasoning else b""
        if self._reader is None:
            out += self._text_delta(d.text) if d.text else b""
        else:
            out += b"".join(self._event(e) for e in self._reader.push(d.text) +
                           (self._reader.finish() if d.finish_reason else []))
        if d.finish_reason:
            if not self._items or (self._items == 1 and self._reasoning is not None):
                out += self._open_message()  # an answer always has its message item, even an empty one
            out += self._close_message()
        return out

    def _event(self, e) -> bytes:
        """A function_call item opens with empty arguments; they follow in .delta pieces, whole in .done."""
        if isinstance(e, Text):
            return self._text_delta(e.text)
        if isinstance(e, CallStart):
            out = self._close_message()  # the message item (text before the calls) ends where the calls begin
            call, at = ToolCall(e.name, "", e.id), self._items
            self._open_calls[e.index] = (call, at)
            self._items += 1
            return out + self._ev("response.output_item.added", {"output_index": at, "item": {
                **_call_item(call), "status": "in_progress"}})
        call, at = self._open_calls[e.index]
        item_id = _call_item(call)["id"]
        if isinstance(e, CallArguments):
            return self._ev("response.function_call_arguments.delta", {"item_id": item_id, "output_index": at,
                                                                       "delta": e.text})
        self.calls.append(e.call)
        return (self._ev("response.function_call_arguments.done", {"item_id": item_id, "output_index": at,
                                                                   "arguments": e.call.arguments})
                + self._ev("response.output_item.done", {"output_index": at, "item": _call_item(e.call)}))

    def sent(self, result: Completion) -> Completion:
        """`result` as this stream sent it: the calls with the ids the client saw (a later function_call_output
        names them), and the text before them."""
        c = result.choices[0]
        if self.calls:
            c.text, c.tool_calls = "".join(self._text), list(self.calls)
            c.finish_reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return result

    def end(self, obj: dict) -> bytes:
        name = "response.completed" if obj["status"] == "completed" else "response.incomplete"
        return self._ev(name, {"response": obj})
