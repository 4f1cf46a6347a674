"""The Anthropic Messages wire format: /v1/messages bodies -> GenerationRequest, Completion -> message objects,
engine pieces -> named SSE events, and errors in Anthropic's shape.

Pure functions, no I/O. A Messages body is translated onto the same engine request a chat completion makes
(system -> a system message, tool_use / tool_result blocks -> tool calls and tool messages, input_schema ->
the tool's parameters, tool_choice any/tool -> a grammar-constrained call), so both routes run one engine path.

    parse_messages_request(body) / parse_count_tokens(body)  -> GenerationRequest
    message_object(result, ...)                               -> the "message" object
    MessageStream(...).events(delta) / .end(...)              -> SSE bytes, event by event
    error_body(status, message)                               -> {"type": "error", "error": {...}}
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from engine.api.fields import float_field, int_field, kind_of, object_body, str_field
from engine.api.constraints import parse_tools
from engine.api.sse import named_event
from engine.constrain.tools import tool_call_grammar
from engine.errors import RequestError
from engine.requests.request import Completion, Delta, GenerationRequest, SamplingOptions
from engine.templates.tool_stream import CallArguments, CallEnd, Text, ToolCallStream

MESSAGES_URL = "/v1/messages"
COUNT_TOKENS_URL = "/v1/messages/count_tokens"
URLS = (MESSAGES_URL, COUNT_TOKENS_URL)

# Accepted and without effect here: bookkeeping, caching and routing hints.
_IGNORED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id", "workspace_id"}
_FIELDS = _IGNORED | {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
                      "top_k", "stream", "tools", "tool_choice", "thinking"}
_COUNT_FIELDS = _IGNORED | {"model", "messages", "system", "tools", "tool_choice", "thinking"}

# HTTP status -> Anthropic error type. A full queue is 529 overloaded_error, as Anthropic answers.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          501: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


# ---------------------------------------------------------------------------------------------- parsing

def parse_messages_request(body: Any) -> GenerationRequest:
    """A /v1/messages body -> GenerationRequest (RequestError names what is wrong)."""
    body = object_body(body)
    _known(body, _FIELDS)
    max_tokens = int_field(body, "max_tokens", 1)
    if max_tokens is None:
        raise RequestError("max_tokens: Field required", "max_tokens", "missing_required_parameter")
    req = _translate(body)
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise RequestError("stop_sequences: must be an array of strings", "stop_sequences", "invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream: must be true or false, not {kind_of(stream)}", "stream", "invalid_type")
    options = SamplingOptions(max_tokens=max_tokens, temperature=float_field(body, "temperature", 0.0, 1.0),
                              top_p=float_field(body, "top_p", 0.0, 1.0, low_open=True), top_k=int_field(body, "top_k", 0),
                              stop=tuple(s for s in stops or () if s))
    return replace(req, options=options, stream=stream)


def parse_count_tokens(body: Any) -> GenerationRequest:
    """A /v1/messages/count_tokens body -> the request whose prompt is counted."""
    body = object_body(body)
    _known(body, _COUNT_FIELDS)
    return _translate(body)


def _translate(body: dict) -> GenerationRequest:
    tools = _tools(body.get("tools"))
    choice, parallel, chosen = _tool_choice(body.get("tool_choice"), tools)
    grammar = None
    if chosen and choice != "none":
        grammar = tool_call_grammar(list(chosen), forced=choice != "auto", parallel=parallel)
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    thinking, budget = _thinking(body.get("thinking"))
    return GenerationRequest(messages=tuple(messages), model=str_field(body, "model"), grammar=grammar, tools=chosen,
                             tool_choice=choice, parallel_tool_calls=parallel, thinking=thinking,
                             thinking_budget=budget)


def _thinking(value: Any) -> tuple[str | None, int | None]:
    """(mode, budget) of the `thinking` parameter: enabled (with budget_tokens) / adaptive -> on, disabled -> off,
    absent -> the server's mode."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return "off", None
    if kind == "adaptive":
        return "on", None
    if kind != "enabled":
        raise RequestError('thinking: must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                           '{"type": "disabled"}', "thinking", "invalid_value")
    return "on", int_field(value, "budget_tokens", 0)


def _known(body: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise RequestError(f"{unknown[0]}: Extra inputs are not permitted", unknown[0], "unsupported_parameter")


def _system(value: Any) -> list[dict]:
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if isinstance(value, list):
        return [{"role": "system", "content": "\n".join(_text_block(b, f"system[{i}]") for i, b in enumerate(value))}]
    raise RequestError(f"system: must be a string or an array of text blocks, not {kind_of(value)}", "system",
                       "invalid_type")


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else None
        raise RequestError(f'{where}: must be {{"type": "text", "text": "..."}} (got type {kind!r})', where,
                           "invalid_value")
    return block["text"]


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages: must be a non-empty array", "messages", "invalid_value")
    out: list[dict] = []
    for i, m in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise RequestError(f"{where}: must be an object, not {kind_of(m)}", where, "invalid_type")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}.role: Input should be 'user' or 'assistant' (got {role!r}); a system "
                               "prompt goes in the top-level system field", f"{where}.role", "invalid_value")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content: must be a string or an array of blocks", f"{where}.content",
                               "invalid_type")
        texts, calls, thoughts = [], [], []
        for j, b in enumerate(content):
            at = f"{where}.content.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(_text_block(b, at))
            elif kind == "thinking" and role == "assistant":  # replayed reasoning (Claude Code sends it each turn)
                if not isinstance(b.get("thinking"), str):
                    raise RequestError(f"{at}.thinking: must be a string", f"{at}.thinking", "invalid_type")
                thoughts.append(b["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by another provider: nothing a local model can read
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str):
                    raise RequestError(f"{at}.name: required", f"{at}.name", "missing_required_parameter")
                calls.append({"id": str(b.get("id") or ""), "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                result = b.get("content", "")
                if isinstance(result, list):
                    result = "\n".join(_text_block(r, f"{at}.content.{k}") for k, r in enumerate(result))
                if not isinstance(result, str):
                    raise RequestError(f"{at}.content: must be a string or text blocks", f"{at}.content",
                                       "invalid_value")
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id") or ""),
                            "content": ("Error: " if b.get("is_error") else "") + result})
            elif kind in ("image", "document"):
                raise RequestError(f"{at}: {kind} content is not supported", at, "unsupported_value")
            else:
                raise RequestError(f"{at}: content blocks of type {kind!r} are not supported in {role} messages",
                                   at, "unsupported_value")
        results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
        if results and texts:
            # Claude Code's shape: tool results plus reminder text in one user turn. The text travels with the
            # results, so the turn is not a new query (a thinking template would drop the loop's reasoning).
            out[-1]["content"] += "\n\n" + "\n".join(texts)
            continue
        msg = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if thoughts:
            msg["reasoning_content"] = "\n".join(thoughts)
        if texts or calls or role == "assistant":
            out.append(msg)
    return out


def _tools(value: Any) -> tuple[dict, ...] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise RequestError("tools: must be an array", "tools", "invalid_type")
    as_openai = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"tools.{i}: tools of type {kind!r} are not supported (only custom tools with an "
                               "input_schema)", f"tools.{i}", "unsupported_value")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object"})}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        as_openai.append({"type": "function", "function": fn})
    try:
        return parse_tools(as_openai)
    except RequestError as e:  # name the field as the client wrote it
        param = (e.param or "tools").replace("tools[", "tools.").replace("].function.parameters", ".input_schema") \
            .replace("].function.name", ".name")
        raise RequestError(str(e).replace(e.param or "", param, 1), param, e.code) from None


