"""What every handler thread of the server shares (ServerState): the models, their schedulers, the limits, the
Responses API's store, the counters of requests in flight, and the health report."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from engine.api.openai_objects import model_object
from engine.api.responses import ResponseStore
from engine.embeddings.batcher import EmbeddingQueue
from engine.errors import RequestError
from engine.files import lock_exclusive
from engine.server.admin import ModelAdmin
from engine.server.batches import BatchRunner
from engine.server.config import (ServedModel, ServerConfig, ServerConfigError, body_cap, body_cap_for,
                                  embeddings_body_cap)
from engine.server.cors import CorsPolicy
from engine.server.deciding import DecisionDesk
from engine.server.files import FileStore
from engine.server.loading import Loading
from engine.running.scheduler import Scheduler
from engine.sessions.disk import SessionDir
from engine.sessions.pool import SessionPool, default_budget_bytes


class ServerState:
    """What every handler thread shares: the models, their schedulers, the limits, the counters."""

    def __init__(self, models: list[ServedModel], config: ServerConfig, log: Callable[[str], None],
                 embedders: list = (), loading: bool = False):
        # loading: the models come after the server listens (add_model, add_embedder, then finish_loading)
        self.loading = Loading(config.max_concurrent + config.max_queue, done=not loading)
        self.models = {m.name: m for m in models}
        self.embedders = {m.name: m for m in embedders}  # /v1/embeddings' models (engine/embeddings)
        # concurrent requests to one embedding model share its forward passes
        self.embed_queues = {m.name: EmbeddingQueue(m) for m in embedders}
        self.api_keys = config.api_keys or None  # read once: a changed file takes a restart
        self.allowed_hosts = config.allowed_hosts
        self.cors = CorsPolicy(config.cors_origins)
        self.web = config.web  # the built-in chat page at / (serve --no-web turns it off)
        self.guard = None  # the server's ConnectionGuard (set by Server), for the handlers' request deadlines
        self.body_cap = body_cap(config, models) if not loading else body_cap_for(config, config.ctx)
        self.embeddings_body_cap = embeddings_body_cap(config)
        self.keepalive_s = config.keepalive_s
        self.max_queue = config.max_queue
        self.max_concurrent = config.max_concurrent
        self.prefill_chunk = config.prefill_chunk
        self.kv_sessions = config.kv_sessions
        self.thinking = config.thinking
        self.log = log
        self.started = time.time()
        self.closing = False
        self.session_dirs: dict[str, SessionDir] = {}
        self._config = config
        self.default_ctx = config.ctx
        self.schedulers = {m.name: self._scheduler(m) for m in models}
        self.response_store = ResponseStore()  # the Responses API's stored answers (store, previous_response_id)
        self.decisions = DecisionDesk(self, config.decisions_template, config.max_queue,  # POST /v1/systemone
                                      config.decisions_temperatures)
        self._active = 0
        self._lock = threading.Lock()
        self.running: dict[str, object] = {}  # request id -> its Job, while a generation route answers it
        # OpenAI's Files and Batch APIs: kept in --batch-dir (resumed after a restart), else in a temporary
        # directory removed at shutdown
        self._batch_tmp = None if config.batch_dir is not None else tempfile.mkdtemp(prefix="goinfer-batches-")
        root = Path(config.batch_dir or self._batch_tmp)
        self._batch_lock = _lock_dir(root)
        self.files = FileStore(root / "files")
        self.batches = BatchRunner(self, root / "batches", self.files)
        self.admin = ModelAdmin(self, drain_s=config.unload_drain_s) if config.allow_admin else None

    def _scheduler(self, served: ServedModel) -> Scheduler:
        config = self._config
        return Scheduler(served.model, served.name, max_queue=config.max_queue, max_concurrent=config.max_concurrent,
                         prefill_chunk=config.prefill_chunk, threads=config.threads,
                         sessions=self._sessions(served, config), speculation=config.speculation, log=self.log)

    def add_model(self, served: ServedModel) -> None:
        """A model loaded at runtime (admin.py): its scheduler first, so a request that finds it can run."""
        self.schedulers = {**self.schedulers, served.name: self._scheduler(served)}
        self.decisions.add_model(served.name)
        self.models = {**self.models, served.name: served}  # one assignment: readers see before or after

    def add_embedder(self, embedder) -> None:
        self.embed_queues = {**self.embed_queues, embedder.name: EmbeddingQueue(embedder)}
        self.embedders = {**self.embedders, embedder.name: embedder}

    def finish_loading(self, error: str | None = None) -> None:
        """Every model given at start is loaded (or `error` says why not): the limits follow the models loaded,
        and the requests waiting meanwhile go on."""
        if error is None:
            self.body_cap = body_cap(self._config, list(self.models.values()))
        self.loading.finish(error)

    def wait_loaded(self) -> None:
        """Hold a request until the models given at start are loaded (loading.py)."""
        self.loading.wait(lambda: self.closing)

    def remove_model(self, name: str) -> Scheduler | None:
        """Stop routing to a model (admin.py unloads it); its scheduler, still running what it holds."""
        if name not in self.models:
            return None
        self.models = {k: v for k, v in self.models.items() if k != name}
        return self.schedulers[name]

    def forget_scheduler(self, name: str) -> None:
        self.schedulers = {k: v for k, v in self.schedulers.items() if k != name}
        self.session_dirs.pop(name, None)

    def _sessions(self, served: ServedModel, config: ServerConfig) -> SessionPool | None:
        """A model's warm sessions, those its --session-dir holds restored."""
        if config.kv_sessions < 1:
            return None
        budget = session_budget_bytes(config)
        store = None
        if config.session_dir is not None:
            store = self.session_dirs[served.name] = SessionDir(config.session_dir, served.model,
                                                                lambda line: self.log(f"{served.name}: {line}"))
        pool = SessionPool(served.model, max_sessions=config.kv_sessions, budget_bytes=budget,
                           on_evict=store.save if store is not None else None)
        if store is not None:
            restored = store.load_all()
            for session in reversed(restored):  # oldest first: the newest is the last to be evicted
                session.used = time.monotonic()
                pool.add(session)
            if restored:
                self.log(f"{served.name}: restored {len(restored)} warm sessions from {config.session_dir}")
        return pool

    def close_batches(self) -> None:
        """Shutdown, before the schedulers close: the running batch stops where it is (resumed at the next start
        on the same --batch-dir); a temporary batch directory is removed."""
        self.batches.close()
        os.close(self._batch_lock)
        if self._batch_tmp is not None:
            shutil.rmtree(self._batch_tmp, ignore_errors=True)

    def save_sessions(self) -> None:
        """Shutdown: every warm session to its model's --session-dir (after the schedulers have stopped)."""
        for name, store in self.session_dirs.items():
            sessions = self.schedulers[name].sessions.drain()
            for session in sessions:
                store.save(session)
            if sessions:
                self.log(f"{name}: wrote {len(sessions)} warm sessions to {store.root}")

    def route(self, name: str | None) -> ServedModel | None:
        """The model a request names (None if it is not served). A request that names none is served by
        the only model, when there is one."""
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise RequestError(f"model: required when several models are served ({', '.join(self.models)})",
                               "model", "missing_required_parameter")
        return self.models.get(name)

    def model_entries(self) -> dict[str, dict]:
        """/v1/models' entries by name: the generation models, then the embedding models (with their width)."""
        decisions = {"route": "label", "template": self.decisions.template}  # every generation model answers them
        entries = {m.name: {**model_object(m.name, created=m.created, context_window=m.window),
                            **_backend_fields(m.model.placement), "decisions": decisions}
                   for m in self.models.values()}
        for m in self.embedders.values():
            entry = model_object(m.name, created=int(self.started), context_window=m.context)
            entries[m.name] = {**entry, "type": "embedding", "dimensions": m.dimension}
        return entries

    def typesafe_models(self) -> list[dict]:
        """TypeSafe's `models` array (GET /v1/models beside OpenAI's `data`): the models /v1/systemone answers on.
        release_date is the model file's date (goinfer knows no release date)."""
        return [{"name": m.name, "description": f"{m.model.config.arch} model served by goinfer; decisions by label "
                 f"scoring ({self.decisions.template})",
                 "release_date": time.strftime("%Y-%m-%d", time.gmtime(m.created or self.started))}
                for m in self.models.values()]

    def embedder(self, name: str | None):
        """The embedding model a request names (None if it is not served); the only one when none is named."""
        if name is None:
            if len(self.embedders) == 1:
                return next(iter(self.embedders.values()))
            raise RequestError(f"model: required ({', '.join(self.embedders) or 'no embedding model is served'})",
                               "model", "missing_required_parameter")
        return self.embedders.get(name)

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
        return {"status": "shutting_down" if self.closing else self.loading.status,
                "uptime_s": round(time.time() - self.started, 1),
                "limits": {"max_body_bytes": self.body_cap, "max_embeddings_body_bytes": self.embeddings_body_cap,
                           "max_queue": self.max_queue,
                           "max_concurrent": self.max_concurrent, "prefill_chunk": self.prefill_chunk,
                           "kv_sessions": self.kv_sessions,
                           "speculation": ({"method": "ngram", "draft_max": self._config.speculation.draft_max}
                                           if self._config.speculation else None),
                           "max_connections": self.guard.max_connections if self.guard else None,
                           "open_connections": self.guard.open_connections if self.guard else None},
                "models": [s.health() for s in self.schedulers.values()],
                "selftest": _selftest_report()}


