"""Server-sent events for the OpenAI streaming format: engine pieces (`Delta`) -> chunk objects -> bytes.

Pure functions, no I/O. A stream of one request is, as OpenAI sends it:

    chat:         a role chunk per choice (delta {"role": "assistant", "content": ""}), a thinking model's
                  reasoning chunks (delta {"reasoning_content": ...}), content chunks (delta {"content": ...}),
                  with tools tool_calls chunks (a call's index, id, type and name, then its arguments piece by
                  piece), a finish chunk per choice (delta {}, finish_reason), then
                  with stream_options.include_usage a last chunk with "choices": [] and the usage
                  (every other chunk then carries "usage": null), then `data: [DONE]`.
    completions:  text chunks, the last of each choice with its finish_reason; usage and [DONE] alike.

The chunks carry exactly the text and logprobs the non-streamed object carries (both are built from the
same pieces by engine.requests.request), so a stream joined up equals the answer without streaming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

from engine.api.openai_objects import chat_logprobs, completion_logprobs, usage
from engine.requests.request import Delta
from engine.templates.tool_stream import CallArguments, CallStart, Text, ToolCallStream

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    """One SSE data event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def named_event(name: str, obj: dict) -> bytes:
    """One SSE event with a name (Anthropic's and the Responses API's streams)."""
    return f"event: {name}\ndata: ".encode() + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def comment(text: str = "keep-alive") -> bytes:
    """An SSE comment: clients ignore it; it keeps proxies and client read timeouts from closing a quiet
    stream (a long prompt being processed, a request waiting in the queue)."""
    return b": " + text.encode() + b"\n\n"


@dataclass(frozen=True)
class Stream:
    """What every chunk of one streamed response repeats."""

    kind: str  # "chat" or "completion"
    id: str
    created: int
    model: str
    logprobs: bool = False
    include_usage: bool = False
    # With tools: the names an answer may call. Its calls are read as they come (engine.templates.tool_stream)
    # and sent as tool_calls deltas: a call's id and name, then its arguments piece by piece.
    tool_names: Mapping[str, dict] | None = field(default=None, compare=False)  # name -> parameters' schema
    post_sampling: bool = False  # logprobs in llama.cpp's post_sampling_probs shape
    _readers: dict = field(default_factory=dict, compare=False, repr=False)  # choice index -> ToolCallStream

    def _chunk(self, choices: list[dict]) -> dict:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            obj["usage"] = None
        return obj

    def chunks(self, d: Delta, first: bool) -> list[dict]:
        """The chunks for one piece of choice d.index; `first`: the choice's first piece."""
        if self.kind == "chat":
            return self._chat_chunks(d, first)
        lp = completion_logprobs(d.logprobs or [], self.post_sampling) if self.logprobs else None
        return [self._chunk([{"text": d.text, "index": d.index, "logprobs": lp, "finish_reason": d.finish_reason}])]

    def _chat_chunks(self, d: Delta, first: bool) -> list[dict]:
        out = []
        if first:
            out.append(self._chunk([{"index": d.index, "delta": {"role": "assistant", "content": "", "refusal": None},
                                     "logprobs": None, "finish_reason": None}]))
        if d.reasoning:  # a thinking model's reasoning streams apart from the answer
            out.append(self._chunk([{"index": d.index, "delta": {"reasoning_content": d.reasoning},
                                     "logprobs": None, "finish_reason": None}]))
        text, events, finish = d.text, [], d.finish_reason
        if self.tool_names is not None:
            reader = self._readers.setdefault(d.index, ToolCallStream(self.tool_names))
            events = reader.push(d.text) + (reader.finish() if finish else [])
            text = "".join(e.text for e in events if isinstance(e, Text))  # text only ever comes before calls
            if reader.started and finish == "stop":
                finish = "tool_calls"
        if text or d.logprobs:
            lp = chat_logprobs(d.logprobs or [], self.post_sampling) if self.logprobs else None
            out.append(self._chunk([{"index": d.index, "delta": {"content": text}, "logprobs": lp,
                                     "finish_reason": None}]))
        for e in events:  # OpenAI's shape: index, id, type and name first, then the arguments piece by piece
            if isinstance(e, CallStart):
                call = {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
            elif isinstance(e, CallArguments):
                call = {"index": e.index, "function": {"arguments": e.text}}
            else:
                continue
            out.append(self._chunk([{"index": d.index, "delta": {"tool_calls": [call]}, "logprobs": None,
                                     "finish_reason": None}]))
        if finish:
            out.append(self._chunk([{"index": d.index, "delta": {}, "logprobs": None, "finish_reason": finish}]))
        return out

    def progress_chunk(self, progress: dict) -> dict:
        """llama.cpp's prompt progress (return_progress): a chunk with no choices and `prompt_progress`."""
        return {**self._chunk([]), "prompt_progress": progress}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                    reasoning_tokens: int = 0) -> dict | None:
        """The closing usage chunk, when the request asked for one (stream_options.include_usage)."""
        if not self.include_usage:
            return None
        obj = self._chunk([])
        obj["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)
        return obj
