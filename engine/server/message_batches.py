"""Anthropic's Message Batches API, as its SDK calls it, over the server's batches (batches.py): the requests
arrive inline, are kept as a batch input file, and run like an OpenAI batch of `/v1/messages` lines.

    POST   /v1/messages/batches               {"requests": [{"custom_id", "params": {...a Messages body}}]}
    GET    /v1/messages/batches               {"data": [...], "has_more", "first_id", "last_id"}
    GET    /v1/messages/batches/{id}          processing_status, request_counts, results_url once ended
    GET    /v1/messages/batches/{id}/results  JSONL, one per request: succeeded (the message), errored or canceled
    POST   /v1/messages/batches/{id}/cancel
    DELETE /v1/messages/batches/{id}          an ended batch and its results

A batch runs on one served model (every request names it, or none with one model served), as goinfer runs a batch.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

from engine.api import anthropic
from engine.api.anthropic import MESSAGES_URL
from engine.api.fields import known_fields
from engine.api.openai_objects import error_status
from engine.errors import GoinferError, RequestError
from engine.server.intake import HTTPError
from engine.server.routes import Route, Subtree

__all__ = ["MESSAGE_BATCHES_URL", "PREFIX", "ROUTES", "create", "message_batch", "results"]

MESSAGE_BATCHES_URL = "/v1/messages/batches"
PREFIX = "msgbatch_"
MAX_REQUESTS = 100_000  # Anthropic's limit
_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def create(runner, body) -> dict:
    """Queue the inline requests as a batch (RequestError names what is wrong); the batch's record."""
    if not isinstance(body, dict) or not isinstance(body.get("requests"), list) or not body["requests"]:
        raise RequestError("requests: required, a non-empty array of {custom_id, params}", "requests",
                           "invalid_request")
    known_fields(body, {"requests"})
    requests = body["requests"]
    if len(requests) > MAX_REQUESTS:
        raise RequestError(f"requests: at most {MAX_REQUESTS} (got {len(requests)})", "requests", "invalid_request")
    seen, lines = set(), []
    for i, item in enumerate(requests):
        at = f"requests[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("params"), dict):
            raise RequestError(f"{at}: must be {{\"custom_id\", \"params\": {{...}}}}", at, "invalid_request")
        cid = item.get("custom_id")
        if not isinstance(cid, str) or not _CUSTOM_ID.match(cid):
            raise RequestError(f"{at}.custom_id: 1 to 64 letters, digits, _ or -", f"{at}.custom_id",
                               "invalid_request")
        if cid in seen:
            raise RequestError(f"{at}.custom_id: {cid!r} is used twice", f"{at}.custom_id", "invalid_request")
        seen.add(cid)
        lines.append(json.dumps({"custom_id": cid, "method": "POST", "url": MESSAGES_URL, "body": item["params"]}))
    data = ("\n".join(lines) + "\n").encode()
    file_id = runner.files.add("message_batch_requests.jsonl", data, "batch")["id"]
    return runner.start(file_id, MESSAGES_URL, prefix=PREFIX)


