"""POST /v1/embeddings on the server: the inputs' vectors, from the embedding model's queue (concurrent requests
share forward passes; they take turns with the generation models' computations)."""

from __future__ import annotations

from engine.api.embeddings import EMBEDDINGS_URL, embeddings_object, parse_embeddings_request, token_lists
from engine.api.openai_objects import error_body, error_object, error_status
from engine.errors import GoinferError
from engine.server.intake import HTTPError
from engine.server.routes import Route

__all__ = ["ROUTES", "run"]


def embed(ex) -> None:
    model, req, vectors, tokens = run(ex, parse_embeddings_request)
    ex.send_json(200, embeddings_object(model, req, vectors, tokens))


def run(ex, parse):
    """The body read by `parse` (OpenAI's, Ollama's) and embedded on its model's queue:
    (model, request, vectors, prompt tokens); refusals as HTTPErrors (OpenAI's shape: a route's dialect restates
    them)."""
    state = ex.state
    try:
        req = parse(ex.json_body())
        model = state.embedder(req.model)
        if model is None:
            served = ", ".join(state.embedders) or "none"
            raise HTTPError(404, error_object(f"model {req.model!r} is not an embedding model served here "
                                              f"(embedding models: {served})", "invalid_request_error", "model",
                                              "model_not_found"))
        ex.model_name = model.name
        lists = token_lists(model, req)
        vectors = state.embed_queues[model.name].embed(lists)
    except GoinferError as e:
        raise HTTPError(error_status(e), error_body(e)) from None
    tokens = sum(len(ids) for ids in lists)
    ex.usage = (tokens, 0)
    return model, req, vectors, tokens


# vectors of many long inputs: a body limit of its own (config.embeddings_body_cap)
ROUTES = (Route("POST", EMBEDDINGS_URL, embed, body_cap=lambda state: state.embeddings_body_cap),)