def _tool_choice(value: Any, tools: tuple[dict, ...] | None) -> tuple[str, bool, tuple[dict, ...] | None]:
    """(mode, parallel, tools): auto / any (-> required) / tool (-> one named) / none."""
    if value is None:
        return "auto", True, tools
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise RequestError("tool_choice: must be {\"type\": auto | any | tool | none}", "tool_choice", "invalid_value")
    parallel = not value.get("disable_parallel_tool_use", False)
    kind = value["type"]
    if kind in ("any", "tool") and not tools:
        raise RequestError(f"tool_choice: type {kind!r} needs tools", "tool_choice", "invalid_value")
    if kind == "tool":
        chosen = tuple(t for t in tools if t["name"] == value.get("name"))
        if not chosen:
            raise RequestError(f"tool_choice.name: names tool {value.get('name')!r}, which is not in tools",
                               "tool_choice.name", "invalid_value")
        return "function", parallel, chosen
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel, tools


# ---------------------------------------------------------------------------------------------- responses

def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


def stop_reason(finish: str, stop_sequence: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence else "end_turn"


def _thinking_block(text: str) -> dict:
    # The signature is Anthropic's proof that it wrote the thinking; a local model's has none, and clients send
    # the block back as they got it (it is read as replayed reasoning, never checked).
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call) -> dict:
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name, "input": args}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def message_object(result: Completion, *, model_name: str, message_id: str | None = None) -> dict:
    """The Messages API "message" for a result (its first choice: Messages has no n)."""
    c = result.choices[0]
    content = [_thinking_block(c.reasoning)] if c.reasoning else []
    # A reply that ended inside its thinking has only the thinking block (and stop_reason max_tokens).
    content += [{"type": "text", "text": c.text}] if c.text or not (c.tool_calls or content) else []
    content += [_tool_use(t) for t in c.tool_calls or []]
    return {"id": message_id or new_id(), "type": "message", "role": "assistant", "model": model_name,
            "content": content, "stop_reason": stop_reason(c.finish_reason, c.stop_sequence),
            "stop_sequence": c.stop_sequence,
            "usage": usage(result.prompt_tokens, result.cached_tokens, c.completion_tokens)}


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """The Messages API's usage: input_tokens counts the prompt tokens not read from the cache (Anthropic's
    convention: the three input counts add up to the prompt), cache_read_input_tokens those a warm session held."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


def error_status(status: int) -> int:
    """Anthropic answers a full queue (our 429) with 529 overloaded_error."""
    return 529 if status == 429 else status


@dataclass
class MessageStream:
    """The named events of one streamed message: message_start, then per content block
    content_block_start / ping (after the first) / content_block_delta... / content_block_stop, then
    message_delta (stop_reason, usage) and message_stop."""

    id: str
    model: str
    input_tokens: int
    tool_names: Mapping[str, dict] | None = None  # name -> parameters' schema
    # the prompt tokens a warm session held, known once the prompt is evaluated (message_delta's usage says it)
    cached_tokens: Callable[[], int] = lambda: 0
    _block: int = -1  # index of the last block opened (-1: none yet)
    _open: bool = False
    _thinking: bool = False  # the open block is a thinking block
    _output: int = 0
    _reader: ToolCallStream | None = field(init=False)  # reads the calls, when the request has tools

    def __post_init__(self):
        self._reader = None if self.tool_names is None else ToolCallStream(self.tool_names)

    def start(self) -> bytes:
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return named_event("message_start", {"type": "message_start", "message": msg})

    def _thought(self, text: str) -> bytes:
        """Reasoning: into the open thinking block, or a new one (a thinking block comes before the answer's)."""
        out = b""
        if not (self._open and self._thinking):
            out += self._close()
            self._block += 1
            self._open = self._thinking = True
            out += named_event("content_block_start", {"type": "content_block_start", "index": self._block,
                                                       "content_block": {"type": "thinking", "thinking": "",
                                                                         "signature": ""}})
            if self._block == 0:
                out += named_event("ping", {"type": "ping"})
        return out + named_event("content_block_delta", {"type": "content_block_delta", "index": self._block,
                                                         "delta": {"type": "thinking_delta", "thinking": text}})

    def _text(self, text: str) -> bytes:
        out = self._close() if self._thinking else b""
        if not self._open:
            self._block += 1
            self._open = True
            out += named_event("content_block_start", {"type": "content_block_start", "index": self._block,
                                                "content_block": {"type": "text", "text": ""}})
            if self._block == 0:
                out += named_event("ping", {"type": "ping"})
        if text:
            out += named_event("content_block_delta", {"type": "content_block_delta", "index": self._block,
                                                "delta": {"type": "text_delta", "text": text}})
        return out

    def _close(self) -> bytes:
        if not self._open:
            return b""
        out = b""
        if self._thinking:  # a thinking block ends with its signature, as Anthropic's do (empty here)
            out = named_event("content_block_delta", {"type": "content_block_delta", "index": self._block,
                                                      "delta": {"type": "signature_delta", "signature": ""}})
        self._open = self._thinking = False
        return out + named_event("content_block_stop", {"type": "content_block_stop", "index": self._block})

    def events(self, d: Delta) -> bytes:
        """The events for one piece of the answer (choice 0)."""
        self._output += d.new_tokens
        out = self._thought(d.reasoning) if d.reasoning else b""
        if self._reader is None:
            out += self._text(d.text) if d.text else b""
        else:
            out += b"".join(self._event(e) for e in self._reader.push(d.text) +
                            (self._reader.finish() if d.finish_reason else []))
        if d.finish_reason:
            if self._block < 0:
                out += self._text("")  # a message always has a content block, even an empty one
            called = self._reader is not None and self._reader.started
            finish = "tool_calls" if called and d.finish_reason == "stop" else d.finish_reason
            out += self._close()
            out += named_event("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop_reason(finish, d.stop_sequence),
                                                   "stop_sequence": d.stop_sequence},
                                         "usage": usage(self.input_tokens, self.cached_tokens(), self._output)})
            out += named_event("message_stop", {"type": "message_stop"})
        return out

    def _event(self, e) -> bytes:
        """A tool_use block opens with an empty input, its JSON follows in input_json_delta pieces."""
        if isinstance(e, Text):
            return self._text(e.text)
        if isinstance(e, CallArguments):
            return named_event("content_block_delta", {"type": "content_block_delta", "index": self._block,
                                                "delta": {"type": "input_json_delta", "partial_json": e.text}})
        if isinstance(e, CallEnd):
            return self._close()
        out = self._close()
        self._block += 1
        self._open = True
        out += named_event("content_block_start", {"type": "content_block_start", "index": self._block, "content_block": {
            "type": "tool_use", "id": _tool_use_id(e.id), "name": e.name, "input": {}}})
        if self._block == 0:
            out += named_event("ping", {"type": "ping"})
        return out

    @staticmethod
    def error(status: int, message: str) -> bytes:
        return named_event("error", error_body(status, message))