def _backend_fields(placement: dict) -> dict:
    """/v1/models' short form of a model's placement: the backend, and the adapter's name when it runs on one.
    Not the adapter that auto looked at and declined (a software one): beside "backend": "cpu" that name would
    read as the device doing the work; /health carries the whole placement, reason included."""
    adapter = (placement.get("adapter") or {}).get("adapter") if placement["backend"] == "webgpu" else None
    return {"backend": placement["backend"], **({"adapter": adapter} if adapter else {})}


def session_budget_bytes(config: ServerConfig) -> int:
    """The KV memory a model's warm sessions may hold: --session-memory, else derived from what is available."""
    if config.session_memory_mib is not None:
        return config.session_memory_mib << 20
    return default_budget_bytes(_available_bytes())


def _available_bytes() -> int | None:
    from engine.loading.hardware import memory_info

    return memory_info()["available_bytes"]


def _selftest_report() -> dict:
    from engine.kernels.registry import selftest_report  # the kernel self-test run at the first model load

    return selftest_report()


def _lock_dir(root: Path) -> int:
    """An exclusive lock on a batch directory, held while the server runs: two servers on one would run its
    batches twice."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    if not lock_exclusive(fd, blocking=False):
        os.close(fd)
        raise ServerConfigError(f"--batch-dir {root}: another goinfer serve is using it")
    return fd
