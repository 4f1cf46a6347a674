"""The OpenAI wire format's requests: chat/completions and completions bodies -> GenerationRequest.

Pure functions (no I/O), shared by `goinfer batch` and `goinfer serve`, so a body means the same thing
in a batch file and over HTTP. Every refusal is a RequestError naming the field (`param`) and a
machine-readable `code`; a request is never answered without something it asked for.

    parse_chat_request(body) / parse_completion_request(body) / parse_request(url, body)

What constrains an answer (tools, tool_choice, response_format, the grammar fields) is read in constraints.py;
the answers (response objects, errors, /v1/models entries) are built in openai_objects.py, the streaming chunks
in sse.py.
"""

from __future__ import annotations

import json
from typing import Any

from engine.api import llamacpp_fields
from engine.api import thinking_controls as thinking_fields
from engine.api.constraints import GRAMMAR_FIELDS, answer_grammar, parse_tool_choice, parse_tools
from engine.api.fields import bool_field, float_field, int_field, is_int, is_number, kind_of, object_body, str_field
from engine.constrain.grammar import Grammar
from engine.constrain.tools import tool_call_grammar
from engine.errors import RequestError
from engine.generation.sampler_chain import ChainSettings
from engine.requests.request import GenerationRequest, SamplingOptions

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions endpoint
MAX_STOP = 4
MAX_N = 16  # choices per request; they run one after another, so each one costs a whole generation

# Accepted and without effect here: routing, bookkeeping and hints about how to deliver.
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
_SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "repeat_last_n", "logit_bias", "n", "stream", "stream_options"}
_CHAT_FIELDS = _IGNORED | _SAMPLING | thinking_fields.FIELDS | set(GRAMMAR_FIELDS) | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "goinfer_confidence"}
# A plain completion has no template to think with: reasoning_effort is accepted there and does nothing.
_COMPLETION_FIELDS = _IGNORED | _SAMPLING | set(GRAMMAR_FIELDS) | {
    "prompt", "logprobs", "echo", "best_of", "suffix", "response_format", "reasoning_effort", "goinfer_confidence"}
# Asked for by name, and not done yet: refused with a message that says so.
_UNSUPPORTED_CHAT = {"functions": "functions (legacy function calling; use tools)",
                     "function_call": "function_call (legacy function calling; use tool_choice)",
                     "audio": "audio output",
                     "prediction": "predicted outputs", "web_search_options": "web search",
                     "modalities": "output modalities other than text"}

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_IMAGE_PARTS = {"image_url", "input_image", "image"}


# ---------------------------------------------------------------------------------------------- parsing

def parse_request(url: str, body: Any) -> GenerationRequest:
    """The request a POST to `url` with `body` asks for."""
    if url == CHAT_URL:
        return parse_chat_request(body)
    if url == COMPLETIONS_URL:
        return parse_completion_request(body)
    raise RequestError(f"url {url!r} is not supported (supported: {', '.join(URLS)})", "url", "invalid_url")


