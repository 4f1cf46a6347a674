"""Server-sent events for the OpenAI streaming format: engine pieces (`Delta`) -> chunk objects -> bytes.

Pure functions, no I/O. A stream of one request is, as OpenAI sends it:

    chat:         a role chunk per choice (delta {"role": "assistant", "content": ""}), content chunks
                  (delta {"content": ...}), a finish chunk per choice (delta {}, finish_reason), then
                  with stream_options.include_usage a last chunk with "choices": [] and the usage
                  (every other chunk then carries "usage": null), then `data: [DONE]`.
    completions:  text chunks, the last of each choice with its finish_reason; usage and [DONE] alike.

The chunks carry exactly the text and logprobs the non-streamed object carries (both are built from the
same pieces by engine.requests), so a stream joined up equals the answer without streaming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.api.openai import chat_logprobs, completion_logprobs, usage
from engine.requests import Delta
from engine.templates.tools import ToolCallSplitter

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    """One SSE data event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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
    # With tools: the names an answer may call. Text from a <tool_call> opener on is held back and sent
    # as tool_calls deltas at the end of the choice (its arguments whole, one delta per call).
    tool_names: frozenset[str] | None = None
    _splitters: dict = field(default_factory=dict, compare=False, repr=False)

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
        lp = completion_logprobs(d.logprobs or []) if self.logprobs else None
        return [self._chunk([{"text": d.text, "index": d.index, "logprobs": lp, "finish_reason": d.finish_reason}])]

    def _chat_chunks(self, d: Delta, first: bool) -> list[dict]:
        out = []
        if first:
            out.append(self._chunk([{"index": d.index, "delta": {"role": "assistant", "content": "", "refusal": None},
                                     "logprobs": None, "finish_reason": None}]))
        text, calls, finish = d.text, [], d.finish_reason
        if self.tool_names is not None:
            splitter = self._splitters.setdefault(d.index, ToolCallSplitter())
            text = splitter.push(d.text)
            if d.finish_reason:
                rest, calls = splitter.finish(set(self.tool_names))
                text += rest
                if calls and finish == "stop":
                    finish = "tool_calls"
        if text or d.logprobs:
            lp = chat_logprobs(d.logprobs or []) if self.logprobs else None
            out.append(self._chunk([{"index": d.index, "delta": {"content": text}, "logprobs": lp,
                                     "finish_reason": None}]))
        for i, call in enumerate(calls):  # OpenAI's shape: id, type and name first, then the arguments
            out.append(self._chunk([{"index": d.index, "delta": {"tool_calls": [
                {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]},
                "logprobs": None, "finish_reason": None}]))
            out.append(self._chunk([{"index": d.index, "delta": {"tool_calls": [
                {"index": i, "function": {"arguments": call.arguments}}]}, "logprobs": None, "finish_reason": None}]))
        if finish:
            out.append(self._chunk([{"index": d.index, "delta": {}, "logprobs": None, "finish_reason": finish}]))
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict | None:
        """The closing usage chunk, when the request asked for one (stream_options.include_usage)."""
        if not self.include_usage:
            return None
        obj = self._chunk([])
        obj["usage"] = usage(prompt_tokens, completion_tokens)
        return obj
