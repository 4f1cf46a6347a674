"""The HTTP request handler: auth, routing, body limits, JSON answers and SSE streams.

Every answer, errors included, is JSON in OpenAI's error shape; the wire formats themselves (what a
body means, what a response holds) come from engine.api, so this file only moves bytes.
"""

from __future__ import annotations

import hmac
import json
import queue
import select
import socket
import ssl
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Iterator
from urllib.parse import urlsplit

from engine.api import anthropic, responses, sse
from engine.api.openai import (CHAT_URL, COMPLETIONS_URL, error_body, error_object, error_status, model_list,
                               model_object, new_id, parse_request, response_object)
from engine.errors import Cancelled, GoinferError
from engine.requests import Collector, Delta, prepare, prompt_ids
from engine.server.state import ServerState
from engine.server.workers import Finished, Job, QueueFull, ShuttingDown

TICK_S = 0.1  # how often a waiting handler looks at its client's socket
IDLE_TIMEOUT_S = 120  # a connection silent this long (between requests, or mid-body) is closed
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError, ssl.SSLError)


_STORE_LOCK = threading.Lock()


def _response_store(state) -> responses.ResponseStore:
    """The server's bounded store of Responses API answers (made on first use)."""
    with _STORE_LOCK:
        store = getattr(state, "response_store", None)
        if store is None:
            store = state.response_store = responses.ResponseStore()
        return store


class HTTPError(Exception):
    """An answer other than 200, decided before any response byte was sent."""

    def __init__(self, status: int, body: dict, headers: dict | None = None):
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers or {}


class ClientGone(Exception):
    pass


