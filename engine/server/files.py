"""OpenAI's Files API, for batches: uploads kept on disk, listed, read back and deleted.

    POST /v1/files                 multipart/form-data: `file` (the JSONL) and `purpose` ("batch") -> a file object
    GET  /v1/files                 {"object": "list", "data": [file objects]}, newest first
    GET  /v1/files/{id}            the file object
    GET  /v1/files/{id}/content    the bytes
    DELETE /v1/files/{id}          {"id", "object": "file", "deleted": true}

A file is FILEID.data beside FILEID.json (its object), each written to a temporary name, fsynced and renamed, so a
crash leaves either the whole file or none of it. Batch results are registered here too (purpose "batch_output").
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path

from engine.api.openai_objects import error_body, error_status
from engine.errors import GoinferError, RequestError
from engine.files import write_atomic
from engine.server.intake import HTTPError
from engine.server.routes import Route, Subtree, not_found

__all__ = ["FILES_URL", "ROUTES", "UPLOAD_CAP", "FileStore", "parse_upload"]

FILES_URL = "/v1/files"
UPLOAD_CAP = 200 << 20  # OpenAI's limit on a batch input file
PURPOSES = ("batch", "batch_output")  # what this server keeps files for
_ID = re.compile(r"^file-[0-9a-f]{24}$")


def parse_upload(content_type: str, body: bytes) -> tuple[str, bytes, str]:
    """(filename, data, purpose) of a multipart/form-data upload (RequestError naming what is missing)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise RequestError("a file is uploaded as multipart/form-data (fields `file` and `purpose`)", "file",
                           "invalid_request")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts() if message.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    if "file" not in fields:
        raise RequestError("file: required (the JSONL file, as a multipart field)", "file",
                           "missing_required_parameter")
    purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
    if purpose != "batch":
        raise RequestError(f"purpose: this server keeps files for batches only (purpose \"batch\"), got {purpose!r}",
                           "purpose", "invalid_value")
    filename, data = fields["file"]
    return filename or "upload.jsonl", data, purpose


class FileStore:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def add(self, filename: str, data: bytes, purpose: str) -> dict:
        file_id = "file-" + uuid.uuid4().hex[:24]
        write_atomic(self.dir / f"{file_id}.data", data)
        return self._describe(file_id, len(data), Path(filename).name, purpose)

    def add_path(self, path: Path, filename: str, purpose: str) -> dict:
        """Register a file written elsewhere in this store's directory (a batch's results), moving it here."""
        file_id = "file-" + uuid.uuid4().hex[:24]
        size = path.stat().st_size
        os.replace(path, self.dir / f"{file_id}.data")
        return self._describe(file_id, size, filename, purpose)

    def _describe(self, file_id: str, size: int, filename: str, purpose: str) -> dict:
        """Write the file object beside its data (after it: an object always has its data)."""
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
               "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}
        write_atomic(self.dir / f"{file_id}.json", json.dumps(obj).encode())
        return obj

    def get(self, file_id: str) -> dict | None:
        if not _ID.match(file_id):
            return None
        try:
            return json.loads((self.dir / f"{file_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def data_path(self, file_id: str) -> Path | None:
        return self.dir / f"{file_id}.data" if self.get(file_id) is not None else None

    def list(self) -> list[dict]:
        out = [self.get(p.stem) for p in self.dir.glob("file-*.json")]
        return sorted((o for o in out if o is not None), key=lambda o: o["created_at"], reverse=True)

    def delete(self, file_id: str) -> bool:
        with self._lock:
            if self.get(file_id) is None:
                return False
            (self.dir / f"{file_id}.json").unlink(missing_ok=True)
            (self.dir / f"{file_id}.data").unlink(missing_ok=True)
            return True


# ---------------------------------------------------------------------------------------------- the routes

def list_files(ex) -> None:
    ex.send_json(200, {"object": "list", "data": ex.state.files.list(), "has_more": False})


def upload(ex) -> None:
    try:
        filename, data, purpose = parse_upload(ex.headers.get("Content-Type", ""), ex.read_body())
    except GoinferError as e:
        raise HTTPError(error_status(e), error_body(e)) from None
    ex.send_json(200, ex.state.files.add(filename, data, purpose))


def _found(ex, file_id: str) -> dict:
    found = ex.state.files.get(file_id)
    if found is None:
        raise not_found("file", file_id)
    return found


def get_file(ex, id: str) -> None:  # noqa: A002 - the route's parameter
    ex.send_json(200, _found(ex, id))


def delete_file(ex, id: str) -> None:  # noqa: A002
    _found(ex, id)
    ex.state.files.delete(id)
    ex.send_json(200, {"id": id, "object": "file", "deleted": True})


def file_content(ex, id: str) -> None:  # noqa: A002
    _found(ex, id)
    ex.send_body(200, ex.state.files.data_path(id).read_bytes(), "application/octet-stream")


# an upload has a body limit of its own, and needs no model: it is taken while the server loads
_UPLOAD = {"body_cap": lambda state: max(state.body_cap, UPLOAD_CAP), "waits_for_models": False}

ROUTES = (
    Route("GET", FILES_URL, list_files, **_UPLOAD),
    Route("POST", FILES_URL, upload, **_UPLOAD),
    Route("GET", FILES_URL + "/{id}", get_file),
    Route("DELETE", FILES_URL + "/{id}", delete_file),
    Route("GET", FILES_URL + "/{id}/content", file_content),
    Subtree(FILES_URL, lambda rest: not_found("file route", rest)),
)
