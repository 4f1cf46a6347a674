"""llama.cpp's POST /tokenize, /detokenize and /apply-template on the served model the body names (the wire
format's functions: engine/api/tokens.py)."""

from __future__ import annotations

from engine.api.openai_objects import error_body, error_status
from engine.api.tokens import apply_template, detokenize, tokenize
from engine.errors import GoinferError
from engine.server.intake import HTTPError
from engine.server.routes import Route, unknown_model

__all__ = ["ROUTES"]


def _on_model(work):
    """A route answering work(model, body, state) with the model the body names (optional with one served)."""
    def answer(ex) -> None:
        body = ex.json_body()
        try:
            name = body.get("model") if isinstance(body, dict) else None
            served = ex.state.route(name if isinstance(name, str) else None)
            if served is None:
                raise unknown_model(ex.state, name)
            ex.model_name = served.name
            result = work(served.model, body, ex.state)
        except GoinferError as e:
            raise HTTPError(error_status(e), error_body(e)) from None
        ex.send_json(200, result)
    return answer


ROUTES = (
    Route("POST", "/tokenize", _on_model(lambda model, body, state: tokenize(model, body))),
    Route("POST", "/detokenize", _on_model(lambda model, body, state: detokenize(model, body))),
    Route("POST", "/apply-template", _on_model(lambda model, body, state: apply_template(model, body,
                                                                                         state.thinking))),
)
