"""One request as a route's function sees it (Exchange): what it asked (method, path, headers, its body, read
within the route's limits), how its answer is written (JSON and other bodies, a stream's chunks, errors in the
route's shape), whether the client is still there, and what the access-log line reports.

It writes through the http.server handler that received the request (handler.py), whose end_headers adds the CORS
headers an allowed origin gets.
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import time
from urllib.parse import urlsplit

from engine.api.dialects import Dialect, OpenAIDialect
from engine.api.openai_objects import error_object
from engine.server import intake
from engine.server.intake import ClientGone, HTTPError
from engine.server.routes import RouteTable

__all__ = ["GONE", "Exchange"]

GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError, ssl.SSLError)

_DEFAULT_DIALECT = OpenAIDialect("")  # the error shape of every route no dialect serves


class Exchange:
    def __init__(self, handler, state, table: RouteTable | None):
        """table None: an answer http.server itself refuses with, before any request was read (Handler.send_error)."""
        self.handler, self.state = handler, state
        self.command = handler.command if table is not None else None
        self.path = urlsplit(handler.path).path if table is not None else ""
        self.headers = handler.headers if table is not None else None
        self.match = table.match(self.command, self.path, state) if table is not None else None
        rules = self.match.rules if self.match is not None else None
        self.route = rules  # whose body limit and error shape apply
        # the route's wire format (a new one per request), if it has one: its errors take that format's shape
        self.dialect: Dialect = rules.dialect(state.response_store) if rules and rules.dialect else _DEFAULT_DIALECT
        self.t0 = self.last_write = time.monotonic()
        self.body_read = table is None  # False: a body the client sent is unread, and the connection not reusable
        self.headers_sent = False
        self.chunked = False
        self.status: int | str = "-"
        self.note = ""  # said in the access log
        self.model_name: str | None = None
        self.usage: tuple[int, int] | None = None  # (prompt, generated) tokens

    # ------------------------------------------------------------------ the request

    def body_cap(self) -> int:
        """This route's body limit: /v1/embeddings and uploads have their own (Route.body_cap)."""
        if self.route is not None and self.route.body_cap is not None:
            return self.route.body_cap(self.state)
        return self.state.body_cap

    def request_read(self) -> None:
        """The request is in: its --read-deadline (guard.py) is met."""
        if self.state.guard is not None:
            self.state.guard.request_read(self.handler.connection)

    def read_body(self) -> bytes:
        data = intake.read_body(self.headers, self.handler.rfile, self.body_cap())
        self.body_read = True
        self.request_read()
        if self.route is None or self.route.waits_for_models:  # (an upload needs no model) read, then held
            self.state.wait_loaded()
        return intake.decoded_body(self.headers, data, self.body_cap())

    def json_body(self):
        raw = self.read_body()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to parse
            raise HTTPError(400, error_object(f"the request body is not valid JSON: {e}", "invalid_request_error",
                                              None, "invalid_json")) from None

    def root_url(self) -> str:
        """This server's base URL as the client reached it (Anthropic's results_url points back here)."""
        scheme = "https" if isinstance(self.handler.connection, ssl.SSLSocket) else "http"
        return f"{scheme}://{self.headers.get('Host') or self.handler.server.server_address[0]}"

    # ------------------------------------------------------------------ the answer

    def end_headers(self) -> None:
        self.handler.end_headers()
        self.headers_sent = True
        self.last_write = time.monotonic()

    def send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self.send_body(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    def send_body(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        h = self.handler
        if not self.body_read and intake.has_body(self.headers):
            h.close_connection = True  # the body was never read: the connection cannot be reused
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        if h.close_connection:
            h.send_header("Connection", "close")
        self.end_headers()
        self.status = status
        if h.command != "HEAD":
            try:
                h.wfile.write(data)
            except GONE + (OSError,):
                raise ClientGone() from None

    def send_error(self, e: HTTPError) -> None:
        status, body = self.dialect.error(e.status, e.body)
        self.send_json(status, body, e.headers)

    def start_events(self, headers: dict[str, str], media_type: str = "text/event-stream; charset=utf-8") -> None:
        """A 200 whose body is streamed events (server-sent events, or another format's: Ollama's NDJSON),
        written as they come (write_chunk)."""
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", media_type)
        h.send_header("Cache-Control", "no-cache")
        # HTTP/1.1: chunked, so the connection can serve the next request; HTTP/1.0: ended by closing it
        self.chunked = h.request_version != "HTTP/1.0"
        if self.chunked:
            h.send_header("Transfer-Encoding", "chunked")
        else:
            h.close_connection = True
            h.send_header("Connection", "close")
        h.send_header("X-Accel-Buffering", "no")  # proxies: pass each event on at once
        for k, v in headers.items():
            h.send_header(k, v)
        self.end_headers()
        self.status = 200

    def write_chunk(self, data: bytes) -> None:
        """One piece of a streamed body; b"" ends it."""
        if not self.chunked and not data:
            return
        try:
            self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
            self.handler.wfile.flush()
        except GONE + (OSError,):
            raise ClientGone() from None
        self.last_write = time.monotonic()

    def send_events(self, data: bytes) -> None:
        """Server-sent events, if there are any (an empty chunk would end the stream)."""
        if data:
            self.write_chunk(data)

    def client_gone(self) -> bool:
        """True when the client closed its end: the socket reads as end-of-file. Data waiting to be read
        (a pipelined request) is not a disconnect. On TLS the raw TCP stream is peeked, not decrypted."""
        sock = self.handler.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return socket.socket.recv(sock, 1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True

    def access_line(self) -> str:
        parts = [f'{self.handler.client_address[0]} "{self.command} {self.path}" {self.status}']
        if self.model_name:
            parts.append(self.model_name)
        if self.usage:
            parts.append(f"{self.usage[0]}+{self.usage[1]} tokens")
        parts.append(f"{time.monotonic() - self.t0:.2f}s")
        if self.note:
            parts.append(self.note)
        return " ".join(parts)
