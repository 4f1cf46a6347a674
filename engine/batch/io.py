"""Batch files in the OpenAI Batch line format: reading the input, and the append-only output logs.

Input line:   {"custom_id": "a1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Output line:  {"id", "custom_id", "response": {"status_code": 200, "request_id", "body": {...}}, "error": null}
Error line:   {"id", "custom_id", "response": null, "error": {"code", "message"}}

Durability rule: a record is one write of one whole line, fsynced before the next request starts, so
after a crash the only damage is a final line without its newline; reopening cuts it off.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from engine.api.anthropic import MESSAGES_URL, parse_messages_request
from engine.api.decisions import DECISIONS_URL, DecisionInvalid, DecisionRequest, parse_decision_request
from engine.api.embeddings import EMBEDDINGS_URL, EmbeddingRequest, parse_embeddings_request
from engine.api.openai import URLS, parse_request
from engine.api.openai_objects import error_code
from engine.errors import BatchFileError, RequestError
from engine.files import fsync_dir, lock_exclusive
from engine.requests.request import GenerationRequest


@dataclass
class BatchLine:
    """One request line of the input; `request` when it can run, else `error` = (code, message)."""

    lineno: int  # 1-based line number in the input file
    custom_id: str | None
    url: str | None = None
    request: GenerationRequest | EmbeddingRequest | DecisionRequest | None = None
    error: tuple[str, str] | None = None

    @property
    def embeds(self) -> bool:
        """An embeddings line (run by the embedding model, not the chat model)."""
        return isinstance(self.request, EmbeddingRequest)

    @property
    def decides(self) -> bool:
        """A decisions line (/v1/systemone: label scoring on the chat model, nothing decoded)."""
        return isinstance(self.request, DecisionRequest)


def read_input(path: str | Path) -> list[BatchLine]:
    """Every request line of a batch input file, each parsed as far as it can be without a model.

    A malformed line becomes a BatchLine with `error` set (the run goes on). The file as a whole is
    refused (BatchFileError) when it cannot be read, holds no request, or repeats a custom_id."""
    lines = _read_lines(path)
    for _, message in _duplicates(lines):
        raise BatchFileError(f"{path}: {message}")
    return lines


def check_input(path: str | Path) -> list[tuple[int, str]]:
    """Every problem of a batch input file that shows without a model, as (line number, message) in line order:
    lines that are not JSON, not the Batch line shape, or whose body the run's parser refuses, and repeated
    custom_ids. Empty when every line can run. An unreadable or empty file raises BatchFileError, as in
    read_input; the checks are read_input's own, so a file this passes is one the run reads the same way."""
    lines = _read_lines(path)
    problems = [(ln.lineno, ln.error[1].removeprefix(f"line {ln.lineno}: ")) for ln in lines if ln.error]
    return sorted(problems + _duplicates(lines))


def _read_lines(path: str | Path) -> list[BatchLine]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BatchFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BatchFileError(f"{path}: is a directory, not a JSONL file") from None
    except OSError as e:
        raise BatchFileError(f"{path}: cannot read: {e.strerror}") from None
    lines = [_parse_line(n, text) for n, text in enumerate(raw.split(b"\n"), 1) if text.strip()]
    if not lines:
        raise BatchFileError(f"{path}: no requests (the file is empty)")
    return lines


def _duplicates(lines: list[BatchLine]) -> list[tuple[int, str]]:
    """(line number, message) for each line whose custom_id an earlier line has."""
    seen: dict[str, int] = {}
    found = []
    for line in lines:
        if line.custom_id is None:
            continue
        if line.custom_id in seen:
            found.append((line.lineno, f"duplicate custom_id {line.custom_id!r} on lines "
                                       f"{seen[line.custom_id]} and {line.lineno}"))
        else:
            seen[line.custom_id] = line.lineno
    return found


