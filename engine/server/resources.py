"""The handler's routes over stored things and utilities: OpenAI's Files and Batch APIs (files.py, batches.py),
Anthropic's Message Batches (message_batches.py), llama.cpp's /tokenize, /detokenize, /apply-template
(engine/api/tokens.py), the admin routes (admin.py) and the built-in chat page (web/). A mixin of Handler
(handler.py), whose plumbing (_only, _read_body, _json_body, _send_json, _send_body) they answer with."""

from __future__ import annotations

import ssl
from pathlib import Path

from engine.api import anthropic
from engine.api.fields import known_fields, object_body, str_field
from engine.api.openai_objects import error_body, error_object, error_status
from engine.api.tokens import apply_template, detokenize, tokenize
from engine.errors import GoinferError, RequestError
from engine.server import message_batches
from engine.server.files import parse_upload
from engine.server.intake import HTTPError

__all__ = ["CONTROL_URL", "WEB_FILES", "ResourceRoutes"]

CONTROL_URL = "/v1/chat/completions/control"  # llama.cpp's: a running reply told to end its thinking now

# The built-in chat page (GET /): path -> (file in engine/server/web/, content type). Static and free of secrets, so
# served without the API key (a browser cannot send one when it opens a page); the page asks for the key.
WEB_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
             "/ui/chat.js": ("chat.js", "text/javascript; charset=utf-8")}
_WEB_DIR = Path(__file__).with_name("web")
_WEB_HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


