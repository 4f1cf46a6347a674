"""What every handler thread of the server shares (ServerState): the models, their schedulers, the limits, the
Responses API's store, the counters of requests in flight, and the health report."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from engine.api.responses import ResponseStore
from engine.errors import RequestError
from engine.server.config import ServedModel, ServerConfig, body_cap
from engine.scheduler import Scheduler


class ServerState:
    """What every handler thread shares: the models, their schedulers, the limits, the counters."""

    def __init__(self, models: list[ServedModel], config: ServerConfig, log: Callable[[str], None]):
        self.models = {m.name: m for m in models}
        self.api_key = config.api_key
        self.body_cap = body_cap(config, models)
        self.keepalive_s = config.keepalive_s
        self.max_queue = config.max_queue
        self.max_concurrent = config.max_concurrent
        self.prefill_chunk = config.prefill_chunk
        self.log = log
        self.started = time.time()
        self.closing = False
        self.schedulers = {m.name: Scheduler(m.model, m.name, max_queue=config.max_queue,
                                             max_concurrent=config.max_concurrent, prefill_chunk=config.prefill_chunk,
                                             threads=config.threads, log=log) for m in models}
        self.response_store = ResponseStore()  # the Responses API's stored answers (store, previous_response_id)
        self._active = 0
        self._lock = threading.Lock()

    def route(self, name: str | None) -> ServedModel | None:
        """The model a request names (None if it is not served). A request that names none is served by
        the only model, when there is one."""
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise RequestError(f"model: required when several models are served ({', '.join(self.models)})",
                               "model", "missing_required_parameter")
        return self.models.get(name)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    @property
    def active_requests(self) -> int:
        return self._active

    def health(self) -> dict:
        return {"status": "shutting_down" if self.closing else "ok",
                "uptime_s": round(time.time() - self.started, 1),
                "limits": {"max_body_bytes": self.body_cap, "max_queue": self.max_queue,
                           "max_concurrent": self.max_concurrent, "prefill_chunk": self.prefill_chunk},
                "models": [s.health() for s in self.schedulers.values()],
                "selftest": _selftest_report()}


def _selftest_report() -> dict:
    from engine.kernels.cpu.selftest import report  # the kernel self-test run at the first model load

    return report()
