"""The Ollama API on the server: /api/chat and /api/generate (their dialect runs them through generating.py, as
every generation route), /api/embed and /api/embeddings, what Ollama's clients ask of the models (/api/tags,
/api/show, /api/ps, /api/version), and /api/pull and /api/delete (with --allow-admin: the admin loader's). Every
answer and error in Ollama's shape (engine/api/ollama*.py); the API key, where the server has one, as a Bearer
token (Ollama's clients send it that way).
"""

from __future__ import annotations

from engine.api.embeddings import embeddings_object
from engine.api.ollama import (CHAT_URL, EMBED_URL, EMBEDDINGS_URL, GENERATE_URL, loads_only, model_field, parse_embed,
                               parse_embeddings)
from engine.api.fields import bool_field, known_fields, object_body
from engine.api.ollama_answers import Ollama, error_body, line, load_answer
from engine.api.ollama_models import VERSION, ps_entry, show_object, tags_entry
from engine.api.openai_objects import error_status
from engine.api.openai_objects import error_body as openai_error_body
from engine.errors import GoinferError, RequestError
from engine.server import embedding, generating
from engine.server.intake import HTTPError
from engine.server.routes import Route, Subtree

__all__ = ["ROUTES"]

_UNLOAD = (0, "0", "0s", "0m")  # keep_alive values that ask Ollama to unload the model now


def _refused(e: GoinferError) -> HTTPError:
    return HTTPError(error_status(e), openai_error_body(e))


def _not_found(name) -> HTTPError:
    return HTTPError(404, error_body(f"model {name!r} not found"))


def answer(ex) -> None:
    """/api/chat and /api/generate: a request without a prompt only loads the model (done at once: goinfer keeps
    its models loaded); the others generate."""
    body = ex.json_body()
    if loads_only(ex.route.path, body):
        try:
            served = ex.state.route(model_field(body))
        except GoinferError as e:
            raise _refused(e) from None
        if served is None:
            raise _not_found(model_field(body))
        ex.send_json(200, load_answer(ex.route.path, served.name, unload=body.get("keep_alive") in _UNLOAD))
        return
    generating.generate(ex, body)


def _models(state) -> list[tuple[str, object, int, str]]:
    """(name, model, context window, kind) of every model served: generation, then embedding."""
    return ([(m.name, m.model, m.window, "generation") for m in state.models.values()]
            + [(m.name, m, m.context, "embedding") for m in state.embedders.values()])


def tags(ex) -> None:
    ex.send_json(200, {"models": [tags_entry(name, model, kind) for name, model, _, kind in _models(ex.state)]})


def ps(ex) -> None:
    ex.send_json(200, {"models": [ps_entry(name, model, ctx, kind) for name, model, ctx, kind in _models(ex.state)]})


def show(ex) -> None:
    try:
        name = model_field(ex.json_body())
    except GoinferError as e:
        raise _refused(e) from None
    for served, model, ctx, kind in _models(ex.state):
        if name == served:
            ex.send_json(200, show_object(served, model, ctx, kind))
            return
    raise _not_found(name)


def version(ex) -> None:
    ex.send_json(200, {"version": VERSION})


def _embed(ex, parse, answer_of) -> None:
    model, req, vectors, tokens = embedding.run(ex, parse)
    data = embeddings_object(model, req, vectors, tokens)["data"]  # (dimensions: cut and renormalised there)
    ex.send_json(200, answer_of(model.name, [d["embedding"] for d in data], tokens))


def embed(ex) -> None:
    _embed(ex, parse_embed, lambda name, vectors, tokens: {"model": name, "embeddings": vectors,
                                                           "prompt_eval_count": tokens})


def embeddings(ex) -> None:
    _embed(ex, parse_embeddings, lambda name, vectors, tokens: {"embedding": vectors[0]})


def pull(ex) -> None:
    """/api/pull {"model": REF}: with --allow-admin, the model fetched into goinfer's cache where it is not there
    yet and served under REF (`goinfer pull` and POST /admin/models/load). Streamed as Ollama's status lines unless
    `stream` is false. A model served under that name already is a success at once."""
    body = ex.json_body()
    try:
        body = object_body(body)
        known_fields(body, {"model", "name", "insecure", "stream"})
        name = model_field({"model": body.get("model") or body.get("name")})
        if not name:
            raise RequestError("model: required (a built-in name, hf:OWNER/REPO[:QUANT] or a path)", "model",
                               "missing_required_parameter")
        stream = bool_field(body, "stream", True)
    except GoinferError as e:
        raise _refused(e) from None
    admin = _admin(ex)
    if stream:
        ex.start_events({}, "application/x-ndjson")
        ex.send_events(line({"status": f"pulling {name}"}))
    try:
        if name not in ex.state.models:
            admin.load({"model": name, "name": name})
    except GoinferError as e:
        if not stream:
            raise HTTPError(400, error_body(str(e))) from None
        ex.send_events(line(error_body(str(e))))
    else:
        ex.model_name = name
        if not stream:
            ex.send_json(200, {"status": "success"})
            return
        ex.send_events(line({"status": "success"}))
    ex.write_chunk(b"")


def delete(ex) -> None:
    """/api/delete {"model": NAME}: with --allow-admin, the model is no longer served (POST /admin/models/unload).
    Its files stay in goinfer's cache (`goinfer cache rm NAME` removes them): they may be what another name or
    another server runs."""
    try:
        name = model_field(ex.json_body())
    except GoinferError as e:
        raise _refused(e) from None
    admin = _admin(ex)
    if name not in ex.state.models:
        raise _not_found(name)
    admin.unload({"name": name})
    ex.send_body(200, b"", "application/json")


def _admin(ex):
    if ex.state.admin is None:
        raise HTTPError(403, error_body("pulling and deleting models is off: `goinfer serve --allow-admin` turns it "
                                        "on (with an API key)"))
    return ex.state.admin


def _dialect(url: str):
    return lambda store: Ollama(url)


def _no_route(rest: str) -> HTTPError:
    return HTTPError(404, error_body(f"no Ollama route /api/{rest} (routes: /api/chat, /api/generate, /api/tags, "
                                     "/api/show, /api/ps, /api/embed, /api/embeddings, /api/version, /api/pull, "
                                     "/api/delete)"))


_EMBED_CAP = dict(body_cap=lambda state: state.embeddings_body_cap)
ROUTES = (
    Route("POST", CHAT_URL, answer, dialect=_dialect(CHAT_URL)),
    Route("POST", GENERATE_URL, answer, dialect=_dialect(GENERATE_URL)),
    Route("POST", EMBED_URL, embed, dialect=_dialect(EMBED_URL), **_EMBED_CAP),
    Route("POST", EMBEDDINGS_URL, embeddings, dialect=_dialect(EMBEDDINGS_URL), **_EMBED_CAP),
    Route("GET", "/api/tags", tags, dialect=_dialect("/api/tags")),
    Route("POST", "/api/show", show, dialect=_dialect("/api/show")),
    Route("GET", "/api/ps", ps, dialect=_dialect("/api/ps")),
    Route("GET", "/api/version", version, dialect=_dialect("/api/version")),
    Route("POST", "/api/pull", pull, dialect=_dialect("/api/pull")),
    Route("DELETE", "/api/delete", delete, dialect=_dialect("/api/delete")),
    Subtree("/api", _no_route),
)
