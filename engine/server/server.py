"""The server: a threaded standard-library HTTP server (one thread per connection), optional TLS, one
scheduler per model, and an orderly stop."""

from __future__ import annotations

import socket
import socketserver
import ssl
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Callable

from engine.server.config import ServedModel, ServerConfig, ServerConfigError
from engine.server.guard import ConnectionGuard
from engine.server.handler import Handler
from engine.server.state import ServerState


def _stderr(line: str) -> None:
    print(f"goinfer serve: {line}", file=sys.stderr, flush=True)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of clients must not meet refused connections
    state: ServerState
    guard: ConnectionGuard
    tls = False

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup that can stall startup); skip it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def get_request(self):
        request, address = super().get_request()
        try:
            # Nagle's algorithm held each answer's body until the client had ACKed its headers, and clients
            # delay that ACK by up to 40 ms: every answer took >= 40 ms (GET /v1/models 44 ms, now ~1 ms), and a
            # stream's small chunks could bunch up the same way.
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # not TCP
            pass
        return request, address

    def process_request(self, request, client_address) -> None:
        if not self.guard.admit(request, self.tls):  # full: answered 503 and closed here, no thread spent
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        self.guard.closed(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ssl.SSLError, ConnectionError, TimeoutError)):
            self.state.log(f"{client_address[0]}: connection dropped: {exc}")  # e.g. plain HTTP on the TLS port
        else:
            super().handle_error(request, client_address)


class Server:
    """Serve `models` as configured. start() binds and serves in a background thread; stop() ends it."""

    def __init__(self, models: list[ServedModel], config: ServerConfig, *, log: Callable[[str], None] = _stderr,
                 embedders: list = (), loading: bool = False):
        """loading: the models come once the server listens (add_model, add_embedder, then finish_loading);
        meanwhile /health says "loading" and requests wait (loading.py)."""
        if not models and not embedders and not loading:
            raise ServerConfigError("no model to serve")
        config.check()
        self.config = config
        self.state = ServerState(models, config, log, embedders, loading=loading)
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        server_class = type("GoinferHTTPServer", (_HTTPServer,), {"address_family": family})
        try:
            self.httpd = server_class((config.host, config.port), Handler)
        except OSError as e:
            self._close_schedulers("startup failed")
            raise ServerConfigError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
        self.httpd.state = self.state
        self.httpd.guard = self.state.guard = ConnectionGuard(config.max_connections, config.read_deadline_s)
        self.httpd.tls = config.tls
        if config.tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                ctx.load_cert_chain(str(config.tls_cert), str(config.tls_key))
            except (ssl.SSLError, OSError) as e:
                self.httpd.server_close()
                self._close_schedulers("startup failed")
                raise ServerConfigError(f"--tls-cert/--tls-key: cannot load the certificate and key: {e}") from None
            # The handshake happens in each connection's own thread (Handler.setup), never in accept().
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.config.tls else 'http'}://{host}:{self.port}"

    @property
    def body_cap(self) -> int:
        return self.state.body_cap

    def add_model(self, served: ServedModel) -> None:
        self.state.add_model(served)

    def add_embedder(self, embedder) -> None:
        self.state.add_embedder(embedder)

    def calibrate_decisions(self, name: str, temperatures: dict[str, float]) -> None:
        """/v1/systemone's fitted temperatures for model `name` (--decisions-calibration)."""
        self.state.decisions.temperatures[name] = dict(temperatures)

    def finish_loading(self, error: str | None = None) -> None:
        self.state.finish_loading(error)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="goinfer-http", daemon=True)
        self._thread.start()

    def stop(self, reason: str = "the server is shutting down", grace_s: float = 3.0) -> int:
        """Stop accepting, cancel what is queued or running, give handlers `grace_s` to send their last
        bytes, close. Returns how many requests were still in flight."""
        self.state.closing = True
        self.httpd.shutdown()
        in_flight = sum(h["queued"] + h["running_requests"]
                        for h in (s.health() for s in self.state.schedulers.values()))
        self.state.close_batches()  # first: its lines stop as lines, not as the schedulers' failures
        self._close_schedulers(reason)
        self.state.save_sessions()
        deadline = time.monotonic() + grace_s
        while self.state.active_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        self.httpd.server_close()
        self.httpd.guard.stop()
        return in_flight

    def _close_schedulers(self, reason: str) -> None:
        for s in self.state.schedulers.values():
            s.close(reason)
