"""How the handler writes its answers: headers (each with the CORS headers an allowed origin gets), JSON and
other bodies, chunks of a stream, errors in the route's shape; whether the client is still there; the access log
line. A mixin of Handler (handler.py), whose per-request state (_cors, _chunked, _dialect, _status...) it writes."""

from __future__ import annotations

import json
import select
import socket
import ssl
import time

from engine.server import intake
from engine.server.intake import ClientGone, HTTPError

__all__ = ["GONE", "AnswerWriter"]

GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError, ssl.SSLError)


class AnswerWriter:
    def end_headers(self) -> None:
        for k, v in getattr(self, "_cors", {}).items():  # an allowed origin's page may read every answer
            self.send_header(k, v)
        super().end_headers()

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
        except GONE + (OSError,):
            raise ClientGone() from None
        self._last_write = time.monotonic()

    def _send_events(self, data: bytes) -> None:
        """Server-sent events, if there are any (an empty chunk would end the stream)."""
        if data:
            self._write_chunk(data)

    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self._send_body(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    def _send_body(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        if getattr(self, "_body_read", True) is False and intake.has_body(self.headers):
            self.close_connection = True  # the body was never read: the connection cannot be reused
        self.send_response(status)
        self.send_header("Content-Type", content_type)
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
            except GONE + (OSError,):
                raise ClientGone() from None

    def _send_error(self, e: HTTPError) -> None:
        status, body = self._dialect.error(e.status, e.body)
        self._send_json(status, body, e.headers)

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
