"""Ollama's wire format, its answers: the /api/chat and /api/generate objects, their NDJSON stream, the dialect the
server's generation routes run them with (dialects.py says what a dialect does), and Ollama's error shape.

    chat:      {"model", "created_at", "message": {"role": "assistant", "content", "thinking"?, "tool_calls"?},
                "done": true, "done_reason", "total_duration", "load_duration", "prompt_eval_count",
                "prompt_eval_duration", "eval_count", "eval_duration"} (durations in nanoseconds)
    generate:  the same with "response" (and "thinking") in place of "message"
    stream:    one JSON object a line (application/x-ndjson), "done": false, each with a piece of the text (a
               chat's with a `message` whose `content` is "" when the piece is thinking or calls); the last with
               "done": true, the counts and durations, and an empty text. No keep-alive lines: Ollama's clients
               read every line as JSON.
    errors:    {"error": "..."} with the HTTP status; in a stream, an {"error": ...} line ends it.
Tool calls: {"function": {"name", "arguments": {...}}}, the arguments an object (OpenAI sends a JSON string).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Callable

from engine.api.ollama import CHAT_URL, parse_chat, parse_generate
from engine.api.openai_objects import new_id
from engine.requests.request import Collector, Completion, Delta, GenerationRequest, Timings
from engine.templates.tool_stream import CallArguments, CallStart, Text, ToolCallStream

__all__ = ["Ollama", "created_at", "error_body", "load_answer", "line"]

_DONE_REASON = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def error_body(message: str) -> dict:
    return {"error": message}


def _reply(model: str, chat: bool, text: str = "", thinking: str | None = None, calls: list | None = None,
           logprobs=None) -> dict:
    """What every answer object and stream line of chat (a `message`) or generate (`response`) holds."""
    obj: dict[str, Any] = {"model": model, "created_at": created_at()}
    if chat:
        obj["message"] = {"role": "assistant", "content": text}
        if thinking:
            obj["message"]["thinking"] = thinking
        if calls:
            obj["message"]["tool_calls"] = calls
    else:
        obj["response"] = text
        if thinking:
            obj["thinking"] = thinking
    if logprobs is not None:
        obj["logprobs"] = _logprobs(logprobs)
    return obj


def load_answer(url: str, model_name: str, unload: bool = False) -> dict:
    """The answer to a request that only loads (or, keep_alive 0, unloads) a model: goinfer keeps its models
    loaded, so it is done at once."""
    return {**_reply(model_name, url == CHAT_URL), "done": True, "done_reason": "unload" if unload else "load"}


def _counts(prompt_tokens: int, generated: int, timings: Timings | None) -> dict:
    t = timings or Timings(0.0, 0.0, 0.0, 0.0, prompt_tokens, generated)
    ns = lambda s: int(s * 1e9)  # noqa: E731
    return {"total_duration": ns(t.total_s), "load_duration": 0, "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": ns(t.prompt_s), "eval_count": generated, "eval_duration": ns(t.generate_s)}


def _calls(calls) -> list[dict]:
    """Tool calls as Ollama sends them: the arguments an object."""
    return [{"function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in calls]


def _logprobs(items) -> list[dict]:
    def one(piece: bytes, logprob: float) -> dict:
        return {"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}

    return [{**one(lp.piece, lp.logprob), "top_logprobs": [one(p, v) for _, p, v in lp.top]}
            for lp in items if lp.logprob is not None]


class Ollama:
    """The dialect of /api/chat and /api/generate (one answer per request: Ollama has no n), and the error shape of
    every Ollama route."""

    counts_tokens = False
    media_type = "application/x-ndjson"

    def __init__(self, url: str):
        self.url = url
        self.chat = url == CHAT_URL

    def keepalive(self) -> bytes:
        return b""

    def parse(self, body: Any) -> GenerationRequest:
        return parse_chat(body) if self.chat else parse_generate(body)

    def new_id(self, req: GenerationRequest) -> str:
        return new_id(req.kind)  # X-Request-Id (and llama.cpp's control route's handle)

    def answer(self, req, result: Completion, *, job_id, model_name, created, timings=None) -> dict:
        choice = result.choices[0]
        obj = _reply(model_name, self.chat, choice.text, choice.reasoning,
                     _calls(choice.tool_calls) if choice.tool_calls else None, choice.logprobs)
        return {**obj, "done": True, "done_reason": _DONE_REASON.get(choice.finish_reason, "stop"),
                **_counts(result.prompt_tokens, result.completion_tokens, timings)}

    def stream(self, req, *, job_id, model_name, created, prompt_tokens, cached_tokens=lambda: 0,
               timings: Callable[[], Timings] | None = None) -> _Stream:
        return _Stream(self.chat, model_name, prompt_tokens, req, timings)

    def error(self, status: int, body: dict) -> tuple[int, dict]:
        error = body["error"]  # (OpenAI's shape, or Ollama's already)
        return status, error_body(error["message"] if isinstance(error, dict) else error)

    def count(self, n: int) -> dict:
        raise NotImplementedError("this route generates; it does not count tokens")


class _Stream:
    def __init__(self, chat: bool, model: str, prompt_tokens: int, req: GenerationRequest,
                 timings: Callable[[], Timings] | None):
        self.chat, self.model, self.prompt_tokens, self.timings = chat, model, prompt_tokens, timings
        self.logprobs = req.logprobs
        self.reader = ToolCallStream(req.tool_schemas) if req.calls_tools else None
        self.calls: list[dict] = []  # the calls read so far: {"name", "arguments" (JSON text so far)}
        self.finish_reason = "stop"

    def start(self) -> bytes:
        return b""

    def _line(self, text: str = "", thinking: str = "", calls: list | None = None, logprobs=None) -> bytes:
        return line({**_reply(self.model, self.chat, text, thinking, calls, logprobs or None), "done": False})

    def piece(self, d: Delta) -> bytes:
        if d.index != 0:
            return b""
        if d.finish_reason:
            self.finish_reason = d.finish_reason
        text, out = d.text, b""
        if self.reader is not None:
            events = self.reader.push(d.text) + (self.reader.finish() if d.finish_reason else [])
            text = "".join(e.text for e in events if isinstance(e, Text))  # text only ever comes before calls
            for e in events:
                if isinstance(e, CallStart):
                    self.calls.append({"name": e.name, "arguments": ""})
                elif isinstance(e, CallArguments):
                    self.calls[e.index]["arguments"] += e.text
        if text or d.reasoning or (self.logprobs and d.logprobs):
            out += self._line(text, d.reasoning, logprobs=d.logprobs if self.logprobs else None)
        if d.finish_reason and self.calls:  # the calls, whole, once the answer is read to its end
            out += self._line(calls=[{"function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                                     for c in self.calls])
        return out

    def finish(self, out: Collector) -> bytes:
        timings = self.timings() if self.timings is not None else None
        return line({**_reply(self.model, self.chat), "done": True, "done_reason": _DONE_REASON.get(self.finish_reason, "stop"),
                     **_counts(self.prompt_tokens, out.generated, timings)})

    def error(self, status: int, body: dict) -> bytes:
        return line(error_body(body["error"]["message"]))


def _arguments(text: str) -> Any:
    """A call's arguments (JSON text) as an object (the grammar makes them JSON; kept as text otherwise)."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text