def _stream_error(e: GoinferError | HTTPError) -> tuple[int, dict]:
    """(status, OpenAI error body) of an error met after a stream began: too late to answer with it."""
    if isinstance(e, HTTPError):
        return e.status, e.body
    return error_status(e), error_body(e)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # persistent connections; every answer has a length or is chunked
    timeout = IDLE_TIMEOUT_S

    def version_string(self) -> str:
        return "goinfer"

    # ------------------------------------------------------------------ plumbing

    @property
    def state(self) -> ServerState:
        return self.server.state  # type: ignore[attr-defined]

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, in the connection's thread, not in the accept loop

    def handle(self) -> None:
        try:
            super().handle()
        except _GONE + (ConnectionError,):
            pass  # the client went away between requests or mid-answer; nothing to answer

    def finish(self) -> None:
        if self.close_connection and getattr(self, "_body_read", True) is False and self._has_body():
            self._drain()
        super().finish()

    def _drain(self, limit: int = 64 << 20, seconds: float = 2.0) -> None:
        """Refused before its body was read: read and drop what the client is still sending (for a
        moment) so that closing does not reset the connection before the client reads the answer."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.25)
            deadline, seen = time.monotonic() + seconds, 0
            while seen < limit and time.monotonic() < deadline:
                data = self.connection.recv(65536)
                if not data:
                    break
                seen += len(data)
        except (OSError, ValueError):
            pass

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        pass  # requests are logged by _access, with what matters here (model, tokens, time)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own refusals (bad request line, headers too long, unknown method): JSON too
        self.close_connection = True
        phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "error"
        self._send_json(code, error_object(message or phrase, "invalid_request_error", None, None))

    def handle_expect_100(self) -> bool:
        # Refuse an over-limit or unauthenticated body before the client sends it.
        try:
            self._check_auth()
            self._check_declared_length()
        except HTTPError as e:
            self._body_read = False
            self.close_connection = True
            self._send_error(e)
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        with self.state.tracking():
            self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        # One handler serves every request of a connection: reset what a request leaves behind.
        self._t0 = self._last_write = time.monotonic()
        self._body_read = False
        self._headers_sent = False
        self._status: int | str = "-"
        self._note = ""
        self._model_name: str | None = None
        self._usage: tuple[int, int] | None = None
        path = urlsplit(self.path).path
        # Errors on Anthropic's routes take Anthropic's shape (_send_error translates them).
        self._anthropic = path in anthropic.URLS
        self._rr = None  # a Responses API request, once parsed
        try:
            self._check_auth()
            if path == "/health":
                self._only("GET")
                self._send_json(200 if not self.state.closing else 503, self.state.health())
            elif path == "/v1/models":
                self._only("GET")
                self._send_json(200, model_list([self._model_entry(m) for m in self.state.models.values()]))
            elif path.startswith("/v1/models/"):
                self._only("GET")
                served = self.state.models.get(path[len("/v1/models/"):])
                if served is None:
                    raise self._unknown_model(path[len("/v1/models/"):])
                self._send_json(200, self._model_entry(served))
            elif path in (CHAT_URL, COMPLETIONS_URL, responses.RESPONSES_URL) or path in anthropic.URLS:
                self._only("POST")
                self._generate(path)
            elif path.startswith(responses.RESPONSES_URL + "/"):
                self._only("GET")
                found = _response_store(self.state).get(path[len(responses.RESPONSES_URL) + 1:])
                if found is None:
                    raise HTTPError(404, error_object(f"no stored response {path.rsplit('/', 1)[-1]!r}",
                                                      "invalid_request_error", None, "not_found"))
                self._send_json(200, found[0])
            else:
                raise HTTPError(404, error_object(
                    f"no route {self.command} {path} (routes: GET /health, GET /v1/models, "
                    f"POST {CHAT_URL}, POST {COMPLETIONS_URL}, POST {anthropic.MESSAGES_URL}, "
                    f"POST {anthropic.COUNT_TOKENS_URL}, POST {responses.RESPONSES_URL}, GET {responses.RESPONSES_URL}/ID)",
                    "invalid_request_error", None, "not_found"))
        except HTTPError as e:
            self._send_error(e)
        except ClientGone:
            self.close_connection = True
            self._status = "gone"
        except Exception:  # a bug: a JSON 500 to the client, the traceback to the log
            self.state.log(f"internal error on {self.command} {path}:\n{traceback.format_exc().rstrip()}")
            if not self._headers_sent:
                self._send_json(500, error_object("internal server error (see the server log)", "server_error",
                                                  None, "internal_error"))
            self.close_connection = True
        self._access(path)

    def _only(self, method: str) -> None:
        if self.command != method:
            raise HTTPError(405, error_object(f"{self.command} is not allowed here; use {method}",
                                              "invalid_request_error", None, "method_not_allowed"),
                            {"Allow": method})

    def _model_entry(self, served) -> dict:
        return model_object(served.name, created=served.created, context_window=served.window)

    def _unknown_model(self, name: str) -> HTTPError:
        served = ", ".join(self.state.models)
        return HTTPError(404, error_object(f"model {name!r} does not exist here (served: {served})",
                                           "invalid_request_error", "model", "model_not_found"))

    # ------------------------------------------------------------------ auth and bodies

    def _check_auth(self) -> None:
        key = self.state.api_key
        if key is None:
            return
        given = []
        auth = self.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            given.append(auth[7:].strip())
        if self.headers.get("x-api-key") is not None:
            given.append(self.headers["x-api-key"].strip())
        want = key.encode()
        # compare_digest: the time taken does not depend on how much of the key a guess got right
        if not any([hmac.compare_digest(g.encode("utf-8", "replace"), want) for g in given]):
            what = "invalid API key" if given else "missing API key"
            raise HTTPError(401, error_object(f"{what}: send Authorization: Bearer KEY or x-api-key: KEY",
                                              "invalid_request_error", None, "invalid_api_key"),
                            {"WWW-Authenticate": 'Bearer realm="goinfer"'})

    def _has_body(self) -> bool:
        return "chunked" in self.headers.get("Transfer-Encoding", "").lower() or \
            self.headers.get("Content-Length", "0").strip() not in ("", "0")

    def _too_large(self, size: str) -> HTTPError:
        cap = self.state.body_cap
        return HTTPError(413, error_object(f"the request body ({size}) is over the limit of {cap} bytes "
                                           "(--max-body-bytes)", "invalid_request_error", None,
                                           "request_too_large"))

    def _check_declared_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        if value is None:
            return None
        try:
            n = int(value)
            if n < 0:
                raise ValueError
        except ValueError:
            raise HTTPError(400, error_object(f"invalid Content-Length {value!r}", "invalid_request_error", None,
                                              "invalid_request")) from None
        if n > self.state.body_cap:
            raise self._too_large(f"{n} bytes")  # decided before a byte of it is read
        return n

    def _read_body(self) -> bytes:
        te = self.headers.get("Transfer-Encoding", "").lower()
        if te and te != "identity":
            if te.split(",")[-1].strip() != "chunked":
                raise HTTPError(501, error_object(f"Transfer-Encoding {te!r} is not supported (chunked is)",
                                                  "invalid_request_error", None, "invalid_request"))
            return self._read_chunked()
        n = self._check_declared_length()
        data = self.rfile.read(n) if n else b""
        if n and len(data) < n:
            raise ClientGone()
        self._body_read = True
        return data

    def _read_chunked(self) -> bytes:
        """A chunked body, counted as it arrives and refused (413) as soon as it passes the limit."""
        parts, total = [], 0
        while True:
            line = self.rfile.readline(1024)
            if not line:
                raise ClientGone()
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HTTPError(400, error_object("malformed chunked request body", "invalid_request_error", None,
                                                  "invalid_request")) from None
            if size == 0:
                while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailer fields, ignored
                break
            total += size
            if total > self.state.body_cap:
                raise self._too_large(f"over {self.state.body_cap} bytes, chunked")
            data = self.rfile.read(size)
            if len(data) < size:
                raise ClientGone()
            parts.append(data)
            self.rfile.readline(3)  # the CRLF after the chunk
        self._body_read = True
        return b"".join(parts)

    # ------------------------------------------------------------------ generation

    def _generate(self, path: str) -> None:
        raw = self._read_body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to parse
            raise HTTPError(400, error_object(f"the request body is not valid JSON: {e}", "invalid_request_error",
                                              None, "invalid_json")) from None
        cancel = threading.Event()
        try:
            if path == anthropic.MESSAGES_URL:
                req = anthropic.parse_messages_request(body)
            elif path == anthropic.COUNT_TOKENS_URL:
                req = anthropic.parse_count_tokens(body)
            elif path == responses.RESPONSES_URL:
                self._rr = responses.parse_responses_request(body, _response_store(self.state).get)
                req = self._rr.request
            else:
                req = parse_request(path, body)
            served = self.state.route(req.model)
            if served is None:
                raise self._unknown_model(req.model)
            self._model_name = served.name
            if path == anthropic.COUNT_TOKENS_URL:
                self._send_json(200, {"input_tokens": len(prompt_ids(served.model, req))})
                return
            prep = prepare(served.model, req, window=served.window, should_stop=cancel.is_set)
        except GoinferError as e:
            raise HTTPError(error_status(e), error_body(e)) from None
        job_id = anthropic.new_id() if self._anthropic else responses.new_id() if self._rr else new_id(req.kind)
        job = Job(prep, cancel, job_id)
        worker = self.state.workers[served.name]
        try:
            worker.submit(job)
        except QueueFull as e:
            raise HTTPError(429, error_object(
                f"{served.name} is busy: {e.waiting} requests are waiting (--max-queue {worker.max_queue}); "
                f"retry after {e.retry_after} s", "rate_limit_error", None, "queue_full"),
                {"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown:
            raise self._shutting_down() from None
        try:
            if req.stream:
                self._stream(job, req, served.name)
            else:
                self._answer(job, req, served.name)
        except ClientGone:
            worker.withdraw(job, "client disconnected")
            self._note = f"client disconnected after {job.generated} tokens; generation stopped"
            raise
        finally:
            if not job.done:
                worker.withdraw(job, "request ended")

    def _shutting_down(self) -> HTTPError:
        return HTTPError(503, error_object("the server is shutting down", "server_error", None, "shutting_down"))

    def _events(self, job: Job, *, stream: bool) -> Iterator[Delta]:
        """The job's pieces as the worker makes them. Meanwhile: watch the client's socket (a client that
        left cancels the job) and, on a stream, send a keep-alive comment after keepalive_s of silence."""
        last_check = 0.0
        while True:
            try:
                item = job.events.get(timeout=TICK_S)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if now - last_check >= TICK_S:
                last_check = now
                if self._client_gone():
                    raise ClientGone()
                if stream and now - self._last_write >= self.state.keepalive_s:
                    self._write_chunk(sse.comment())
            if item is None:
                continue
            if isinstance(item, Finished):
                if item.error is None:
                    return
                if isinstance(item.error, Cancelled) and self.state.closing:
                    raise self._shutting_down()
                if not isinstance(item.error, GoinferError):  # a bug; the worker logged its traceback
                    raise HTTPError(500, error_object("internal server error (see the server log)", "server_error",
                                                      None, "internal_error"))
                raise item.error
            yield item

    def _answer(self, job: Job, req, model_name: str) -> None:
        out = Collector(job.prep)
        try:
            for d in self._events(job, stream=False):
                out.add(d)
        except GoinferError as e:
            raise HTTPError(error_status(e), error_body(e)) from None
        self._usage = (len(job.prep.ids), out.generated)
        if self._anthropic:
            obj = anthropic.message_object(out.result(), model_name=model_name, message_id=job.id)
        elif self._rr is not None:
            result = out.result()
            obj = responses.response_object(self._rr, result, response_id=job.id, model_name=model_name,
                                            created=job.created)
            if self._rr.store:
                _response_store(self.state).put(obj, responses.conversation(self._rr, result))
        else:
            obj = response_object(req, out.result(), model_name=model_name, request_id=job.id, created=job.created)
        self._send_json(200, obj, {"X-Request-Id": job.id})

    def _stream(self, job: Job, req, model_name: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        # HTTP/1.1: chunked, so the connection can serve the next request; HTTP/1.0: ended by closing it
        self._chunked = self.request_version != "HTTP/1.0"
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.send_header("X-Accel-Buffering", "no")  # proxies: pass each event on at once
        self.send_header("X-Request-Id", job.id)
        self._end_headers()
        self._status = 200
        if self._anthropic:
            self._stream_anthropic(job, req, model_name)
            return
        if self._rr is not None:
            self._stream_responses(job, req, model_name)
            return
        info = sse.Stream(req.kind, job.id, job.created, model_name, req.logprobs, req.include_usage,
                          frozenset(req.tool_names) if req.calls_tools else None)
        out = Collector(job.prep)
        started: set[int] = set()
        try:
            for d in self._events(job, stream=True):
                out.add(d)
                for chunk in info.chunks(d, first=d.index not in started):
                    self._write_chunk(sse.event(chunk))
                started.add(d.index)
        except (GoinferError, HTTPError) as e:
            # Too late for a status: the error goes in the stream, as OpenAI sends it, and the stream ends.
            _, body = _stream_error(e)
            self._note = f"error in stream: {body['error']['message']}"
            self._write_chunk(sse.event(body))
            self._write_chunk(b"")
            return
        self._usage = (len(job.prep.ids), out.generated)
        last = info.usage_chunk(len(job.prep.ids), out.generated)
        if last is not None:
            self._write_chunk(sse.event(last))
        self._write_chunk(sse.DONE)
        self._write_chunk(b"")  # the zero-length chunk: end of the response

    def _stream_anthropic(self, job: Job, req, model_name: str) -> None:
        """Anthropic's named events (headers already sent); an error after the start is an `error` event."""
        info = anthropic.MessageStream(job.id, model_name, len(job.prep.ids),
                                       frozenset(req.tool_names) if req.calls_tools else None)
        self._stream_named(job, info, lambda status, body: anthropic.MessageStream.error(
            anthropic.error_status(status), body["error"]["message"]))
        self._write_chunk(b"")

    def _stream_responses(self, job: Job, req, model_name: str) -> None:
        """The Responses API's named events (headers already sent)."""
        rr = self._rr
        info = responses.ResponseStream(rr, job.id, model_name, job.created,
                                        frozenset(req.tool_names) if req.calls_tools else None)
        out = self._stream_named(job, info,
                                 lambda status, body: responses.sse("error", {"type": "error", **body["error"]}))
        if out is not None:
            result = info.sent(out.result())
            obj = responses.response_object(rr, result, response_id=job.id, model_name=model_name,
                                            created=job.created, message_id=info._msg_id)
            if rr.store:
                _response_store(self.state).put(obj, responses.conversation(rr, result))
            self._write_chunk(info.end(obj))
        self._write_chunk(b"")

    def _stream_named(self, job: Job, info, error_event) -> Collector | None:
        """The loop both named-event streams share: info's start, its events for each piece of choice 0, and
        on an error `error_event(status, OpenAI error body)` (None returned: the stream is over)."""
        self._write_chunk(info.start())
        out = Collector(job.prep)
        try:
            for d in self._events(job, stream=True):
                out.add(d)
                if d.index == 0:
                    data = info.events(d)
                    if data:
                        self._write_chunk(data)
        except (GoinferError, HTTPError) as e:
            status, body = _stream_error(e)
            self._note = f"error in stream: {body['error']['message']}"
            self._write_chunk(error_event(status, body))
            return None
        self._usage = (len(job.prep.ids), out.generated)
        return out

    # ------------------------------------------------------------------ writing

    def _end_headers(self) -> None:
        self.end_headers()
        self._headers_sent = True
        self._last_write = time.monotonic()

    def _write_chunk(self, data: bytes) -> None:
        """One piece of a streamed body; b"" ends it."""
        if not self._chunked and not data:
            return
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
            self.wfile.flush()
        except _GONE + (OSError,):
            raise ClientGone() from None
        self._last_write = time.monotonic()

    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        if getattr(self, "_body_read", True) is False and self._has_body():
            self.close_connection = True  # the body was never read: the connection cannot be reused
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self._end_headers()
        self._status = status
        if self.command != "HEAD":
            try:
                self.wfile.write(data)
            except _GONE + (OSError,):
                raise ClientGone() from None

    def _send_error(self, e: HTTPError) -> None:
        if getattr(self, "_anthropic", False):
            status = anthropic.error_status(e.status)
            self._send_json(status, anthropic.error_body(status, e.body["error"]["message"]), e.headers)
            return
        self._send_json(e.status, e.body, e.headers)

    def _client_gone(self) -> bool:
        """True when the client closed its end: the socket reads as end-of-file. Data waiting to be read
        (a pipelined request) is not a disconnect. On TLS the raw TCP stream is peeked, not decrypted."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return socket.socket.recv(sock, 1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True

    def _access(self, path: str) -> None:
        took = time.monotonic() - self._t0
        parts = [f'{self.client_address[0]} "{self.command} {path}" {self._status}']
        if self._model_name:
            parts.append(self._model_name)
        if self._usage:
            parts.append(f"{self._usage[0]}+{self._usage[1]} tokens")
        parts.append(f"{took:.2f}s")
        if self._note:
            parts.append(self._note)
        self.state.log(" ".join(parts))
