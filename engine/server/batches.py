"""OpenAI's Batch API over HTTP: the requests of an uploaded JSONL file, run in the background by the resumable
runner of `goinfer batch` (engine/batch/runner.py), through the served model's own scheduler, so the batch's lines
take their turns beside live requests.

    POST /v1/batches               {"input_file_id", "endpoint", "completion_window": "24h", "metadata"} -> a batch
    GET  /v1/batches               {"object": "list", "data": [batches]}, newest first
    GET  /v1/batches/{id}          the batch: status, request_counts, output_file_id, error_file_id
    POST /v1/batches/{id}/cancel   cancelling, then cancelled; what finished stays in its output file

Checked when it is created, as OpenAI checks: every line's `url` is the batch's endpoint, and every line names the
same served model (or none, with one model served). One batch runs at a time, in the order they came. A batch is
kept as DIR/BATCHID.json, its results as DIR/BATCHID.output.jsonl until they become files; when the server stops,
an unfinished batch stays in_progress and resumes when it starts again on the same --batch-dir (lines already in
its output are not run again, a line cut off is redone).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path

from engine.api.embeddings import EMBEDDINGS_URL
from engine.api.fields import known_fields, object_body, str_field
from engine.api.openai import CHAT_URL, COMPLETIONS_URL
from engine.batch.io import errors_path, read_input
from engine.batch.runner import run_batch
from engine.api.openai_objects import error_body, error_status
from engine.errors import BatchFileError, GoinferError, RequestError
from engine.files import write_atomic
from engine.server.intake import HTTPError
from engine.server.files import FileStore
from engine.server.routes import Route, Subtree, not_found

__all__ = ["BATCHES_URL", "BatchRunner", "ENDPOINTS", "ROUTES"]

BATCHES_URL = "/v1/batches"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
_UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
_ID = re.compile(r"^(msg)?batch_[0-9a-f]{24}$")


class BatchRunner:
    """The server's batches: kept in `directory`, run one at a time on a thread of their own."""

    def __init__(self, state, directory: Path, files: FileStore):
        self.state, self.dir, self.files = state, Path(directory), files
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._cancel: set[str] = set()
        self._running: str | None = None
        self._thread = threading.Thread(target=self._loop, name="goinfer-batches", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the routes

    def create(self, body) -> dict:
        body = object_body(body)
        known_fields(body, {"input_file_id", "endpoint", "completion_window", "metadata"})
        file_id = str_field(body, "input_file_id")
        if not file_id:
            raise RequestError("input_file_id: required", "input_file_id", "missing_required_parameter")
        endpoint = str_field(body, "endpoint")
        if endpoint not in ENDPOINTS:
            raise RequestError(f"endpoint: must be one of {', '.join(ENDPOINTS)} (got {endpoint!r})", "endpoint",
                               "invalid_value")
        if body.get("completion_window", "24h") != "24h":
            raise RequestError("completion_window: must be 24h", "completion_window", "invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and
                                         all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise RequestError("metadata: at most 16 string keys with string values", "metadata", "invalid_value")
        path = self.files.data_path(file_id)
        if path is None or self.files.get(file_id)["purpose"] != "batch":
            raise RequestError(f"input_file_id: no uploaded batch file {file_id!r}", "input_file_id", "not_found")
        return self.start(file_id, endpoint, metadata)

    def start(self, file_id: str, endpoint: str, metadata: dict | None = None, prefix: str = "batch_") -> dict:
        """Check an uploaded file's lines and queue them as a batch (`prefix`: msgbatch_ for Anthropic's)."""
        model, total = self._check_lines(self.files.data_path(file_id), endpoint)
        now = int(time.time())
        batch = {"id": prefix + uuid.uuid4().hex[:24], "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": file_id, "completion_window": "24h", "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata,
                 "model": model}
        with self._lock:
            self._save(batch)
            self._wake.notify_all()
        return batch

    def get(self, batch_id: str) -> dict | None:
        if not _ID.match(batch_id):
            return None
        try:
            return json.loads((self.dir / f"{batch_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def list(self, prefix: str | None = None) -> list[dict]:
        """The batches (only those whose ids start with `prefix`, when given), newest first."""
        batches = [self.get(p.stem) for p in self.dir.glob("*batch_*.json")]
        return sorted((b for b in batches if b is not None and (prefix is None or b["id"].startswith(prefix))),
                      key=lambda b: b["created_at"], reverse=True)

    def cancel(self, batch_id: str) -> dict | None:
        with self._lock:
            batch = self.get(batch_id)
            if batch is None or batch["status"] not in _UNFINISHED:
                return batch
            batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
            self._save(batch)
            self._cancel.add(batch_id)
            self._wake.notify_all()
            return batch

    def delete(self, batch_id: str) -> bool | None:
        """Forget an ended batch and its files: True; None if there is no such batch, False if it has not ended."""
        with self._lock:
            batch = self.get(batch_id)
            if batch is None:
                return None
            if batch["status"] in _UNFINISHED:
                return False
            for key in ("input_file_id", "output_file_id", "error_file_id"):
                if batch.get(key):
                    self.files.delete(batch[key])
            (self.dir / f"{batch_id}.json").unlink(missing_ok=True)
            return True

    def close(self, wait_s: float = 10.0) -> None:
        """Stop: the batch running stays in_progress on disk (its finished lines are in its output)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        self._thread.join(wait_s)

    # ------------------------------------------------------------------ checks

    def _check_lines(self, path: Path, endpoint: str) -> tuple[str, int]:
        """The served model every line names, and how many lines (RequestError for a batch that cannot run)."""
        try:
            lines = read_input(path)
        except BatchFileError as e:
            raise RequestError(f"input_file_id: {e}", "input_file_id", "invalid_file") from None
        if not lines:
            raise RequestError("input_file_id: the file has no requests", "input_file_id", "invalid_file")
        names = set()
        for line in lines:
            if line.url is not None and line.url != endpoint:
                raise RequestError(f"input_file_id: line {line.lineno}: url {line.url!r} is not the batch's endpoint "
                                   f"{endpoint}", "input_file_id", "invalid_file")
            if line.request is not None:
                names.add(line.request.model)
        if len(names) > 1:
            raise RequestError(f"input_file_id: the lines name several models ({', '.join(sorted(map(str, names)))})"
                               "; a batch runs on one", "input_file_id", "invalid_file")
        name = next(iter(names), None)
        served = self.state.embedders if endpoint == EMBEDDINGS_URL else self.state.models  # /v1/messages too
        if name is None and len(served) == 1:
            name = next(iter(served))
        if name not in served:
            raise RequestError(f"model: {name!r} is not served here for {endpoint} (served: "
                               f"{', '.join(served) or 'none'})", "model", "model_not_found")
        return name, len(lines)

    # ------------------------------------------------------------------ the worker

    def _save(self, batch: dict) -> None:
        write_atomic(self.dir / f"{batch['id']}.json", json.dumps(batch).encode())

    def _next(self) -> dict | None:
        pending = [b for b in self.list() if b["status"] in _UNFINISHED]
        return min(pending, key=lambda b: b["created_at"]) if pending else None

    def _loop(self) -> None:
        while True:
            with self._lock:
                batch = None
                while not self._stopping and (batch := self._next()) is None:
                    self._wake.wait()  # create, cancel and close notify: nothing to poll for
                if self._stopping:
                    return
                self._running = batch["id"]
            try:
                self._run(batch)
            except Exception as e:  # noqa: BLE001 - a batch that cannot run fails; the server goes on
                self.state.log(f"batch {batch['id']} failed: {type(e).__name__}: {e}")
                self._finish(batch, "failed", errors={"object": "list", "data": [
                    {"code": "batch_failed", "message": str(e), "param": None, "line": None}]})
            finally:
                with self._lock:
                    self._running = None

    def _stop_requested(self, batch_id: str):
        return lambda: self._stopping or batch_id in self._cancel

    def _run(self, batch: dict) -> None:
        try:
            self.state.wait_loaded()  # a batch resumed at start runs once the models it names are loaded
        except HTTPError:
            return  # closing (or the load failed): the batch stays as it is, resumed at the next start
        out = self.dir / f"{batch['id']}.output.jsonl"
        if batch["status"] == "cancelling":
            return self._finish(batch, "cancelled", out)
        if batch["status"] == "finalizing":  # stopped while its results were being filed: file the rest
            return self._finish(batch, batch.get("finalizing_as", "completed"), out)
        if batch["status"] == "validating":
            batch.update(status="in_progress", in_progress_at=int(time.time()))
            with self._lock:
                self._save(batch)
        name, counts = batch["model"], batch["request_counts"]
        embeds = batch["endpoint"] == EMBEDDINGS_URL

        def on_line(result) -> None:
            counts["completed" if result.ok else "failed"] += 1
            with self._lock:
                if batch["id"] not in self._cancel:
                    self._save(batch)

        counts.update(completed=_records(out), failed=0)
        summary = run_batch(
            self.files.data_path(batch["input_file_id"]), out,
            load_model=lambda: self.state.models[name].model, model_name=name,
            should_stop=self._stop_requested(batch["id"]), on_line=on_line,
            parallel=self.state.max_concurrent, thinking=self.state.thinking,
            scheduler=None if embeds else self.state.schedulers[name],
            load_embedder=(lambda: _Queued(self.state.embedders[name], self.state.embed_queues[name]))
            if embeds else None)
        if batch["id"] in self._cancel:
            return self._finish(batch, "cancelled", out)
        if summary.interrupted:  # the server is stopping: resumed at its next start
            return None
        self._finish(batch, "completed", out)

    def _finish(self, batch: dict, status: str, out: Path | None = None, errors: dict | None = None) -> None:
        now = int(time.time())
        if out is not None:
            batch["status"], batch["finalizing_at"], batch["finalizing_as"] = "finalizing", now, status
            with self._lock:
                self._save(batch)
            for path, key in ((out, "output_file_id"), (errors_path(out), "error_file_id")):
                if path.exists() and path.stat().st_size:
                    batch[key] = self.files.add_path(path, f"{batch['id']}_{key[:-8]}.jsonl", "batch_output")["id"]
                    with self._lock:
                        self._save(batch)  # filed: a stop from here on does not file it again
                else:
                    path.unlink(missing_ok=True)
            batch.pop("finalizing_as")
        batch["status"], batch[f"{status}_at"], batch["errors"] = status, now, errors
        with self._lock:
            self._save(batch)
            self._cancel.discard(batch["id"])


def _records(path: Path) -> int:
    try:
        return sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
    except OSError:
        return 0


class _Queued:
    """An embedding model whose passes go through the server's queue for it (shared with live requests)."""

    def __init__(self, model, queue):
        self._model, self._queue = model, queue

    def embed(self, lists):
        return self._queue.embed(lists)

    def __getattr__(self, name):
        return getattr(self._model, name)


# ---------------------------------------------------------------------------------------------- the routes

def list_batches(ex) -> None:
    ex.send_json(200, {"object": "list", "data": ex.state.batches.list("batch_"), "has_more": False})


def create_batch(ex) -> None:
    try:
        ex.send_json(200, ex.state.batches.create(ex.json_body()))
    except GoinferError as e:
        raise HTTPError(error_status(e), error_body(e)) from None


def get_batch(ex, id: str) -> None:  # noqa: A002 - the route's parameter
    found = ex.state.batches.get(id) if id.startswith("batch_") else None
    if found is None:
        raise not_found("batch", id)
    ex.send_json(200, found)


def cancel_batch(ex, id: str) -> None:  # noqa: A002
    found = ex.state.batches.cancel(id) if id.startswith("batch_") else None
    if found is None:
        raise not_found("batch", id)
    ex.send_json(200, found)


ROUTES = (
    Route("GET", BATCHES_URL, list_batches),
    Route("POST", BATCHES_URL, create_batch),
    Route("GET", BATCHES_URL + "/{id}", get_batch),
    Route("POST", BATCHES_URL + "/{id}/cancel", cancel_batch),
    Subtree(BATCHES_URL, lambda rest: not_found("batch route", rest)),
)