def _parse_line(lineno: int, raw: bytes) -> BatchLine:
    def bad(code: str, message: str, custom_id: str | None = None, url: str | None = None) -> BatchLine:
        return BatchLine(lineno, custom_id, url, error=(code, f"line {lineno}: {message}"))

    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return bad("invalid_json_line", "not valid UTF-8")
    except json.JSONDecodeError as e:
        return bad("invalid_json_line", f"not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return bad("invalid_json_line", "must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        what = "missing" if custom_id is None else "must be a non-empty string"
        return bad("missing_required_parameter", f"custom_id is {what}")
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method is None:
        return bad("missing_required_parameter", "method is missing", custom_id)
    if method != "POST":
        return bad("invalid_method", f"method {method!r} is not supported (only POST)", custom_id)
    if url is None:
        return bad("missing_required_parameter", "url is missing", custom_id)
    if url not in URLS and url not in (EMBEDDINGS_URL, DECISIONS_URL, MESSAGES_URL):
        return bad("invalid_url", f"url {url!r} is not supported (supported: {', '.join(URLS)}, {EMBEDDINGS_URL}, "
                                  f"{DECISIONS_URL}, {MESSAGES_URL})", custom_id)
    if body is None:
        return bad("missing_required_parameter", "body is missing", custom_id, url)
    try:
        request = parse_embeddings_request(body) if url == EMBEDDINGS_URL else parse_decision_request(body) \
            if url == DECISIONS_URL else parse_messages_request(body) if url == MESSAGES_URL \
            else parse_request(url, body)
        if getattr(request, "confidence", False):
            return bad("unsupported_parameter", "goinfer_confidence: not available in batches (the server's "
                                                "chat/completions and completions answer it)", custom_id, url)
        return BatchLine(lineno, custom_id, url, request=request)
    except DecisionInvalid as e:
        return bad("invalid_decision", str(e), custom_id, url)
    except RequestError as e:
        return bad(error_code(e), str(e), custom_id, url)
    except Exception as e:  # noqa: BLE001 - a parser bug: this line's error record, never the whole run's end
        return bad("internal_error", f"the body could not be read ({type(e).__name__}: {e})", custom_id, url)


def errors_path(output: str | Path) -> Path:
    """Where a run's failures go: out.jsonl -> out.errors.jsonl (other names get .errors.jsonl appended)."""
    output = Path(output)
    if output.suffix == ".jsonl":
        return output.with_suffix(".errors.jsonl")
    return output.with_name(output.name + ".errors.jsonl")


def success_record(custom_id: str, body: dict) -> dict:
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": "req_" + uuid.uuid4().hex, "body": body},
            "error": None}


def error_record(custom_id: str | None, code: str, message: str) -> dict:
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


class RecordLog:
    """A JSONL file appended to one fsynced record at a time.

    Opening it takes an exclusive lock (a second run on the same file is refused), cuts off a torn final
    line, and reads the custom_ids already recorded. `fresh=True` empties it instead."""

    def __init__(self, path: str | Path, fresh: bool = False):
        self.path = Path(path)
        self.count = 0
        self.custom_ids: set[str] = set()
        existed = self.path.exists()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except IsADirectoryError:
            raise BatchFileError(f"{self.path}: is a directory") from None
        except OSError as e:
            raise BatchFileError(f"cannot write {self.path}: {e.strerror}") from None
        try:
            self._lock()
            if fresh:
                os.ftruncate(self._fd, 0)
            else:
                self._recover()
            if not existed:
                fsync_dir(self.path.parent)  # the new file's name must survive a power cut too
        except BaseException:
            os.close(self._fd)
            raise

    def _lock(self) -> None:
        # Windows has no advisory locks: two runs on one output file are then the user's lookout.
        if not lock_exclusive(self._fd, blocking=False):
            raise BatchFileError(f"{self.path}: another goinfer batch is writing this file")

    def _recover(self) -> None:
        with open(self._fd, "rb", closefd=False) as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # the process died while writing the last line: cut it, it will be redone
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)
        for n, line in enumerate(data[:end].split(b"\n")[:-1], 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str):
                raise BatchFileError(f"{self.path}: line {n} is not a batch output record; "
                                     "is this the right output file?")
            self.custom_ids.add(record["custom_id"])
            self.count += 1

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:  # one write for a whole line in practice; the loop only covers a short write
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)
        self.count += 1
        if isinstance(record.get("custom_id"), str):
            self.custom_ids.add(record["custom_id"])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing releases the lock
            self._fd = -1
