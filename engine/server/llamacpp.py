"""llama.cpp's native routes on the server: POST /completion (its dialect runs it through generating.py), GET /props
and GET /slots (read-only), for the clients written for llama-server. `?model=NAME` picks the model /props and
/slots describe where several are served (llama-server's router does the same)."""

from __future__ import annotations

from importlib import metadata
from urllib.parse import parse_qs, urlsplit

from engine.api.llamacpp import COMPLETION_URL, LlamaCppCompletion, props_object, slots_object
from engine.api.openai_objects import error_body, error_status
from engine.errors import GoinferError
from engine.server import generating
from engine.server.intake import HTTPError
from engine.server.routes import Route, unknown_model

__all__ = ["ROUTES"]


def _served(ex):
    """The model the query names (`?model=`), or the only one."""
    name = parse_qs(urlsplit(ex.handler.path).query).get("model", [None])[0]
    try:
        served = ex.state.route(name)
    except GoinferError as e:
        raise HTTPError(error_status(e), error_body(e)) from None
    if served is None:
        raise unknown_model(ex.state, name)
    return served


def _version() -> str:
    try:
        return metadata.version("goinfer")
    except metadata.PackageNotFoundError:
        return "unknown"


def props(ex) -> None:
    served = _served(ex)
    ex.send_json(200, props_object(served.name, served.model, served.window, ex.state.max_concurrent, _version()))


def slots(ex) -> None:
    served = _served(ex)
    busy = ex.state.schedulers[served.name].health()["running_sequences"]
    ex.send_json(200, slots_object(served.window, ex.state.max_concurrent, busy))


ROUTES = (
    Route("POST", COMPLETION_URL, generating.generate, dialect=lambda store: LlamaCppCompletion()),
    Route("GET", "/props", props),
    Route("GET", "/slots", slots),
)
