"""The generation routes: a body read by its wire format's Dialect (engine/api/dialects.py), prepared, queued on
the served model's scheduler, and answered whole or as a stream; llama.cpp's control route, which reaches a running
reply; and GET /v1/responses/{id}, the Responses API's stored answers.

No per-format branch here: what a body means, what the answer and its stream hold and the shape of its errors are
the dialect's, and a new generation route is one more Route with its dialect.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

from engine.api import anthropic
from engine.api.dialects import AnthropicCountTokens, AnthropicMessages, OpenAIDialect, ResponsesDialect
from engine.api.fields import known_fields, object_body, str_field
from engine.api.openai import CHAT_URL, COMPLETIONS_URL
from engine.api.openai_objects import error_body, error_object, error_status
from engine.api.responses import RESPONSES_URL
from engine.errors import Cancelled, GoinferError, RequestError
from engine.requests.prompts import prompt_ids
from engine.requests.request import Collector, Delta, prepare
from engine.running.scheduler import Finished, Job, QueueFull, ShuttingDown
from engine.server.intake import ClientGone, HTTPError
from engine.server.routes import Route, not_found, unknown_model

__all__ = ["CONTROL_URL", "ROUTES"]

CONTROL_URL = "/v1/chat/completions/control"  # llama.cpp's: a running reply told to end its thinking now
TICK_S = 0.1  # how often a waiting handler looks at its client's socket


_UNREAD = object()


def generate(ex, body=_UNREAD) -> None:
    """Answer a generation route's request (`body`: read already, by a route that looked at it first)."""
    body = ex.json_body() if body is _UNREAD else body
    dialect, state = ex.dialect, ex.state
    cancel = threading.Event()
    try:
        req = dialect.parse(body)
        served = state.route(req.model)
        if served is None:
            raise unknown_model(state, req.model)
        ex.model_name = served.name
        if dialect.counts_tokens:
            ex.send_json(200, dialect.count(len(prompt_ids(served.model, req, state.thinking))))
            return
        scheduler = state.schedulers[served.name]
        _admissible(scheduler, served.name, scheduler.check_room)  # before tokenising and grammar work
        prep = prepare(served.model, req, window=served.window, thinking=state.thinking)
    except GoinferError as e:
        raise HTTPError(error_status(e), error_body(e)) from None
    job = Job(prep, cancel, dialect.new_id(req))
    _admissible(scheduler, served.name, lambda: scheduler.submit(job))
    state.running[job.id] = job  # for POST /v1/chat/completions/control
    try:
        if req.stream:
            _stream(ex, job, req, served.name)
        else:
            _answer(ex, job, req, served.name)
    except ClientGone:
        scheduler.withdraw(job, "client disconnected")
        ex.note = f"client disconnected after {job.generated} tokens; generation stopped"
        raise
    finally:
        state.running.pop(job.id, None)
        if not job.done:
            scheduler.withdraw(job, "request ended")


def _admissible(scheduler, name: str, attempt) -> None:
    """attempt() (a queue check, or the submission), its refusals as the answers they get."""
    try:
        attempt()
    except QueueFull as e:
        raise HTTPError(429, error_object(
            f"{name} is busy: {e.waiting} requests are waiting (--max-queue {scheduler.max_queue}); "
            f"retry after {e.retry_after} s", "rate_limit_error", None, "queue_full"),
            {"Retry-After": str(e.retry_after)}) from None
    except ShuttingDown:
        raise _shutting_down() from None


def _shutting_down() -> HTTPError:
    return HTTPError(503, error_object("the server is shutting down", "server_error", None, "shutting_down"))


def _stream_error(e: GoinferError | HTTPError) -> tuple[int, dict]:
    """(status, OpenAI error body) of an error met after a stream began: too late to answer with it."""
    if isinstance(e, HTTPError):
        return e.status, e.body
    return error_status(e), error_body(e)


def _events(ex, job: Job, *, stream: bool, tick=lambda: None) -> Iterator[Delta]:
    """The job's pieces as the scheduler makes them. Meanwhile: watch the client's socket (a client that
    left cancels the job), on a stream send a keep-alive comment after keepalive_s of silence, and call tick()
    whenever it wakes (a stream's progress events)."""
    last_check = 0.0
    keepalive = job.prep.request.keepalive_s  # the request's own (llama.cpp's sse_ping_interval), else the server's
    keepalive = ex.state.keepalive_s if keepalive is None else keepalive
    while True:
        try:
            item = job.events.get(timeout=TICK_S)
        except queue.Empty:
            item = None
        tick()
        now = time.monotonic()
        if now - last_check >= TICK_S:
            last_check = now
            if ex.client_gone():
                raise ClientGone()
            if stream and now - ex.last_write >= keepalive:
                ex.send_events(ex.dialect.keepalive())
        if item is None:
            continue
        if isinstance(item, Finished):
            if item.error is None:
                return
            if isinstance(item.error, Cancelled) and ex.state.closing:
                raise _shutting_down()
            if not isinstance(item.error, GoinferError):  # a bug; the scheduler logged its traceback
                raise HTTPError(500, error_object("internal server error (see the server log)", "server_error",
                                                  None, "internal_error"))
            raise item.error
        yield item


