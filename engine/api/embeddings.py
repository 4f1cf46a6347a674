"""The OpenAI embeddings wire format: /v1/embeddings bodies -> EmbeddingRequest, vectors -> the list object.

    parse_embeddings_request(body)              every refusal a RequestError naming the field
    token_lists(model, req)                     the inputs as token ids, each checked against the model
    embeddings_object(model, req, vectors, n)   {"object": "list", "data": [...], "model", "usage"}

Pure functions over an EmbeddingModel (engine/embeddings/); `goinfer serve` and `goinfer batch` share them.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from engine.api.fields import int_field, is_int, kind_of, object_body, str_field
from engine.errors import RequestError

__all__ = ["EMBEDDINGS_URL", "MAX_INPUTS", "EmbeddingRequest", "embeddings_object", "parse_embeddings_request",
           "token_lists"]

EMBEDDINGS_URL = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "input_type"}


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: tuple  # each a text (str) or token ids (tuple of ints)
    model: str | None = None
    encoding_format: str = "float"  # float | base64 (little-endian float32 bytes)
    dimensions: int | None = None  # a shorter vector: the first `dimensions` components, renormalised
    input_type: str | None = None  # query | document (models with instruction prefixes)


def parse_embeddings_request(body) -> EmbeddingRequest:
    body = object_body(body)
    unknown = sorted(k for k in body if k not in _FIELDS)
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown parameter", unknown[0], "unsupported_parameter")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise RequestError(f"encoding_format: must be float or base64 (got {fmt!r})", "encoding_format",
                           "invalid_value")
    input_type = body.get("input_type")
    if input_type is not None and input_type not in ("query", "document"):
        raise RequestError(f"input_type: must be query or document (got {input_type!r})", "input_type",
                           "invalid_value")
    return EmbeddingRequest(_inputs(body.get("input")), str_field(body, "model"), fmt,
                            int_field(body, "dimensions", 1), input_type)


def _inputs(value) -> tuple:
    if value is None:
        raise RequestError("input: required", "input", "missing_required_parameter")
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        items = [value]  # one input given as token ids
    elif isinstance(value, list):
        items = value
    else:
        raise RequestError(f"input: must be a string, an array of strings, an array of token ids or an array of "
                           f"token-id arrays, not {kind_of(value)}", "input", "invalid_type")
    if not items:
        raise RequestError("input: must not be empty", "input", "invalid_value")
    if len(items) > MAX_INPUTS:
        raise RequestError(f"input: at most {MAX_INPUTS} inputs per request (got {len(items)})", "input",
                           "invalid_value")
    out = []
    for i, item in enumerate(items):
        at = "input" if isinstance(value, str) or items is not value else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise RequestError(f"{at}: must not be an empty string", at, "invalid_value")
            out.append(item)
        elif isinstance(item, list) and item and all(is_int(t) for t in item):
            out.append(tuple(int(t) for t in item))
        else:
            raise RequestError(f"{at}: must be a non-empty string or a non-empty array of token ids", at,
                               "invalid_value")
    return tuple(out)


def token_lists(model, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids (texts tokenized; ids checked against the vocabulary); any input over the model's
    context is refused, never cut."""
    if req.dimensions is not None and req.dimensions > model.dimension:
        raise RequestError(f"dimensions: at most {model.dimension} for {model.name} (got {req.dimensions})",
                           "dimensions", "invalid_value")
    prefix = model.prefix(req.input_type)  # a model with instruction prefixes: the query's or document's
    texts = [prefix + x for x in req.inputs if isinstance(x, str)]
    tokenized = iter(model.tokenize(texts) if texts else [])
    single = len(req.inputs) == 1
    out = []
    for i, item in enumerate(req.inputs):
        at = "input" if single else f"input[{i}]"
        ids = next(tokenized) if isinstance(item, str) else list(item)
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise RequestError(f"{at}: token id {bad[0]} is outside the vocabulary of {model.vocab_size}", at,
                               "invalid_value")
        if len(ids) > model.context:
            raise RequestError(f"{at}: {len(ids)} tokens, over {model.name}'s context of {model.context}", at,
                               "context_length_exceeded")
        out.append(ids)
    return out


def embeddings_object(model, req: EmbeddingRequest, vectors: np.ndarray, prompt_tokens: int) -> dict:
    if req.dimensions is not None and req.dimensions < vectors.shape[1]:
        vectors = vectors[:, :req.dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model.name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
