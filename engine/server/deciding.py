"""POST /v1/systemone on the server: a decisions request answered by label scoring on a served model.

The handler thread runs the prefills itself (nothing is decoded, so the scheduler's decode loop has no part in it);
its kernels take turns with the scheduler's through the process-wide compute lock, chunk by chunk. A model's
decisions run one at a time, and at most --max-queue wait behind it (a 429 beyond, as generation does).
"""

from __future__ import annotations

import threading

from engine.api.decisions import DECISIONS_URL, DecisionInvalid, decision_object, parse_decision_request
from engine.api.openai_objects import error_body, error_object, error_status
from engine.decisions.scoring import score_request
from engine.errors import GoinferError
from engine.server.intake import HTTPError
from engine.server.routes import Route

__all__ = ["DecisionDesk", "ROUTES"]


class DecisionDesk:
    def __init__(self, state, template: str, max_queue: int, temperatures: dict | None = None):
        self.state, self.template, self.max_queue = state, template, max_queue
        # per model, per kind: the fitted temperatures of --decisions-calibration (a kind without one: T = 1)
        self.temperatures: dict[str, dict[str, float]] = {name: dict((temperatures or {}).get(name, {}))
                                                          for name in state.models}
        self._turns = {name: threading.Lock() for name in state.models}
        self._waiting = {name: 0 for name in state.models}
        self._lock = threading.Lock()

    def add_model(self, name: str) -> None:
        """A model loaded at runtime answers decisions too (uncalibrated)."""
        with self._lock:
            self.temperatures.setdefault(name, {})
            self._turns.setdefault(name, threading.Lock())
            self._waiting.setdefault(name, 0)

    def answer(self, body) -> tuple[str, dict, int]:
        """(model name, response body, input tokens) for a parsed JSON body; HTTPError for every refusal."""
        try:
            req = parse_decision_request(body)
        except DecisionInvalid as e:
            raise HTTPError(422, e.body()) from None
        served = self.state.models.get(req.model) if req.model is not None else (
            next(iter(self.state.models.values())) if len(self.state.models) == 1 else None)
        if served is None:
            names = ", ".join(self.state.models) or "none: this server has no generation model"
            if req.model is None:
                raise HTTPError(400, error_object(f"model: required when several models are served ({names})",
                                                  "invalid_request_error", "model", "missing_required_parameter"))
            raise HTTPError(404, error_object(f"model {req.model!r} is not served here (decisions are answered by: "
                                              f"{names})", "invalid_request_error", "model", "model_not_found"))
        with self._lock:
            if self._waiting[served.name] > self.max_queue:
                raise HTTPError(429, error_object(f"{served.name} is busy: {self._waiting[served.name]} decisions "
                                                  f"are waiting (--max-queue {self.max_queue}); retry after 1 s",
                                                  "rate_limit_error", None, "queue_full"), {"Retry-After": "1"})
            self._waiting[served.name] += 1
        try:
            with self._turns[served.name]:
                scored = score_request(served.model, req, self.template,
                                       temperatures=self.temperatures[served.name], window=served.window)
        except GoinferError as e:
            raise HTTPError(error_status(e), error_body(e)) from None
        finally:
            with self._lock:
                self._waiting[served.name] -= 1
        calibrated = {kind: kind in self.temperatures[served.name] for kind in ("noul", "choice", "score")}
        return served.name, decision_object(req, scored.probabilities, model_name=served.name,
                                            input_tokens=scored.input_tokens, template=self.template,
                                            calibrated=calibrated), scored.input_tokens


def decide(ex) -> None:
    ex.model_name, answer, tokens = ex.state.decisions.answer(ex.json_body())
    ex.usage = (tokens, 0)
    ex.send_json(200, answer)


ROUTES = (Route("POST", DECISIONS_URL, decide),)
