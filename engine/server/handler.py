"""The HTTP request handler: routing, JSON answers and SSE streams (auth and bodies: intake.py).

A generation route is served by its wire format's Dialect (engine/api/dialects.py: what a body means, what the
answer and its stream hold, the shape of its errors), so this file only moves bytes and holds no per-format
branch. Errors are JSON in the route's shape (OpenAI's where no dialect serves the route).
"""

from __future__ import annotations

import json
import queue
import socket
import ssl
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Iterator
from urllib.parse import urlsplit

from engine.api import sse
from engine.api.dialects import ROUTES, Dialect, OpenAIDialect, dialect_for
from engine.api.decisions import DECISIONS_URL
from engine.api.embeddings import EMBEDDINGS_URL, embeddings_object, parse_embeddings_request, token_lists
from engine.api.openai_objects import error_body, error_object, error_status, model_list
from engine.api.responses import RESPONSES_URL
from engine.api.tokens import TOKEN_ROUTES
from engine.errors import Cancelled, GoinferError
from engine.requests.prompts import prompt_ids
from engine.requests.request import Collector, Delta, prepare
from engine.server import intake
from engine.server.admin import ADMIN_URL
from engine.server.batches import BATCHES_URL
from engine.server.message_batches import MESSAGE_BATCHES_URL
from engine.server.files import FILES_URL, UPLOAD_CAP
from engine.server.intake import ClientGone, HTTPError
from engine.server.metrics import CONTENT_TYPE as METRICS_TYPE, prometheus_text
from engine.server.resources import CONTROL_URL, WEB_FILES, ResourceRoutes
from engine.server.writing import GONE, AnswerWriter
from engine.server.state import ServerState
from engine.running.scheduler import Finished, Job, QueueFull, ShuttingDown

TICK_S = 0.1  # how often a waiting handler looks at its client's socket
IDLE_TIMEOUT_S = 120  # a connection silent this long (between requests, or mid-body) is closed

_DEFAULT_DIALECT = OpenAIDialect("")  # the error shape of every route no dialect serves


def _stream_error(e: GoinferError | HTTPError) -> tuple[int, dict]:
    """(status, OpenAI error body) of an error met after a stream began: too late to answer with it."""
    if isinstance(e, HTTPError):
        return e.status, e.body
    return error_status(e), error_body(e)


