"""GET /health and GET /v1/models[/{id}]: what the server says of itself and of the models it serves."""

from __future__ import annotations

from engine.api.openai_objects import model_list
from engine.server.routes import Route, unknown_model

__all__ = ["ROUTES"]


def health(ex) -> None:
    report = ex.state.health()  # 503 while loading (loading.py) or closing: not ready for requests
    ex.send_json(200 if report["status"] == "ok" else 503, report)


def models(ex) -> None:
    ex.send_json(200, {**model_list(list(ex.state.model_entries().values())), "models": ex.state.typesafe_models()})


def model(ex, id: str) -> None:  # noqa: A002 - the route's parameter
    entry = ex.state.model_entries().get(id)
    if entry is None:
        raise unknown_model(ex.state, id)
    ex.send_json(200, entry)


ROUTES = (
    Route("GET", "/health", health),
    Route("GET", "/v1/models", models),
    Route("GET", "/v1/models/{id:.*}", model),  # a model's name may hold slashes
)
