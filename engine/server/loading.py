"""A server that listens before its models are loaded (`goinfer serve`): the gate requests wait at meanwhile.

A fresh server's models take seconds to load, and on the first run after an install their kernels compile first
(~5 s on 2 cores). Listening from the start, it can say so: /health answers 503 {"status": "loading"} (as
llama-server does) and turns 200 once every model can answer; a request that arrives meanwhile waits here, its
body read, up to what one model admits (--max-concurrent + --max-queue), and then runs as any other. Past the limit, or if the
load failed, it gets 503 with Retry-After.
"""

from __future__ import annotations

import threading

from engine.api.openai_objects import error_object
from engine.server.intake import HTTPError

RETRY_AFTER_S = 5
POLL_S = 0.25  # how often a waiting request looks whether the server is closing


class Loading:
    def __init__(self, max_waiting: int, done: bool = False):
        self.max_waiting = max_waiting
        self.error: str | None = None  # why the load failed (then nothing will be served)
        self.waiting = 0
        self._done = threading.Event()
        self._lock = threading.Lock()
        if done:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def status(self) -> str:
        """/health's word for it: "ok", "loading" or "load_failed"."""
        return "loading" if not self.done else "load_failed" if self.error is not None else "ok"

    def finish(self, error: str | None = None) -> None:
        """Every model is loaded (or the load failed: `error`); waiting requests go on."""
        self.error = error
        self._done.set()

    def wait(self, closing) -> None:
        """Hold a request until the models are loaded; 503 when too many wait, the load failed or the server
        closes meanwhile (`closing()`)."""
        if self.done and self.error is None:
            return
        with self._lock:
            if self.waiting >= self.max_waiting and not self.done:
                raise _unavailable(f"the server is loading its models and {self.waiting} requests wait already; "
                                   f"retry after {RETRY_AFTER_S} s", "loading")
            self.waiting += 1
        try:
            while not self._done.wait(POLL_S):
                if closing():
                    raise _unavailable("the server is shutting down", "shutting_down")
        finally:
            with self._lock:
                self.waiting -= 1
        if self.error is not None:
            raise _unavailable(f"the server could not load its models: {self.error}", "load_failed")


def _unavailable(message: str, code: str) -> HTTPError:
    return HTTPError(503, error_object(message, "server_error", None, code), {"Retry-After": str(RETRY_AFTER_S)})
