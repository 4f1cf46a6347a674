"""Ollama's wire format, its requests: /api/chat and /api/generate bodies -> GenerationRequest, /api/embed and
/api/embeddings bodies -> EmbeddingRequest.

    parse_chat(body) / parse_generate(body)      every refusal a RequestError naming Ollama's field
    parse_embed(body) / parse_embeddings(body)
    loads_only(url, body)                        an empty prompt: Ollama's "load the model" request

A body is read into the OpenAI body that means the same (messages, sampling, format, tools, thinking) and then
through openai.py's parser, so a request means one thing whichever format it came in. Ollama's own server ignores
fields it does not know; goinfer refuses them (400, naming the field), except the ones Ollama documents: its loader
and runtime options (num_gpu, num_thread, use_mmap, num_ctx, ...) are accepted and change nothing here (the server's
flags decide them), llama.cpp's samplers (typical_p, mirostat) run as on the OpenAI routes, and tail-free sampling,
which neither has any more, is accepted at its neutral value only.
The answers, the NDJSON stream and the dialects: ollama_answers.py.
"""

from __future__ import annotations

from typing import Any

from engine.api import openai
from engine.api.embeddings import EmbeddingRequest, parse_embeddings_request
from engine.api.llamacpp_fields import NO_LIMIT  # num_predict -1 / -2 (Ollama's default): no limit
from engine.api.fields import is_int, is_number, kind_of, object_body, str_field
from engine.errors import RequestError
from engine.requests.request import GenerationRequest

__all__ = ["CHAT_URL", "EMBED_URL", "EMBEDDINGS_URL", "GENERATE_URL", "loads_only", "model_field", "parse_chat",
           "parse_embed", "parse_embeddings", "parse_generate"]

CHAT_URL, GENERATE_URL = "/api/chat", "/api/generate"
EMBED_URL, EMBEDDINGS_URL = "/api/embed", "/api/embeddings"  # /api/embeddings: the older one, one prompt

_COMMON = {"model", "format", "options", "stream", "keep_alive", "think", "logprobs", "top_logprobs"}
_CHAT_FIELDS = _COMMON | {"messages", "tools"}
_GENERATE_FIELDS = _COMMON | {"prompt", "suffix", "images", "system", "template", "raw", "context"}
_MESSAGE_FIELDS = {"role", "content", "images", "tool_calls", "thinking", "tool_name"}

# options: Ollama's sampling names -> the OpenAI body's
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
             "stop": "stop", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "repeat_penalty": "repetition_penalty", "repeat_last_n": "repeat_last_n", "num_predict": "max_tokens",
             # llama.cpp's samplers, by the same names (engine/api/llamacpp_fields.py reads them)
             "typical_p": "typical_p", "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
             "mirostat_eta": "mirostat_eta"}
