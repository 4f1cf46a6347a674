"""Models loaded and unloaded while the server runs (`serve --allow-admin`, which needs an API key: a request
that can load a model can read the disk and fill the memory).

    GET  /admin/models             the served generation models: name, path, context window, placement, busy
    POST /admin/models/load        {"model": REF, "name"?, "ctx"?, "quant"?}: loaded (the request waits), then
                                   served; 200 with its /v1/models entry. A taken name is a 409.
    POST /admin/models/unload      {"name"}: no new request reaches it at once; those running may finish within
                                   --unload-drain-wait seconds (200, "drained": true), then the rest is cancelled
                                   (202, "drained": false); its memory goes with the last reference.

Loading runs one at a time (two loads at once would each take the memory check's free memory for theirs).
"""

from __future__ import annotations

import threading
import time

from engine.api.fields import float_field, int_field, known_fields, object_body, str_field
from engine.api.openai_objects import error_body, error_status
from engine.errors import GoinferError, RequestError
from engine.server.config import ServedModel
from engine.server.intake import HTTPError
from engine.server.routes import Route, Subtree, not_found

__all__ = ["ADMIN_URL", "ModelAdmin", "ROUTES"]

ADMIN_URL = "/admin/models"
DEFAULT_DRAIN_S = 5.0


class ModelAdmin:
    def __init__(self, state, *, drain_s: float = DEFAULT_DRAIN_S, load=None):
        from engine.loading.load import load_model

        self.state, self.drain_s = state, drain_s
        self._load = load or load_model
        self._loading = threading.Lock()

    def list(self) -> dict:
        models = []
        for name, served in list(self.state.models.items()):
            health = self.state.schedulers[name].health()
            models.append({"name": name, "path": str(served.model.path), "context_window": served.window,
                           "placement": served.model.placement, "running_requests": health["running_requests"],
                           "queued": health["queued"]})
        return {"object": "list", "data": models}

    def load(self, body) -> dict:
        body = object_body(body)
        known_fields(body, {"model", "name", "ctx", "quant", "lora", "lora_scale"})
        ref = str_field(body, "model")
        if not ref:
            raise RequestError("model: required (a .gguf path, a directory, a built-in name or hf:...)", "model",
                               "missing_required_parameter")
        ctx = int_field(body, "ctx", 16)
        quant = str_field(body, "quant") or "auto"
        lora, scale = str_field(body, "lora"), float_field(body, "lora_scale", -100.0, 100.0)
        if scale is not None and lora is None:
            raise RequestError("lora_scale: goes with lora (a PEFT adapter directory)", "lora_scale",
                               "invalid_value")
        adapters = [(lora, 1.0 if scale is None else scale)] if lora else []
        with self._loading:
            name = str_field(body, "name")
            if name is not None and (name in self.state.models or name in self.state.embedders):
                raise RequestError(f"name: {name!r} is already served", "name", "conflict")
            try:
                model = self._load(ref, quant=quant, selftest=False, context=ctx, lora=adapters)
            except GoinferError as e:  # a missing file, a family not run, too little memory, a bad adapter
                field = "lora" if str(e).startswith("--lora ") else "model"
                raise RequestError(f"{field}: {str(e).removeprefix('--lora ')}", field, "invalid_model") from None
            # an adapted model is not the base: not under the base's name unless named so
            name = name or "+".join([model.name] + [a["adapter"] for a in model.adapters])
            if name in self.state.models or name in self.state.embedders:
                raise RequestError(f"name: {name!r} is already served (name this one)", "name", "conflict")
            served = ServedModel.of(name, model, ctx or self.state.default_ctx)
            self.state.add_model(served)
        self.state.log(f"admin: loaded {name} from {ref}")
        return self.state.model_entries()[name]

    def unload(self, body) -> tuple[int, dict]:
        body = object_body(body)
        name = str_field(body, "name")
        if not name:
            raise RequestError("name: required (a served model's name)", "name", "missing_required_parameter")
        scheduler = self.state.remove_model(name)  # no new request reaches it from here on
        if scheduler is None:
            raise RequestError(f"name: {name!r} is not served here", "name", "model_not_found")
        deadline = time.monotonic() + self.drain_s
        while time.monotonic() < deadline:
            health = scheduler.health()
            if not health["running_requests"] and not health["queued"]:
                break
            time.sleep(0.05)
        drained = not (scheduler.health()["running_requests"] or scheduler.health()["queued"])
        scheduler.close(f"{name} was unloaded")
        self.state.forget_scheduler(name)
        self.state.log(f"admin: unloaded {name}" + ("" if drained else " (its running requests were cancelled)"))
        return (200 if drained else 202), {"name": name, "unloaded": True, "drained": drained}


# ---------------------------------------------------------------------------------------------- the routes

def _refusal(e: GoinferError) -> HTTPError:
    status = {"conflict": 409, "model_not_found": 404}.get(getattr(e, "code", None), error_status(e))
    return HTTPError(status, error_body(e))


def list_models(ex) -> None:
    ex.send_json(200, ex.state.admin.list())


def load(ex) -> None:
    try:
        body = ex.json_body()
        ex.model_name = body.get("name") if isinstance(body, dict) else None
        ex.send_json(200, ex.state.admin.load(body))
    except GoinferError as e:
        raise _refusal(e) from None


def unload(ex) -> None:
    try:
        status, answer = ex.state.admin.unload(ex.json_body())
    except GoinferError as e:
        raise _refusal(e) from None
    ex.send_json(status, answer)


def _enabled(state) -> bool:
    return state.admin is not None  # serve --allow-admin


ROUTES = (
    Route("GET", ADMIN_URL, list_models, when=_enabled),
    Route("POST", ADMIN_URL + "/load", load, when=_enabled),
    Route("POST", ADMIN_URL + "/unload", unload, when=_enabled),
    Subtree(ADMIN_URL, lambda rest: not_found("admin route", rest), when=_enabled),
)