def _answer(ex, job: Job, req, model_name: str) -> None:
    out = Collector(job.prep)
    try:
        for d in _events(ex, job, stream=False):
            out.add(d)
    except GoinferError as e:
        raise HTTPError(error_status(e), error_body(e)) from None
    ex.usage = (len(job.prep.ids), out.generated)
    obj = ex.dialect.answer(req, out.result(), job_id=job.id, model_name=model_name, created=job.created,
                            timings=job.timings())
    ex.send_json(200, obj, {"X-Request-Id": job.id})


def _stream(ex, job: Job, req, model_name: str) -> None:
    ex.start_events({"X-Request-Id": job.id}, ex.dialect.media_type)
    enc = ex.dialect.stream(req, job_id=job.id, model_name=model_name, created=job.created,
                            prompt_tokens=len(job.prep.ids), cached_tokens=lambda: job.prep.cached_tokens,
                            timings=job.timings)
    ex.send_events(enc.start())
    out = Collector(job.prep)
    try:
        for d in _events(ex, job, stream=True, tick=_progress(ex, job, enc)):
            out.add(d)
            ex.send_events(enc.piece(d))
    except (GoinferError, HTTPError) as e:
        # Too late for a status: the error goes in the stream, as each format sends it, and the stream ends.
        status, body = _stream_error(e)
        ex.note = f"error in stream: {body['error']['message']}"
        ex.send_events(enc.error(status, body))
        ex.write_chunk(b"")
        return
    ex.usage = (len(job.prep.ids), out.generated)
    ex.send_events(enc.finish(out))
    ex.write_chunk(b"")  # the zero-length chunk: end of the response


def _progress(ex, job: Job, enc):
    """The tick that sends llama.cpp's prompt progress (return_progress) each time more of the prompt is in, until
    the first token; nothing where the request did not ask or its format has no such event."""
    report = getattr(enc, "progress", None) if job.prep.request.return_progress else None
    sent = [-1]

    def tick() -> None:
        done = job.prompt_done
        if report is None or done == sent[0] or job.started is None or sent[0] == len(job.prep.ids):
            return
        sent[0] = done
        ex.send_events(report(done, len(job.prep.ids), job.prep.cached_tokens, time.monotonic() - job.started))

    return tick


def control(ex) -> None:
    """`{"id": REQUEST_ID, "action": "reasoning_end"}`: the running reply with that id (the chunks' `id`,
    X-Request-Id) closes its thinking at its next token and answers, as a spent budget does. `applied` is false
    where the reply is not thinking (any more)."""
    body = ex.json_body()
    try:
        body = object_body(body)
        known_fields(body, {"id", "action"})
        request_id, action = str_field(body, "id"), str_field(body, "action")
        if action != "reasoning_end":
            raise RequestError(f"action: only reasoning_end is supported (got {action!r})", "action",
                               "invalid_value")
    except GoinferError as e:
        raise HTTPError(error_status(e), error_body(e)) from None
    job = ex.state.running.get(request_id or "")
    if job is None:
        raise not_found("running request", request_id)
    applied = any([gen.end_reasoning() for gen in job.prep.choices])
    # `success`: llama.cpp's answer (its web UI reads it); `applied`: ours, the same
    ex.send_json(200, {"success": applied, "id": request_id, "action": action, "applied": applied}
                 | ({} if applied else {"message": "the reply is not thinking (any more)"}))


def stored_response(ex, id: str) -> None:  # noqa: A002 - the route's parameter
    found = ex.state.response_store.get(id)
    if found is None:
        raise HTTPError(404, error_object(f"no stored response {ex.path.rsplit('/', 1)[-1]!r}",
                                          "invalid_request_error", None, "not_found"))
    ex.send_json(200, found[0])


ROUTES = (
    Route("POST", CHAT_URL, generate, dialect=lambda store: OpenAIDialect(CHAT_URL)),
    Route("POST", COMPLETIONS_URL, generate, dialect=lambda store: OpenAIDialect(COMPLETIONS_URL)),
    Route("POST", anthropic.MESSAGES_URL, generate, dialect=lambda store: AnthropicMessages()),
    Route("POST", anthropic.COUNT_TOKENS_URL, generate, dialect=lambda store: AnthropicCountTokens()),
    Route("POST", RESPONSES_URL, generate, dialect=ResponsesDialect),
    Route("GET", RESPONSES_URL + "/{id:.*}", stored_response),
    Route("POST", CONTROL_URL, control),
)
