"""What keeps slow or numerous clients from holding the server's threads: a cap on open connections (beyond it
a 503 with Retry-After, answered from the accept loop) and a deadline for each request's headers and body (a
client that sends them a byte at a time, slowloris, is cut off when it passes; a per-read timeout alone would
let it hold its thread for ever)."""

from __future__ import annotations

import socket
import threading
import time

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_READ_DEADLINE_S = 60.0  # from a connection's start, or its last answer, to a whole request read
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")
_BUSY_BODY = (b'{"error": {"message": "too many open connections (--max-connections); retry shortly", '
              b'"type": "server_error", "param": null, "code": "too_many_connections"}}')


class ConnectionGuard:
    def __init__(self, max_connections: int, read_deadline_s: float):
        self.max_connections = max_connections
        self.read_deadline_s = read_deadline_s
        self._open = 0
        self._reading: dict[socket.socket, float] = {}  # connection -> when its request must be read by
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="goinfer-deadlines", daemon=True)
        self._reaper.start()

    # ------------------------------------------------------------------ connections

    def admit(self, sock: socket.socket, tls: bool) -> bool:
        """A new connection: True to serve it; False when the server is full (it has been answered and closed)."""
        with self._lock:
            if self._open < self.max_connections:
                self._open += 1
                return True
        try:
            if not tls:  # (a TLS client would need a handshake first: it just sees the connection close)
                sock.settimeout(0.5)
                sock.sendall(_BUSY % (len(_BUSY_BODY), _BUSY_BODY))
        except OSError:
            pass
        finally:
            try:
                sock.close()
            except OSError:
                pass
        return False

    def closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._open -= 1
            self._reading.pop(sock, None)

    @property
    def open_connections(self) -> int:
        return self._open

    # ------------------------------------------------------------------ request deadlines

    def expect_request(self, sock: socket.socket) -> None:
        """The connection's next request must be read (headers and body) within the deadline from now."""
        with self._lock:
            self._reading[sock] = time.monotonic() + self.read_deadline_s

    def request_read(self, sock: socket.socket) -> None:
        with self._lock:
            self._reading.pop(sock, None)

    def _reap(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [s for s, t in self._reading.items() if t < now]
                for s in late:
                    del self._reading[s]
            for s in late:  # its blocked read returns: the handler ends the connection
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
