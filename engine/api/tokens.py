"""llama.cpp's utility routes, with its request and answer shapes (clients and web UIs built for llama-server
call them to count, show and render tokens), plus `model` to pick one of several served models:

    POST /tokenize        {"content", "add_special": false, "with_pieces": false} (parse_special: true only)
                          -> {"tokens": [ids]} or, with_pieces, [{"id", "piece"}] (piece: the text, or its bytes
                          as a list of ints where they are not whole UTF-8)
    POST /detokenize      {"tokens": [ids]} -> {"content"}
    POST /apply-template  {"messages", ...chat fields} -> {"prompt"}: the chat prompt exactly as a chat request with
                          the same body would render it (tools, thinking controls, an assistant prefill)

Pure functions over a Model; the server routes to them (engine/server/tokens.py).
"""

from __future__ import annotations

from typing import Any

from engine.api.fields import bool_field, is_int, kind_of, known_fields, object_body, str_field
from engine.api.openai import parse_chat_request
from engine.errors import RequestError
from engine.models.base import Model
from engine.requests.prompts import render_request
from engine.thinking.plan import ThinkingSettings

__all__ = ["apply_template", "detokenize", "tokenize"]

_TOKENIZE_FIELDS = {"model", "content", "add_special", "parse_special", "with_pieces"}


def tokenize(model: Model, body: Any) -> dict:
    body = object_body(body)
    known_fields(body, _TOKENIZE_FIELDS)
    content = str_field(body, "content")
    if content is None:
        raise RequestError("content: required (the text to tokenize)", "content", "missing_required_parameter")
    if not bool_field(body, "parse_special", True):
        raise RequestError("parse_special: false is not supported (special-token text is always parsed)",
                           "parse_special", "unsupported_parameter")
    tok = model.tokenizer
    # add_special: BOS (and EOS) as the model's own metadata says, as a prompt gets them; else none
    ids = tok.encode(content, add_bos=None, add_eos=None) if bool_field(body, "add_special", False) else \
        tok.encode(content, add_bos=False, add_eos=False)
    if not bool_field(body, "with_pieces", False):
        return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": _piece(tok.piece_bytes(i))} for i in ids]}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)  # part of a character (byte-level and byte-fallback tokens): the bytes, as llama.cpp


def detokenize(model: Model, body: Any) -> dict:
    body = object_body(body)
    known_fields(body, {"model", "tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise RequestError(f"tokens: must be an array of token ids, not {kind_of(ids)}", "tokens",
                           "invalid_type" if ids is not None else "missing_required_parameter")
    for k, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < model.vocab_size:
            raise RequestError(f"tokens[{k}]: {t!r} is not a token id of this model (0 to {model.vocab_size - 1})",
                               f"tokens[{k}]", "invalid_value")
    return {"content": model.tokenizer.decode(ids)}


def apply_template(model: Model, body: Any, settings: ThinkingSettings = ThinkingSettings()) -> dict:
    req = parse_chat_request(body)
    if model.template is None:
        raise RequestError(f"{model.name} has no chat template", "messages", "invalid_value")
    return {"prompt": render_request(model, req, settings).text}
