"""One Dialect per wire format: everything the server needs to serve a generation route, so its handler moves bytes
and holds no per-format branch. A new route is a dialect and one Route naming it (engine/server/generating.py).

A dialect is made per request (it may keep what its parse saw: the Responses API's request around the engine
request) and answers, in its own format:
    parse(body) -> GenerationRequest            every refusal a RequestError naming the field
    new_id(req)                                 the answer's id (chatcmpl-..., msg_..., resp_...)
    answer(req, result, ...) -> dict            the whole answer (timings: the job's, for the formats that report them)
    stream(req, ...) -> StreamEncoder           the answer as server-sent events (media_type: as the format
                                                streams, e.g. Ollama's NDJSON), piece by piece; keepalive() the
                                                bytes a quiet stream sends (b"": none, where the format has none)
    error(status, body) -> (status, body)       an OpenAI-shaped error (openai_objects.error_object) in its shape
A dialect with `counts_tokens` never generates: the server answers `count(n)` with the prompt's token count.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from engine.api import anthropic, responses, sse
from engine.api.llamacpp import timings_object
from engine.api.openai import parse_request
from engine.api.openai_objects import new_id, response_object
from engine.requests.request import Collector, Completion, Delta, GenerationRequest, Timings


class StreamEncoder(Protocol):
    def start(self) -> bytes:
        """What the stream opens with, before any piece."""

    def piece(self, d: Delta) -> bytes:
        """The events for one piece of one choice."""

    def finish(self, out: Collector) -> bytes:
        """What follows the last piece (out holds the whole answer)."""

    def error(self, status: int, body: dict) -> bytes:
        """An error met after the stream began (too late for a status): the event that reports it."""


class Dialect(Protocol):
    counts_tokens: bool
    media_type: str

    def keepalive(self) -> bytes: ...

    def parse(self, body: Any) -> GenerationRequest: ...

    def new_id(self, req: GenerationRequest) -> str: ...

    def answer(self, req: GenerationRequest, result: Completion, *, job_id: str, model_name: str,
               created: int, timings: Timings | None = None) -> dict: ...

    def stream(self, req: GenerationRequest, *, job_id: str, model_name: str, created: int,
               prompt_tokens: int, cached_tokens: Callable[[], int] = lambda: 0,
               timings: Callable[[], Timings] | None = None) -> StreamEncoder:
        """cached_tokens: the prompt tokens a warm session held, known once the prompt is evaluated; timings: the
        job's so far."""

    def error(self, status: int, body: dict) -> tuple[int, dict]: ...

    def count(self, n: int) -> dict: ...


def _tool_names(req: GenerationRequest) -> dict[str, dict] | None:
    """The tools whose calls a stream reads out of the text (each name to its parameters' schema), or None when
    the request calls none."""
    return req.tool_schemas if req.calls_tools else None


class _Generating:
    """What the generating dialects share: they generate (no token count) and, unless they say otherwise, answer
    errors in OpenAI's shape."""

    counts_tokens = False
    media_type = "text/event-stream; charset=utf-8"

    def keepalive(self) -> bytes:
        return sse.comment()

    def error(self, status: int, body: dict) -> tuple[int, dict]:
        return status, body

    def count(self, n: int) -> dict:
        raise NotImplementedError("this route generates; it does not count tokens")


# ---------------------------------------------------------------------------------------------- OpenAI

class OpenAIDialect(_Generating):
    """/v1/chat/completions and /v1/completions."""

    def __init__(self, url: str):
        self.url = url

    def parse(self, body: Any) -> GenerationRequest:
        return parse_request(self.url, body)

    def new_id(self, req: GenerationRequest) -> str:
        return new_id(req.kind)

    def answer(self, req, result, *, job_id, model_name, created, timings=None) -> dict:
        obj = response_object(req, result, model_name=model_name, request_id=job_id, created=created)
        if timings is not None:  # llama.cpp's, beside OpenAI's fields (its clients show speeds from them)
            obj["timings"] = timings_object(timings, result.cached_tokens)
        return obj

    def stream(self, req, *, job_id, model_name, created, prompt_tokens, cached_tokens=lambda: 0,
               timings=None) -> StreamEncoder:
        return _OpenAIStream(sse.Stream(req.kind, job_id, created, model_name, req.logprobs, req.include_usage,
                                        _tool_names(req), req.post_sampling_probs), prompt_tokens, timings,
                             cached_tokens,
                             req.timings_per_token)


