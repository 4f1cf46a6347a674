"""The OpenAI wire format's answers: chat.completion and text_completion objects (with logprobs and usage),
/v1/models entries, and the error objects every route answers with (OpenAI's shape; the Anthropic routes
translate them), and llama.cpp's per-token probabilities (its post_sampling_probs on these routes, and
/completion's completion_probabilities). Pure functions."""

from __future__ import annotations

import math
import time
import uuid

from engine.errors import ContextOverflow, GoinferError, InvalidRequest, RequestError, TemplateError
from engine.requests.request import Completion, GenerationRequest, TokenLogprob


def chat_completion(result: Completion, *, model_name: str, request_id: str | None = None,
                    created: int | None = None, with_logprobs: bool = False, post_sampling: bool = False) -> dict:
    """The chat.completion object for one result (one choice per answer)."""
    return {
        "id": request_id or new_id("chat"),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model_name,
        "choices": [{"index": i, "message": _message(c),
                     "logprobs": chat_logprobs(c.logprobs or [], post_sampling) if with_logprobs else None,
                     "finish_reason": c.finish_reason} for i, c in enumerate(result.choices)],
        "usage": usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens,
                       sum(c.reasoning_tokens for c in result.choices)),
    }


def _message(c) -> dict:
    msg = {"role": "assistant", "content": c.text, "refusal": None}
    if c.reasoning:  # a thinking model's reasoning, apart from the answer (llama.cpp's and DeepSeek's field)
        msg["reasoning_content"] = c.reasoning
    if c.tool_calls:
        msg["content"] = c.text or None
        msg["tool_calls"] = [tool_call_object(t) for t in c.tool_calls]
    return msg


def tool_call_object(t) -> dict:
    return {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}


def text_completion(result: Completion, *, model_name: str, request_id: str | None = None,
                    created: int | None = None, with_logprobs: bool = False, post_sampling: bool = False) -> dict:
    """The text_completion object (legacy /v1/completions) for one result."""
    return {
        "id": request_id or new_id("completion"),
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model_name,
        "choices": [{"text": c.text, "index": i,
                     "logprobs": completion_logprobs(c.logprobs or [], post_sampling) if with_logprobs else None,
                     "finish_reason": c.finish_reason} for i, c in enumerate(result.choices)],
        "usage": usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens),
    }


def response_object(req: GenerationRequest, result: Completion, *, model_name: str,
                    request_id: str | None = None, created: int | None = None) -> dict:
    """The object the endpoint `req` came from answers with."""
    build = chat_completion if req.kind == "chat" else text_completion
    obj = build(result, model_name=model_name, request_id=request_id, created=created, with_logprobs=req.logprobs,
                post_sampling=req.post_sampling_probs)
    if result.confidence is not None:
        obj["goinfer_confidence"] = result.confidence
    return obj


def new_id(kind: str) -> str:
    """A fresh response id: chatcmpl-... for chats, cmpl-... for completions."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens a warm session held (engine/sessions/pool.py);
    reasoning_tokens: of the completion tokens, those a thinking model spent inside its block."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _token_str(piece: bytes) -> str:
    # A token that holds part of a UTF-8 character shows its bytes escaped (\xe2), as OpenAI does.
    return piece.decode("utf-8", errors="backslashreplace")


def chat_logprobs(tokens: list[TokenLogprob], post_sampling: bool = False) -> dict:
    """A chat choice's `logprobs` for these tokens (a whole answer, or one stream chunk's share); post_sampling:
    llama.cpp's entries with the drawn-from probabilities ("prob", "top_probs"), as llama-server sends them."""
    if post_sampling:
        return {"content": llamacpp_probabilities(tokens, True), "refusal": None}
    return {"content": [{"token": _token_str(t.piece), "logprob": t.logprob, "bytes": list(t.piece),
                         "top_logprobs": [{"token": _token_str(p), "logprob": lp, "bytes": list(p)}
                                          for _, p, lp in t.top]} for t in tokens],
            "refusal": None}


def completion_logprobs(tokens: list[TokenLogprob], post_sampling: bool = False) -> dict:
    """A completion choice's `logprobs` (the legacy parallel arrays) for these tokens; post_sampling: llama.cpp's
    entries instead, as llama-server sends them."""
    if post_sampling:
        return {"content": llamacpp_probabilities(tokens, True)}
    return {"tokens": [_token_str(t.piece) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.logprob is None else {_token_str(p): lp for _, p, lp in t.top} for t in tokens],
            "text_offset": [t.offset for t in tokens]}


LOG_ZERO = -3.4028234663852886e38  # llama.cpp's log of a probability of 0 (float's lowest: JSON has no -inf)


def llamacpp_probabilities(tokens: list[TokenLogprob], post_sampling: bool) -> list[dict]:
    """llama.cpp's per-token entries: {"id", "token", "bytes", "logprob", "top_logprobs": [{"id", "token",
    "bytes", "logprob"}]}; post_sampling: "prob" and "top_probs" (probabilities after the samplers) instead."""
    key, top_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def entry(token: int, piece: bytes, lp: float | None) -> dict:
        value = None if lp is None else math.exp(lp) if post_sampling else max(lp, LOG_ZERO)
        return {"id": token, "token": piece.decode("utf-8", errors="ignore"), "bytes": list(piece), key: value}

    return [{**entry(t.token, t.piece, t.logprob), top_key: [entry(i, p, lp) for i, p, lp in t.top]} for t in tokens]


def model_object(name: str, *, created: int, context_window: int) -> dict:
    """One /v1/models entry; `context_window` is the token limit requests to this model are held to."""
    return {"id": name, "object": "model", "created": created, "owned_by": "goinfer",
            "context_window": context_window}


def model_list(entries: list[dict]) -> dict:
    return {"object": "list", "data": entries}


def error_code(exc: BaseException) -> str:
    """The machine-readable code for an error raised while parsing or running a request."""
    if isinstance(exc, RequestError):
        return exc.code
    if isinstance(exc, ContextOverflow):
        return "context_length_exceeded"
    if isinstance(exc, TemplateError):
        return "template_error"
    if isinstance(exc, InvalidRequest):
        return "invalid_value"
    if isinstance(exc, GoinferError):
        return "engine_error"
    return "internal_error"


def _client_fault(exc: BaseException) -> bool:
    return isinstance(exc, (InvalidRequest, ContextOverflow, TemplateError))


def error_body(exc: BaseException) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return error_object(str(exc), "invalid_request_error" if _client_fault(exc) else "server_error",
                        getattr(exc, "param", None), error_code(exc))


def error_status(exc: BaseException) -> int:
    """The HTTP status an error raised while parsing or running a request is answered with."""
    return 400 if _client_fault(exc) else 500


def error_object(message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict:
    """{"error": {...}} for errors that do not come from an exception (unknown model, auth, limits)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