class ResourceRoutes:
    def _files(self, rest: str) -> None:
        """OpenAI's Files API (engine/server/files.py): upload, list, read, delete."""
        store = self.state.files
        if not rest:
            self._only("GET", "POST")
            if self.command == "GET":
                self._send_json(200, {"object": "list", "data": store.list(), "has_more": False})
                return
            try:
                filename, data, purpose = parse_upload(self.headers.get("Content-Type", ""), self._read_body())
            except GoinferError as e:
                raise HTTPError(error_status(e), error_body(e)) from None
            self._send_json(200, store.add(filename, data, purpose))
            return
        file_id, _, tail = rest.partition("/")
        if tail not in ("", "content"):
            raise self._no_such("file route", rest)
        self._only(*(("GET",) if tail else ("GET", "DELETE")))
        found = store.get(file_id)
        if found is None:
            raise self._no_such("file", file_id)
        if tail:
            self._send_body(200, store.data_path(file_id).read_bytes(), "application/octet-stream")
        elif self.command == "DELETE":
            store.delete(file_id)
            self._send_json(200, {"id": file_id, "object": "file", "deleted": True})
        else:
            self._send_json(200, found)

    def _batches(self, rest: str) -> None:
        """OpenAI's Batch API (engine/server/batches.py): create, list, read, cancel."""
        runner = self.state.batches
        if not rest:
            self._only("GET", "POST")
            if self.command == "GET":
                self._send_json(200, {"object": "list", "data": runner.list("batch_"), "has_more": False})
                return
            try:
                self._send_json(200, runner.create(self._json_body()))
            except GoinferError as e:
                raise HTTPError(error_status(e), error_body(e)) from None
            return
        batch_id, _, tail = rest.partition("/")
        if tail not in ("", "cancel"):
            raise self._no_such("batch route", rest)
        self._only("POST" if tail else "GET")
        found = None if not batch_id.startswith("batch_") else runner.cancel(batch_id) if tail else \
            runner.get(batch_id)
        if found is None:
            raise self._no_such("batch", batch_id)
        self._send_json(200, found)

    def _message_batches(self, rest: str) -> None:
        """Anthropic's Message Batches API (message_batches.py), its errors in Anthropic's shape."""
        runner, root = self.state.batches, self._root_url()

        def refuse(status: int, message: str) -> HTTPError:
            return HTTPError(status, anthropic.error_body(status, message))

        if not rest:
            self._only("GET", "POST")
            if self.command == "POST":
                try:
                    batch = message_batches.create(runner, self._json_body())
                except GoinferError as e:
                    raise refuse(error_status(e), str(e)) from None
                self._send_json(200, message_batches.message_batch(batch, root))
                return
            data = [message_batches.message_batch(b, root) for b in runner.list(message_batches.PREFIX)]
            self._send_json(200, {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})
            return
        batch_id, _, tail = rest.partition("/")
        if tail not in ("", "cancel", "results") or not batch_id.startswith(message_batches.PREFIX):
            raise refuse(404, f"no message batch route {rest!r}")
        self._only(*{"": ("GET", "DELETE"), "cancel": ("POST",), "results": ("GET",)}[tail])
        batch = runner.get(batch_id)
        if batch is None:
            raise refuse(404, f"no message batch {batch_id!r}")
        if tail == "cancel":
            self._send_json(200, message_batches.message_batch(runner.cancel(batch_id), root))
        elif tail == "results":
            if message_batches.message_batch(batch, root)["processing_status"] != "ended":
                raise refuse(400, f"message batch {batch_id} has not ended yet: its results come once it has")
            self._send_body(200, message_batches.results(batch, runner.files), "application/x-jsonl")
        elif self.command == "DELETE":
            if not runner.delete(batch_id):
                raise refuse(400, f"message batch {batch_id} is still running: cancel it first")
            self._send_json(200, {"id": batch_id, "type": "message_batch_deleted"})
        else:
            self._send_json(200, message_batches.message_batch(batch, root))

    def _control(self) -> None:
        """`{"id": REQUEST_ID, "action": "reasoning_end"}`: the running reply with that id (the chunks' `id`,
        X-Request-Id) closes its thinking at its next token and answers, as a spent budget does. `applied` is false
        where the reply is not thinking (any more)."""
        body = self._json_body()
        try:
            body = object_body(body)
            known_fields(body, {"id", "action"})
            request_id, action = str_field(body, "id"), str_field(body, "action")
            if action != "reasoning_end":
                raise RequestError(f"action: only reasoning_end is supported (got {action!r})", "action",
                                   "invalid_value")
        except GoinferError as e:
            raise HTTPError(error_status(e), error_body(e)) from None
        job = self.state.running.get(request_id or "")
        if job is None:
            raise self._no_such("running request", request_id)
        applied = [gen.end_reasoning() for gen in job.prep.choices]
        self._send_json(200, {"id": request_id, "action": action, "applied": any(applied)})

    def _web(self, path: str) -> None:
        name, content_type = WEB_FILES[path]
        self._send_body(200, (_WEB_DIR / name).read_bytes(), content_type, _WEB_HEADERS)

    def _admin(self, rest: str) -> None:
        """Runtime model loading (admin.py), where `serve --allow-admin` turned it on."""
        admin = self.state.admin
        if rest not in ("", "load", "unload"):
            raise self._no_such("admin route", rest)
        self._only("POST" if rest else "GET")
        if not rest:
            self._send_json(200, admin.list())
            return
        try:
            if rest == "load":
                body = self._json_body()
                self._model_name = body.get("name") if isinstance(body, dict) else None
                self._send_json(200, admin.load(body))
            else:
                status, answer = admin.unload(self._json_body())
                self._send_json(status, answer)
        except GoinferError as e:
            status = {"conflict": 409, "model_not_found": 404}.get(getattr(e, "code", None), error_status(e))
            raise HTTPError(status, error_body(e)) from None

    def _root_url(self) -> str:
        """This server's base URL as the client reached it (results_url points back here)."""
        scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
        return f"{scheme}://{self.headers.get('Host') or self.server.server_address[0]}"

    def _no_such(self, what: str, name: str) -> HTTPError:
        return HTTPError(404, error_object(f"no {what} {name!r}", "invalid_request_error", None, "not_found"))

    def _tokens(self, path: str) -> None:
        """POST /tokenize, /detokenize, /apply-template (engine/api/tokens.py) on the model the body names."""
        body = self._json_body()
        try:
            name = body.get("model") if isinstance(body, dict) else None
            served = self.state.route(name if isinstance(name, str) else None)
            if served is None:
                raise self._unknown_model(name)
            self._model_name = served.name
            if path == "/tokenize":
                answer = tokenize(served.model, body)
            elif path == "/detokenize":
                answer = detokenize(served.model, body)
            else:
                answer = apply_template(served.model, body, self.state.thinking)
        except GoinferError as e:
            raise HTTPError(error_status(e), error_body(e)) from None
        self._send_json(200, answer)