class _OpenAIStream:
    """Data-only chunks for every choice, then the usage chunk (when asked for) and [DONE]. A choice's finish
    chunk carries llama.cpp's `timings` (every chunk does with timings_per_token)."""

    def __init__(self, info: sse.Stream, prompt_tokens: int, timings=None, cached=lambda: 0, per_token=False):
        self.info, self.prompt_tokens = info, prompt_tokens
        self.timings, self.cached, self.per_token = timings, cached, per_token
        self.started: set[int] = set()  # choices whose first chunk went out

    def start(self) -> bytes:
        return b""

    def piece(self, d: Delta) -> bytes:
        chunks = self.info.chunks(d, first=d.index not in self.started)
        if self.timings is not None and chunks and (self.per_token or d.finish_reason):
            t = timings_object(self.timings(), self.cached())
            for c in chunks if self.per_token else chunks[-1:]:
                c["timings"] = t
        self.started.add(d.index)
        return b"".join(sse.event(c) for c in chunks)

    def progress(self, done: int, total: int, cached: int, seconds: float) -> bytes:
        """llama.cpp's prompt_progress (return_progress): `done` of `total` prompt tokens evaluated or reused
        (`cached` of them reused from a warm session)."""
        return sse.event(self.info.progress_chunk({"total": total, "cache": cached, "processed": done,
                                                   "time_ms": seconds * 1e3}))

    def finish(self, out: Collector) -> bytes:
        confidence = out.confidence()  # goinfer_confidence: one event after the finish chunk
        head = sse.event({"id": self.info.id, "goinfer_confidence": confidence}) if confidence is not None else b""
        last = self.info.usage_chunk(self.prompt_tokens, out.generated, out.cached_tokens, out.reasoning_tokens)
        return head + (sse.event(last) if last is not None else b"") + sse.DONE

    def error(self, status: int, body: dict) -> bytes:
        return sse.event(body)  # as OpenAI sends it; the stream then ends


# ---------------------------------------------------------------------------------------------- Anthropic

class AnthropicMessages(_Generating):
    """/v1/messages: the Messages API (one choice, named events, errors in Anthropic's shape)."""

    def parse(self, body: Any) -> GenerationRequest:
        return anthropic.parse_messages_request(body)

    def new_id(self, req: GenerationRequest) -> str:
        return anthropic.new_id()

    def answer(self, req, result, *, job_id, model_name, created, timings=None) -> dict:
        return anthropic.message_object(result, model_name=model_name, message_id=job_id)

    def stream(self, req, *, job_id, model_name, created, prompt_tokens, cached_tokens=lambda: 0,
               timings=None) -> StreamEncoder:
        return _NamedStream(anthropic.MessageStream(job_id, model_name, prompt_tokens, _tool_names(req),
                                                    cached_tokens),
                            lambda status, body: anthropic.MessageStream.error(anthropic.error_status(status),
                                                                               body["error"]["message"]))

    def error(self, status: int, body: dict) -> tuple[int, dict]:
        status = anthropic.error_status(status)
        return status, anthropic.error_body(status, body["error"]["message"])


class AnthropicCountTokens(AnthropicMessages):
    """/v1/messages/count_tokens: the prompt a Messages body would make, counted; nothing generated."""

    counts_tokens = True

    def parse(self, body: Any) -> GenerationRequest:
        return anthropic.parse_count_tokens(body)

    def count(self, n: int) -> dict:
        return {"input_tokens": n}


class _NamedStream:
    """Named events of the first choice (Messages and Responses have no n): the stream object's start and
    events, and its own error event."""

    def __init__(self, info, error: Callable[[int, dict], bytes]):
        self.info, self._error = info, error

    def start(self) -> bytes:
        return self.info.start()

    def piece(self, d: Delta) -> bytes:
        return self.info.events(d) if d.index == 0 else b""

    def finish(self, out: Collector) -> bytes:
        return b""  # the last piece's events closed the message

    def error(self, status: int, body: dict) -> bytes:
        return self._error(status, body)


# ---------------------------------------------------------------------------------------------- Responses

class ResponsesDialect(_Generating):
    """/v1/responses: the Responses API, with the server's store behind `store` and `previous_response_id`."""

    def __init__(self, store: responses.ResponseStore):
        self.store = store
        self.rr: responses.ResponsesRequest | None = None  # the request around the engine request, once parsed

    def parse(self, body: Any) -> GenerationRequest:
        self.rr = responses.parse_responses_request(body, self.store.get)
        return self.rr.request

    def new_id(self, req: GenerationRequest) -> str:
        return responses.new_id()

    def answer(self, req, result, *, job_id, model_name, created, timings=None, message_id: str | None = None,
               reasoning_id: str | None = None) -> dict:
        obj = responses.response_object(self.rr, result, response_id=job_id, model_name=model_name,
                                        created=created, message_id=message_id, reasoning_id=reasoning_id)
        if self.rr.store:
            self.store.put(obj, responses.conversation(self.rr, result))
        return obj

    def stream(self, req, *, job_id, model_name, created, prompt_tokens, cached_tokens=lambda: 0,
               timings=None) -> StreamEncoder:
        return _ResponsesStream(self, responses.ResponseStream(self.rr, job_id, model_name, created,
                                                               _tool_names(req)))


class _ResponsesStream(_NamedStream):
    """Ends with response.completed (or .incomplete) carrying the whole response object, stored when asked."""

    def __init__(self, dialect: ResponsesDialect, info: responses.ResponseStream):
        super().__init__(info, lambda status, body: sse.named_event("error", {"type": "error", **body["error"]}))
        self.dialect = dialect

    def finish(self, out: Collector) -> bytes:
        info = self.info
        result = info.sent(out.result())
        obj = self.dialect.answer(None, result, job_id=info.id, model_name=info.model, created=info.created,
                                  message_id=info.msg_id, reasoning_id=info.reasoning_id)
        return info.end(obj)
