"""The HTTP request handler: a connection's requests, each checked (host, key), routed through the one route table
and answered by the function the table names, and logged.

The table joins the ROUTES each answering module lists (routes.py says how a route is written); a route's function
reads and answers its request through an Exchange (exchange.py), so this file holds connection plumbing only.
Errors are JSON in the route's shape (OpenAI's where no dialect serves the route).
"""

from __future__ import annotations

import socket
import ssl
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

from engine.api.openai_objects import error_object
from engine.server import (admin, batches, deciding, embedding, files, generating, intake, llamacpp, message_batches,
                           metrics, ollama, page, status, tokens)
from engine.server.exchange import GONE, Exchange
from engine.server.intake import ClientGone, HTTPError
from engine.server.routes import RouteTable
from engine.server.state import ServerState

IDLE_TIMEOUT_S = 120  # a connection silent this long (between requests, or mid-body) is closed

# Every route the server answers: the order is the 404 list's (no two routes of one method share a path).
TABLE = RouteTable(*page.ROUTES, *status.ROUTES, *metrics.ROUTES, *generating.ROUTES, *embedding.ROUTES,
                   *deciding.ROUTES, *tokens.ROUTES, *files.ROUTES, *batches.ROUTES, *message_batches.ROUTES,
                   *admin.ROUTES, *ollama.ROUTES, *llamacpp.ROUTES)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # persistent connections; every answer has a length or is chunked
    timeout = IDLE_TIMEOUT_S
    exchange: Exchange | None = None  # the request being answered (or the last one)
    _cors: dict[str, str] = {}  # the headers end_headers adds for this request's origin (cors.py)

    def version_string(self) -> str:
        return "goinfer"

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

    def handle(self) -> None:
        try:
            super().handle()
        except GONE + (ConnectionError,):
            pass  # the client went away between requests or mid-answer; nothing to answer

    def finish(self) -> None:
        ex = self.exchange
        if self.close_connection and ex is not None and not ex.body_read and intake.has_body(self.headers):
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
        pass  # requests are logged by _dispatch, with what matters here (model, tokens, time)

    def end_headers(self) -> None:
        for k, v in self._cors.items():  # an allowed origin's page may read every answer
            self.send_header(k, v)
        super().end_headers()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own refusals (bad request line, headers too long, unknown method): JSON too
        self.close_connection = True
        phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "error"
        Exchange(self, self.state, None).send_json(code, error_object(message or phrase, "invalid_request_error",
                                                                      None, None))

    def handle_expect_100(self) -> bool:
        # Refuse an over-limit or unauthenticated body before the client sends it.
        ex = Exchange(self, self.state, TABLE)
        try:
            intake.check_host(self.headers, self.state.allowed_hosts)
            intake.check_auth(self.headers, self.state.api_keys)
            intake.declared_length(self.headers, ex.body_cap())
        except HTTPError as e:
            self.exchange = ex  # its body unread: finish() drains it
            self.close_connection = True
            ex.send_error(e)
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        with self.state.tracking():
            self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    def _dispatch(self) -> None:
        ex = self.exchange = Exchange(self, self.state, TABLE)  # one per request: nothing of the last one stays
        self._cors = self.state.cors.headers(self.headers.get("Origin"))
        if not intake.has_body(self.headers):
            ex.request_read()  # the headers were the whole request
        try:
            intake.check_host(self.headers, self.state.allowed_hosts)
            found = ex.match
            if self.command == "OPTIONS" and "Access-Control-Request-Method" in self.headers:
                self._preflight(ex)  # a browser's, before its request: it never carries the key
            else:
                if found.route is None or not found.route.public:  # public: the chat page (page.py)
                    intake.check_auth(self.headers, self.state.api_keys)
                if found.route is None:
                    raise TABLE.refusal(self.command, ex.path, found, self.state)
                found.route.answer(ex, **found.params)
        except HTTPError as e:
            ex.send_error(e)
        except ClientGone:
            self.close_connection = True
            ex.status = "gone"
        except Exception:  # a bug: a JSON 500 to the client, the traceback to the log
            self.state.log(f"internal error on {self.command} {ex.path}:\n{traceback.format_exc().rstrip()}")
            if not ex.headers_sent:
                ex.send_json(500, error_object("internal server error (see the server log)", "server_error",
                                               None, "internal_error"))
            self.close_connection = True
        self.state.log(ex.access_line())
        self._cors = {}  # not the next request's (http.server answers a malformed one before _dispatch)
        self._expect_request()  # the connection's next request, if it sends one

    def _preflight(self, ex: Exchange) -> None:
        origin = self.headers.get("Origin")
        if not self.state.cors.allowed(origin):
            raise HTTPError(403, error_object(f"origin {origin!r} may not read this server's answers (allow it with "
                                              "--cors-origin)", "invalid_request_error", None, "origin_not_allowed"))
        self._cors = {}
        self.send_response(204)
        for k, v in self.state.cors.preflight(origin, self.headers.get("Access-Control-Request-Headers")).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        ex.end_headers()
        ex.status = 204