# How Ollama loads and runs a model: accepted, without effect (goinfer serve's flags decide these)
_RUNTIME = {"numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
            "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "penalize_newline"}
# A sampler neither goinfer nor llama.cpp has any more (tail-free sampling): accepted at its neutral value only
_NEUTRAL = {"tfs_z": 1.0}
_THINK_LEVELS = ("low", "medium", "high")
# The OpenAI body's names in a refusal -> Ollama's (longest first: response_format.json_schema before its prefix)
_RENAMED = {**{v: f"options.{k}" for k, v in _SAMPLING.items()}, "response_format.json_schema.schema": "format",
            "response_format": "format", "chat_template_kwargs.enable_thinking": "think"}


def loads_only(url: str, body: Any) -> bool:
    """Ollama's "load this model" request: /api/generate without a prompt, /api/chat without messages (clients
    send it to warm a model up; the answer is done at once, done_reason "load")."""
    if not isinstance(body, dict):
        return False
    if url == CHAT_URL:
        return body.get("messages") in (None, [])
    return body.get("prompt") in (None, "") and not body.get("images")


def parse_chat(body: Any) -> GenerationRequest:
    body = object_body(body)
    _known(body, _CHAT_FIELDS, "")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError(f"messages: must be an array, not {kind_of(messages)}", "messages", "invalid_type")
    openai_body = {**_common(body), "messages": [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]}
    if body.get("tools") is not None:
        openai_body["tools"] = body["tools"]  # OpenAI's shape already: {"type": "function", "function": {...}}
    return _parsed(openai.parse_chat_request, openai_body)


def parse_generate(body: Any) -> GenerationRequest:
    body = object_body(body)
    _known(body, _GENERATE_FIELDS, "")
    for name, what in (("suffix", "insertion (fill-in-the-middle)"),
                       ("template", "a prompt template of the request's own (send raw: true and a templated prompt)"),
                       ("context", "the context of an earlier answer (send the conversation to /api/chat)")):
        if body.get(name) not in (None, "", []):
            raise RequestError(f"{name}: {what} is not supported", name, "unsupported_parameter")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise RequestError(f"prompt: must be a string, not {kind_of(prompt)}", "prompt", "invalid_type")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise RequestError(f"raw: must be true or false, not {kind_of(raw)}", "raw", "invalid_type")
    _no_images(body.get("images"), "images")
    if raw:  # the prompt as it is, no template: a plain completion (Ollama leaves `system` out too)
        openai_body = {**_common(body, chat=False), "prompt": prompt}
        return _parsed(openai.parse_completion_request, openai_body)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise RequestError(f"system: must be a string, not {kind_of(system)}", "system", "invalid_type")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return _parsed(openai.parse_chat_request, {**_common(body), "messages": messages})


def parse_embed(body: Any) -> EmbeddingRequest:
    """/api/embed: `input` a string or an array of strings; `truncate` (default true: Ollama cuts an input over the
    context) is refused when true would have to cut: goinfer never cuts an input, it refuses one that is too long."""
    body = object_body(body)
    _known(body, {"model", "input", "truncate", "options", "keep_alive", "dimensions"}, "")
    _options(body.get("options"))
    return _parsed(parse_embeddings_request, {k: body[k] for k in ("model", "input", "dimensions") if k in body})


def parse_embeddings(body: Any) -> EmbeddingRequest:
    """/api/embeddings (the older route): one `prompt`."""
    body = object_body(body)
    _known(body, {"model", "prompt", "options", "keep_alive"}, "")
    _options(body.get("options"))
    return _parsed(parse_embeddings_request, {"model": body.get("model"), "input": body.get("prompt")},
                   {"input": "prompt"})


# ---------------------------------------------------------------------------------------------- pieces

def _known(body: dict, fields: set[str], where: str) -> None:
    unknown = sorted(k for k in body if k not in fields)
    if unknown:
        at = f"{where}{unknown[0]}"
        raise RequestError(f"{at}: unknown field (Ollama's fields here: {', '.join(sorted(fields))})", at,
                           "unsupported_parameter")


def _common(body: dict, chat: bool = True) -> dict:
    """The OpenAI body's fields for what chat and generate share: model, stream, sampling, format, thinking,
    logprobs."""
    # Ollama streams unless told not to, and generates until the end of the answer or of the context window
    out: dict[str, Any] = {"stream": body.get("stream", True), "max_tokens": NO_LIMIT}
    if "model" in body:
        out["model"] = _model_name(body["model"])
    out.update(_options(body.get("options")))
    fmt = body.get("format")
    if fmt in ("json",):
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise RequestError(f'format: must be "json" or a JSON schema (an object), not {fmt!r}', "format",
                           "invalid_value")
    think = body.get("think")
    if think is not None:
        if not (isinstance(think, bool) or think in _THINK_LEVELS):
            raise RequestError(f"think: must be true, false or one of {', '.join(_THINK_LEVELS)} (got {think!r})",
                               "think", "invalid_value")
        if chat:
            out["chat_template_kwargs"] = {"enable_thinking": think is not False}
            if isinstance(think, str):
                out["reasoning_effort"] = think
        elif think:  # raw: no template to think with
            raise RequestError("think: a raw prompt has no template to think with", "think", "invalid_value")
    if chat:
        out.update({k: body[k] for k in ("logprobs", "top_logprobs") if body.get(k) is not None})
    elif body.get("logprobs"):  # a completion's logprobs is the number of alternatives
        out["logprobs"] = body.get("top_logprobs") or 0
    return out


def _model_name(name: Any) -> Any:
    """Ollama names a model NAME:TAG, `:latest` when no tag is given: goinfer's names carry no tag, so a trailing
    `:latest` is dropped."""
    return name[:-len(":latest")] if isinstance(name, str) and name.endswith(":latest") else name


def _options(options: Any) -> dict:
    """Ollama's `options` -> the OpenAI body's sampling fields."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise RequestError(f"options: must be an object, not {kind_of(options)}", "options", "invalid_type")
    out = {}
    for name, value in options.items():
        at = f"options.{name}"
        if value is None or name in _RUNTIME:
            continue
        if name in _NEUTRAL:
            if not (is_number(value) and value == _NEUTRAL[name]):
                raise RequestError(f"{at}: this sampler is not supported; only its neutral value {_NEUTRAL[name]} "
                                   f"(got {value!r})", at, "unsupported_value")
            continue
        if name not in _SAMPLING:
            raise RequestError(f"{at}: unknown option", at, "unsupported_parameter")
        if name == "num_predict":
            if not is_int(value) or value == 0 or value < -2:
                raise RequestError(f"{at}: must be a positive number of tokens, or -1 (no limit) (got {value!r})",
                                   at, "invalid_value")
            value = NO_LIMIT if value < 0 else value
        out[_SAMPLING[name]] = value
    return out


def _message(m: Any, where: str) -> dict:
    if not isinstance(m, dict):
        raise RequestError(f"{where}: must be an object, not {kind_of(m)}", where, "invalid_type")
    _known(m, _MESSAGE_FIELDS, where + ".")
    _no_images(m.get("images"), f"{where}.images")
    out = {"role": m.get("role"), "content": m.get("content")}
    if m.get("role") == "tool":
        out["tool_call_id"] = m.get("tool_name") or ""
    if m.get("thinking") is not None:
        out["reasoning_content"] = m["thinking"]
    calls = m.get("tool_calls")
    if calls:  # Ollama's {"function": {"name", "arguments": {...}}}: openai.py reads them (ids given here)
        out["tool_calls"] = [{"id": f"call_{j}", **c} if isinstance(c, dict) else c for j, c in enumerate(calls)] \
            if isinstance(calls, list) else calls
    return out


def _no_images(images: Any, where: str) -> None:
    if images:
        raise RequestError(f"{where}: image input is not supported yet (no model served here reads images)", where,
                           "unsupported_value")


def _parsed(parse, body: dict, renamed: dict | None = None):
    """parse(body), its refusals naming Ollama's fields where the OpenAI body's name differs."""
    try:
        return parse(body)
    except RequestError as e:
        names = {**_RENAMED, **(renamed or {})}
        for theirs in sorted(names, key=len, reverse=True):
            if e.param is not None and (e.param == theirs or e.param.startswith(theirs + ".")):
                ours = names[theirs] + e.param[len(theirs):]
                raise RequestError(str(e).replace(e.param, ours, 1), ours, e.code) from None
        raise


def model_field(body: Any) -> str | None:
    """The model a body names (`:latest` dropped), for the routes that read only that."""
    return _model_name(str_field(object_body(body), "model"))