def _time(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def message_batch(batch: dict, root: str) -> dict:
    """Anthropic's MessageBatch for a batch record; `root` is the server's base URL (for results_url)."""
    status = batch["status"]
    ended = status in ("completed", "cancelled", "failed", "expired")
    counts = batch["request_counts"]
    left = counts["total"] - counts["completed"] - counts["failed"]
    ended_at = next((batch.get(f"{s}_at") for s in ("completed", "cancelled", "failed") if batch.get(f"{s}_at")),
                    None)
    return {"id": batch["id"], "type": "message_batch",
            "processing_status": "ended" if ended else "canceling" if status == "cancelling" else "in_progress",
            "request_counts": {"processing": 0 if ended else left, "succeeded": counts["completed"],
                               "errored": counts["failed"], "canceled": left if ended else 0, "expired": 0},
            "created_at": _time(batch["created_at"]), "expires_at": _time(batch["expires_at"]),
            "ended_at": _time(ended_at) if ended else None, "archived_at": None,
            "cancel_initiated_at": _time(batch.get("cancelling_at")),
            "results_url": f"{root}{MESSAGE_BATCHES_URL}/{batch['id']}/results" if ended else None}


def results(batch: dict, files) -> bytes:
    """The results JSONL of an ended batch: one line per request, in the order they came."""
    outcome: dict[str, dict] = {}
    for key in ("output_file_id", "error_file_id"):
        path = files.data_path(batch[key]) if batch.get(key) else None
        for raw in path.read_bytes().splitlines() if path is not None else ():
            record = json.loads(raw)
            if record.get("response") is not None:
                outcome[record["custom_id"]] = {"type": "succeeded", "message": record["response"]["body"]}
            else:
                outcome[record["custom_id"]] = {"type": "errored", "error": {"type": "error", "error": {
                    "type": "invalid_request_error", "message": record["error"]["message"]}}}
    order = [json.loads(x)["custom_id"] for x in files.data_path(batch["input_file_id"]).read_bytes().splitlines()
             if x.strip()]
    return b"".join(json.dumps({"custom_id": cid, "result": outcome.get(cid, {"type": "canceled"})}).encode() + b"\n"
                    for cid in order)


# ---------------------------------------------------------------------------------------------- the routes
# Their errors take Anthropic's shape, as its SDK reads them.

def _refuse(status: int, message: str) -> HTTPError:
    return HTTPError(status, anthropic.error_body(status, message))


def _batch(ex, batch_id: str) -> dict:
    batch = ex.state.batches.get(batch_id)
    if batch is None:
        raise _refuse(404, f"no message batch {batch_id!r}")
    return batch


def create_batch(ex) -> None:
    try:
        batch = create(ex.state.batches, ex.json_body())
    except GoinferError as e:
        raise _refuse(error_status(e), str(e)) from None
    ex.send_json(200, message_batch(batch, ex.root_url()))


def list_batches(ex) -> None:
    root = ex.root_url()
    data = [message_batch(b, root) for b in ex.state.batches.list(PREFIX)]
    ex.send_json(200, {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                       "last_id": data[-1]["id"] if data else None})


def get_batch(ex, id: str) -> None:  # noqa: A002 - the route's parameter
    ex.send_json(200, message_batch(_batch(ex, id), ex.root_url()))


def delete_batch(ex, id: str) -> None:  # noqa: A002
    _batch(ex, id)
    if not ex.state.batches.delete(id):
        raise _refuse(400, f"message batch {id} is still running: cancel it first")
    ex.send_json(200, {"id": id, "type": "message_batch_deleted"})


def cancel_batch(ex, id: str) -> None:  # noqa: A002
    _batch(ex, id)
    ex.send_json(200, message_batch(ex.state.batches.cancel(id), ex.root_url()))


def batch_results(ex, id: str) -> None:  # noqa: A002
    batch = _batch(ex, id)
    if message_batch(batch, ex.root_url())["processing_status"] != "ended":
        raise _refuse(400, f"message batch {id} has not ended yet: its results come once it has")
    ex.send_body(200, results(batch, ex.state.batches.files), "application/x-jsonl")


_ONE = MESSAGE_BATCHES_URL + "/{id:" + PREFIX + "[^/]*}"  # an id of another kind is no route of this API

ROUTES = (
    Route("GET", MESSAGE_BATCHES_URL, list_batches),
    Route("POST", MESSAGE_BATCHES_URL, create_batch),
    Route("GET", _ONE, get_batch),
    Route("DELETE", _ONE, delete_batch),
    Route("POST", _ONE + "/cancel", cancel_batch),
    Route("GET", _ONE + "/results", batch_results),
    Subtree(MESSAGE_BATCHES_URL, lambda rest: _refuse(404, f"no message batch route {rest!r}")),
)