def parse_chat_request(body: Any) -> GenerationRequest:
    """A /v1/chat/completions body -> GenerationRequest (RequestError names what is wrong)."""
    body, llamacpp = llamacpp_fields.translate(object_body(body), True, MAX_TOP_LOGPROBS)
    for name, what in _UNSUPPORTED_CHAT.items():
        value = body.get(name)
        if value is None or value == [] or (name == "modalities" and value == ["text"]):
            continue
        raise RequestError(f"{name}: {what} is not supported", name, "unsupported_parameter")
    _known(body, _CHAT_FIELDS | set(_UNSUPPORTED_CHAT))
    grammar = answer_grammar(body)
    tools = parse_tools(body.get("tools"))
    choice, tools = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = bool_field(body, "parallel_tool_calls", True)
    if tools and choice != "none" and grammar is not None and grammar.what not in ("json_schema", "json_object"):
        raise RequestError("tools: a request's own grammar and tool calls do not go together (send one)", "tools",
                           "invalid_value")
    if tools and choice != "none":
        # The tool grammar replaces a response_format one: a call's arguments follow their own schema.
        grammar = tool_call_grammar(list(tools), forced=choice != "auto", parallel=parallel)
    messages = _messages(body.get("messages"))
    logprobs = bool_field(body, "logprobs", False)
    top = int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise RequestError("top_logprobs requires logprobs: true", "top_logprobs", "invalid_value")
    max_tokens = int_field(body, "max_tokens", 1)
    max_completion = int_field(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise RequestError("max_completion_tokens: disagrees with max_tokens; send one of them",
                           "max_completion_tokens", "invalid_value")
    options = _options(body, max_completion if max_completion is not None else max_tokens, llamacpp.pop("chain", None))
    stream, include_usage = _stream(body)
    return GenerationRequest(messages=messages, options=options, logprobs=logprobs, top_logprobs=top or 0,
                             n=_n(body), stream=stream, include_usage=include_usage, model=str_field(body, "model"),
                             grammar=grammar, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                             confidence=_confidence(body, grammar, tools and choice != "none"),
                             **thinking_fields.thinking_controls(body), **llamacpp)


def parse_completion_request(body: Any) -> GenerationRequest:
    """A /v1/completions body -> GenerationRequest (RequestError names what is wrong)."""
    body, llamacpp = llamacpp_fields.translate(object_body(body), False, MAX_COMPLETION_LOGPROBS)
    _known(body, _COMPLETION_FIELDS)
    if body.get("suffix") not in (None, ""):
        raise RequestError("suffix: insertion (fill-in-the-middle) is not supported", "suffix",
                           "unsupported_parameter")
    best_of = int_field(body, "best_of", 1)
    if best_of is not None and best_of > 1:
        raise RequestError(f"best_of: best_of > 1 is not supported (got {best_of})", "best_of", "unsupported_value")
    top = int_field(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    n = _n(body)
    if best_of is not None and best_of < n:
        raise RequestError(f"best_of: must be >= n (got best_of {best_of}, n {n})", "best_of", "invalid_value")
    stream, include_usage = _stream(body)
    grammar = answer_grammar(body)
    return GenerationRequest(prompt=_prompt(body.get("prompt")),
                             options=_options(body, int_field(body, "max_tokens", 1), llamacpp.pop("chain", None)),
                             logprobs=top is not None, top_logprobs=top or 0, echo=bool_field(body, "echo", False),
                             n=n, stream=stream, include_usage=include_usage, model=str_field(body, "model"),
                             grammar=grammar, confidence=_confidence(body, grammar, False), **llamacpp)


def _confidence(body: dict, grammar: Grammar | None, calls_tools: bool) -> bool:
    """goinfer_confidence: per-field confidence, for a json_schema answer only (the schema says each field's kind)."""
    if not bool_field(body, "goinfer_confidence", False):
        return False
    if calls_tools:
        raise RequestError("goinfer_confidence: not with tools (a call's arguments are not reported)",
                           "goinfer_confidence", "unsupported_parameter")
    if grammar is None or grammar.what != "json_schema":
        raise RequestError("goinfer_confidence: needs response_format {\"type\": \"json_schema\", ...} (the schema "
                           "says each field's kind)", "goinfer_confidence", "invalid_value")
    if _n(body) != 1:
        raise RequestError("goinfer_confidence: one answer only (n = 1)", "goinfer_confidence", "invalid_value")
    return True


def _known(body: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown parameter", unknown[0], "unsupported_parameter")


def _n(body: dict) -> int:
    n = int_field(body, "n", 1)
    if n is not None and n > MAX_N:
        raise RequestError(f"n: at most {MAX_N} choices per request (got {n})", "n", "unsupported_value")
    return n or 1


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage). stream_options without stream is refused, as OpenAI refuses it."""
    stream = bool_field(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise RequestError(f"stream_options: must be an object, not {kind_of(opts)}", "stream_options", "invalid_type")
    if not stream:
        raise RequestError("stream_options: only allowed when stream is true", "stream_options", "invalid_value")
    unknown = sorted(k for k in opts if k not in ("include_usage", "include_obfuscation"))
    if unknown:
        raise RequestError(f"stream_options.{unknown[0]}: unknown parameter", f"stream_options.{unknown[0]}",
                           "unsupported_parameter")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(f"stream_options.include_usage: must be true or false, not {kind_of(include)}",
                           "stream_options.include_usage", "invalid_type")
    return stream, include


def _options(body: dict, max_tokens: int | None, chain: ChainSettings | None = None) -> SamplingOptions:
    """chain: llama.cpp's other samplers, as llamacpp_fields read them."""
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=float_field(body, "temperature", 0.0, 2.0),
        top_p=float_field(body, "top_p", 0.0, 1.0, low_open=True),
        top_k=int_field(body, "top_k", 0),
        min_p=float_field(body, "min_p", 0.0, 1.0),
        seed=_seed(body),
        stop=_stop(body.get("stop")),
        presence_penalty=float_field(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=float_field(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=float_field(body, "repetition_penalty", 0.0, None, low_open=True),
        penalty_last_n=int_field(body, "repeat_last_n", -1),  # llama.cpp's and Ollama's name
        logit_bias=_logit_bias(body.get("logit_bias")),
        chain=chain,
    )


def _seed(body: dict) -> int | None:
    seed = int_field(body, "seed", None)
    return None if seed is None else seed % (1 << 64)  # OpenAI takes any int64; the generator wants >= 0


def _messages(value: Any) -> tuple[dict, ...]:
    if value is None:
        raise RequestError("messages: required", "messages", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise RequestError("messages: must be a non-empty array", "messages", "invalid_value")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where}: must be an object, not {kind_of(m)}", where, "invalid_type")
        role = m.get("role")
        if role is not None and not isinstance(role, str):
            raise RequestError(f"{where}.role: must be a string, not {kind_of(role)}", f"{where}.role",
                               "invalid_type")
        if role == "function":
            raise RequestError(f"{where}.role: function messages (legacy function calling) are not supported; "
                               "use tool messages", f"{where}.role", "unsupported_value")
        if role not in _ROLES and role != "tool":
            raise RequestError(f"{where}.role: must be one of system, developer, user, assistant, tool "
                               f"(got {role!r})", f"{where}.role", "invalid_value")
        if m.get("function_call"):
            raise RequestError(f"{where}.function_call: legacy function calling is not supported; use tool_calls",
                               f"{where}.function_call", "unsupported_parameter")
        content = m.get("content")
        if content is None and role != "assistant":
            raise RequestError(f"{where}.content: required", f"{where}.content", "missing_required_parameter")
        if role == "tool":
            out.append({"role": "tool", "content": _content(content, f"{where}.content"),
                        "tool_call_id": str(m.get("tool_call_id") or "")})
            continue
        msg = {"role": _ROLES[role], "content": _content(content, f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        reasoning = thinking_fields.replayed_reasoning(m, where) if role == "assistant" else None
        if reasoning is not None:
            msg["reasoning_content"] = reasoning  # rendered as the model's template renders it (or dropped)
        out.append(msg)
    return tuple(out)


def _tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, replayed into the prompt."""
    if not isinstance(value, list):
        raise RequestError(f"{where}: must be an array", where, "invalid_type")
    out = []
    for j, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f'{where}[{j}]: must be {{"id", "type": "function", "function": {{"name", '
                               '"arguments"}}}}', f"{where}[{j}]", "invalid_value")
        args = fn.get("arguments", "{}")
        out.append({"id": str(c.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def _content(content: Any, where: str) -> str:
    """A message's content as one string: text parts joined by newlines (as the templates join them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or an array of content parts, not {kind_of(content)}",
                           where, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is not None and not isinstance(kind, str):
            raise RequestError(f"{at}.type: must be a string, not {kind_of(kind)}", f"{at}.type", "invalid_type")
        if kind in _IMAGE_PARTS:
            raise RequestError(f"{at}: image content ({kind}) is not supported", at, "unsupported_value")
        if kind != "text" and kind is not None:
            raise RequestError(f"{at}: content parts of type {kind!r} are not supported (only text)", at,
                               "unsupported_value")
        text = part.get("text") if isinstance(part, dict) else None
        if kind is None or not isinstance(text, str):
            raise RequestError(f'{at}: must be {{"type": "text", "text": "..."}}', at, "invalid_value")
        texts.append(text)
    return "\n".join(texts)


def _prompt(value: Any) -> str | tuple[int, ...]:
    if value is None:
        raise RequestError("prompt: required", "prompt", "missing_required_parameter")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(is_int(t) and t >= 0 for t in value):
        return tuple(value)  # one prompt given as token ids
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return _prompt(value[0])
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise RequestError(f"prompt: more than one prompt per request is not supported (got {len(value)})",
                           "prompt", "unsupported_value")
    raise RequestError("prompt: must be a string, an array of token ids, or an array holding one of those",
                       "prompt", "invalid_value")


def _stop(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop: must be a string or an array of strings", "stop", "invalid_value")
    if len(stops) > MAX_STOP:
        raise RequestError(f"stop: at most {MAX_STOP} sequences (got {len(stops)})", "stop", "invalid_value")
    return tuple(s for s in stops if s)


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("logit_bias: must be an object mapping token ids to numbers", "logit_bias", "invalid_value")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias: key {key!r} is not a token id", "logit_bias", "invalid_value") from None
        if not is_number(bias) or not -100 <= bias <= 100:
            raise RequestError(f"logit_bias: the bias of token {key} must be a number in [-100, 100]",
                               "logit_bias", "invalid_value")
        out[token] = float(bias)
    return out
