"""The handler's routes over stored things and utilities: OpenAI's Files and Batch APIs (files.py, batches.py)
and llama.cpp's /tokenize, /detokenize, /apply-template (engine/api/tokens.py). A mixin of Handler (handler.py),
whose plumbing (_only, _read_body, _json_body, _send_json, _send_body) they answer with."""

from __future__ import annotations

from engine.api.openai_objects import error_body, error_object, error_status
from engine.api.tokens import apply_template, detokenize, tokenize
from engine.errors import GoinferError
from engine.server.files import parse_upload
from engine.server.intake import HTTPError

__all__ = ["ResourceRoutes"]


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
                self._send_json(200, {"object": "list", "data": runner.list(), "has_more": False})
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
        found = runner.cancel(batch_id) if tail else runner.get(batch_id)
        if found is None:
            raise self._no_such("batch", batch_id)
        self._send_json(200, found)

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