class Handler(ResourceRoutes, AnswerWriter, BaseHTTPRequestHandler):
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
        self._expect_request()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, in the connection's thread, not in the accept loop

    def _expect_request(self) -> None:
        """The next request's headers and body must arrive within --read-deadline (guard.py)."""
        if self.state.guard is not None:
            self.state.guard.expect_request(self.connection)

    def _request_read(self) -> None:
        if self.state.guard is not None:
            self.state.guard.request_read(self.connection)

    def handle(self) -> None:
        try:
            super().handle()
        except GONE + (ConnectionError,):
            pass  # the client went away between requests or mid-answer; nothing to answer

    def finish(self) -> None:
        if self.close_connection and getattr(self, "_body_read", True) is False and intake.has_body(self.headers):
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
            intake.check_host(self.headers, self.state.allowed_hosts)
            intake.check_auth(self.headers, self.state.api_keys)
            intake.declared_length(self.headers, self._body_cap())
        except HTTPError as e:
            self._body_read = False
            self.close_connection = True
            self._dialect = self._route_dialect()
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
        self._dialect = self._route_dialect()
        self._cors = self.state.cors.headers(self.headers.get("Origin"))  # end_headers adds them (cors.py)
        if not intake.has_body(self.headers):
            self._request_read()  # the headers were the whole request
        try:
            intake.check_host(self.headers, self.state.allowed_hosts)
            if self.command == "OPTIONS" and "Access-Control-Request-Method" in self.headers:
                self._preflight()  # a browser's, before its request: it never carries the key
            elif self.state.web and path in WEB_FILES and self.command in ("GET", "HEAD"):
                self._web(path)  # the chat page: static, no key (resources.py)
            else:
                intake.check_auth(self.headers, self.state.api_keys)
                self._route(path)
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
        self._cors = {}  # not the next request's (http.server answers a malformed one before _dispatch)
        self._expect_request()  # the connection's next request, if it sends one

    def _preflight(self) -> None:
        origin = self.headers.get("Origin")
        if not self.state.cors.allowed(origin):
            raise HTTPError(403, error_object(f"origin {origin!r} may not read this server's answers (allow it with "
                                              "--cors-origin)", "invalid_request_error", None, "origin_not_allowed"))
        self._cors = {}
        self.send_response(204)
        for k, v in self.state.cors.preflight(origin, self.headers.get("Access-Control-Request-Headers")).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self._end_headers()
        self._status = 204

    def _route(self, path: str) -> None:
        if path == "/health":
            self._only("GET")
            health = self.state.health()  # 503 while loading (loading.py) or closing: not ready for requests
            self._send_json(200 if health["status"] == "ok" else 503, health)
        elif path == "/v1/models":
            self._only("GET")
            self._send_json(200, {**model_list(list(self.state.model_entries().values())),
                                  "models": self.state.typesafe_models()})
        elif path.startswith("/v1/models/"):
            self._only("GET")
            entry = self.state.model_entries().get(path[len("/v1/models/"):])
            if entry is None:
                raise self._unknown_model(path[len("/v1/models/"):])
            self._send_json(200, entry)
        elif path in ROUTES:
            self._only("POST")
            self._generate()
        elif path == EMBEDDINGS_URL:
            self._only("POST")
            self._embed()
        elif path == DECISIONS_URL:
            self._only("POST")
            self._model_name, answer, tokens = self.state.decisions.answer(self._json_body())
            self._usage = (tokens, 0)
            self._send_json(200, answer)
        elif path == FILES_URL or path.startswith(FILES_URL + "/"):
            self._files(path[len(FILES_URL) + 1:])
        elif self.state.admin is not None and (path == ADMIN_URL or path.startswith(ADMIN_URL + "/")):
            self._admin(path[len(ADMIN_URL) + 1:])
        elif path == MESSAGE_BATCHES_URL or path.startswith(MESSAGE_BATCHES_URL + "/"):
            self._message_batches(path[len(MESSAGE_BATCHES_URL) + 1:])
        elif path == BATCHES_URL or path.startswith(BATCHES_URL + "/"):
            self._batches(path[len(BATCHES_URL) + 1:])
        elif path == "/metrics":
            self._only("GET")
            self._send_body(200, prometheus_text(self.state.health()).encode(), METRICS_TYPE)
        elif path == CONTROL_URL:
            self._only("POST")
            self._control()
        elif path in TOKEN_ROUTES:
            self._only("POST")
            self._tokens(path)
        elif path.startswith(RESPONSES_URL + "/"):
            self._only("GET")
            found = self.state.response_store.get(path[len(RESPONSES_URL) + 1:])
            if found is None:
                raise HTTPError(404, error_object(f"no stored response {path.rsplit('/', 1)[-1]!r}",
                                                  "invalid_request_error", None, "not_found"))
            self._send_json(200, found[0])
        else:
            routes = ", ".join(["GET /health", "GET /metrics", "GET /v1/models"] + [f"POST {r}" for r in ROUTES]
                               + [f"POST {EMBEDDINGS_URL}", f"POST {DECISIONS_URL}", f"GET {RESPONSES_URL}/ID",
                                  f"{FILES_URL}[/ID[/content]]", f"{BATCHES_URL}[/ID[/cancel]]",
                                  f"{MESSAGE_BATCHES_URL}[/ID[/cancel|/results]]"]
                               + [f"POST {r}" for r in TOKEN_ROUTES])
            raise HTTPError(404, error_object(f"no route {self.command} {path} (routes: {routes})",
                                              "invalid_request_error", None, "not_found"))

    def _admissible(self, scheduler, name: str, attempt) -> None:
        """attempt() (a queue check, or the submission), its refusals as the answers they get."""
        try:
            attempt()
        except QueueFull as e:
            raise HTTPError(429, error_object(
                f"{name} is busy: {e.waiting} requests are waiting (--max-queue {scheduler.max_queue}); "
                f"retry after {e.retry_after} s", "rate_limit_error", None, "queue_full"),
                {"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown:
            raise self._shutting_down() from None

    def _route_dialect(self) -> Dialect:
        """The wire format of this request's route (a new one per request), if it has one: its errors take that
        format's shape (_send_error)."""
        return dialect_for(urlsplit(self.path).path, self.state.response_store) or _DEFAULT_DIALECT

    def _only(self, *methods: str) -> None:
        if self.command not in methods:
            raise HTTPError(405, error_object(f"{self.command} is not allowed here; use {' or '.join(methods)}",
                                              "invalid_request_error", None, "method_not_allowed"),
                            {"Allow": ", ".join(methods)})

    def _unknown_model(self, name: str) -> HTTPError:
        served = ", ".join(self.state.models)
        return HTTPError(404, error_object(f"model {name!r} does not exist here (served: {served})",
                                           "invalid_request_error", "model", "model_not_found"))

    # ------------------------------------------------------------------ auth and bodies

    def _read_body(self) -> bytes:
        data = intake.read_body(self.headers, self.rfile, self._body_cap())
        self._body_read = True
        self._request_read()
        if urlsplit(self.path).path != FILES_URL:  # (an upload needs no model) read, then held while loading
            self.state.wait_loaded()
        return intake.decoded_body(self.headers, data, self._body_cap())

    def _body_cap(self) -> int:
        """This route's body limit: /v1/embeddings (config.embeddings_body_cap) and uploads have their own."""
        path = urlsplit(self.path).path
        if path == EMBEDDINGS_URL:
            return self.state.embeddings_body_cap
        if path == FILES_URL:
            return max(self.state.body_cap, UPLOAD_CAP)
        return self.state.body_cap

    # ------------------------------------------------------------------ generation

    def _json_body(self):
        raw = self._read_body()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to parse
            raise HTTPError(400, error_object(f"the request body is not valid JSON: {e}", "invalid_request_error",
                                              None, "invalid_json")) from None

    def _embed(self) -> None:
        """POST /v1/embeddings: the inputs' vectors, from the model's queue (concurrent requests share passes;
        they take turns with the generation models' computations)."""
        body = self._json_body()
        try:
            req = parse_embeddings_request(body)
            model = self.state.embedder(req.model)
            if model is None:
                served = ", ".join(self.state.embedders) or "none"
                raise HTTPError(404, error_object(f"model {req.model!r} is not an embedding model served here "
                                                  f"(embedding models: {served})", "invalid_request_error", "model",
                                                  "model_not_found"))
            self._model_name = model.name
            lists = token_lists(model, req)
            vectors = self.state.embed_queues[model.name].embed(lists)
        except GoinferError as e:
            raise HTTPError(error_status(e), error_body(e)) from None
        tokens = sum(len(ids) for ids in lists)
        self._usage = (tokens, 0)
        self._send_json(200, embeddings_object(model, req, vectors, tokens))

    def _generate(self) -> None:
        body = self._json_body()
        dialect = self._dialect
        cancel = threading.Event()
        try:
            req = dialect.parse(body)
            served = self.state.route(req.model)
            if served is None:
                raise self._unknown_model(req.model)
            self._model_name = served.name
            if dialect.counts_tokens:
                self._send_json(200, dialect.count(len(prompt_ids(served.model, req, self.state.thinking))))
                return
            scheduler = self.state.schedulers[served.name]
            self._admissible(scheduler, served.name, scheduler.check_room)  # before tokenising and grammar work
            prep = prepare(served.model, req, window=served.window, thinking=self.state.thinking)
        except GoinferError as e:
            raise HTTPError(error_status(e), error_body(e)) from None
        job = Job(prep, cancel, dialect.new_id(req))
        self._admissible(scheduler, served.name, lambda: scheduler.submit(job))
        self.state.running[job.id] = job  # for POST /v1/chat/completions/control
        try:
            if req.stream:
                self._stream(job, req, served.name)
            else:
                self._answer(job, req, served.name)
        except ClientGone:
            scheduler.withdraw(job, "client disconnected")
            self._note = f"client disconnected after {job.generated} tokens; generation stopped"
            raise
        finally:
            self.state.running.pop(job.id, None)
            if not job.done:
                scheduler.withdraw(job, "request ended")

    def _shutting_down(self) -> HTTPError:
        return HTTPError(503, error_object("the server is shutting down", "server_error", None, "shutting_down"))

    def _events(self, job: Job, *, stream: bool) -> Iterator[Delta]:
        """The job's pieces as the scheduler makes them. Meanwhile: watch the client's socket (a client that
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
                if not isinstance(item.error, GoinferError):  # a bug; the scheduler logged its traceback
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
        obj = self._dialect.answer(req, out.result(), job_id=job.id, model_name=model_name, created=job.created)
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
        enc = self._dialect.stream(req, job_id=job.id, model_name=model_name, created=job.created,
                                   prompt_tokens=len(job.prep.ids), cached_tokens=lambda: job.prep.cached_tokens)
        self._send_events(enc.start())
        out = Collector(job.prep)
        try:
            for d in self._events(job, stream=True):
                out.add(d)
                self._send_events(enc.piece(d))
        except (GoinferError, HTTPError) as e:
            # Too late for a status: the error goes in the stream, as each format sends it, and the stream ends.
            status, body = _stream_error(e)
            self._note = f"error in stream: {body['error']['message']}"
            self._send_events(enc.error(status, body))
            self._write_chunk(b"")
            return
        self._usage = (len(job.prep.ids), out.generated)
        self._send_events(enc.finish(out))
        self._write_chunk(b"")  # the zero-length chunk: end of the response
