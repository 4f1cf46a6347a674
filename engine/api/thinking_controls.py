"""A request's thinking controls, read the same way on every OpenAI-style route (chat/completions, responses,
batch lines): which fields turn thinking on or off, how the reply is split, its budget, and replayed reasoning.

    chat_template_kwargs.enable_thinking   true / false: on / off (the other keys reach the template as they are)
    reasoning_effort                       "none": off; low / medium / high reach gpt-oss's template (its Reasoning
                                           line); any other value, on any other model, changes nothing and is never
                                           refused (clients send a bare effort to every endpoint)
    reasoning_format                       auto | deepseek (split), none (raw text), deepseek-legacy (both)
    thinking_token_budget                  the request's reasoning budget, in tokens
"""

from __future__ import annotations

from typing import Any

from engine.api.fields import int_field, kind_of
from engine.errors import RequestError
from engine.thinking.plan import FORMATS

__all__ = ["FIELDS", "replayed_reasoning", "thinking_controls"]

FIELDS = {"chat_template_kwargs", "reasoning_effort", "reasoning_format", "thinking_token_budget"}
# Names the template gets from the request itself (and the render call's own parameters); chat_template_kwargs
# may not replace them.
_RESERVED = {"messages", "tools", "add_generation_prompt", "self"}


def thinking_controls(body: dict, effort: Any = None) -> dict:
    """GenerationRequest fields from a body's thinking controls (`effort`: reasoning_effort as the route spells
    it, e.g. the Responses API's reasoning.effort; default the body's own)."""
    variables = _template_variables(body.get("chat_template_kwargs"))
    enable = variables.pop("enable_thinking", None)
    if enable is not None and not isinstance(enable, bool):
        raise RequestError(f"chat_template_kwargs.enable_thinking: must be true or false, not {kind_of(enable)}",
                           "chat_template_kwargs.enable_thinking", "invalid_type")
    effort = body.get("reasoning_effort") if effort is None else effort
    thinking = None
    if enable is not None:
        thinking = "on" if enable else "off"
    elif isinstance(effort, str) and effort.strip().lower() == "none":
        thinking = "off"
    fmt = body.get("reasoning_format")  # None: the runner's (serve --reasoning-format)
    if fmt is not None and fmt not in FORMATS:
        raise RequestError(f"reasoning_format: must be one of {', '.join(FORMATS)} (got {fmt!r})",
                           "reasoning_format", "invalid_value")
    return {"thinking": thinking, "reasoning_format": fmt,
            "thinking_budget": int_field(body, "thinking_token_budget", 0),
            "template_variables": variables or None,
            "reasoning_effort": effort if isinstance(effort, str) else None}


def _template_variables(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"chat_template_kwargs: must be an object, not {kind_of(value)}", "chat_template_kwargs",
                           "invalid_type")
    reserved = sorted(k for k in value if k in _RESERVED)
    if reserved:
        raise RequestError(f"chat_template_kwargs.{reserved[0]}: is set by the request itself",
                           f"chat_template_kwargs.{reserved[0]}", "invalid_value")
    return dict(value)


def replayed_reasoning(message: dict, where: str) -> str | None:
    """An assistant message's replayed reasoning (`reasoning_content`, else `reasoning`), or None."""
    for name in ("reasoning_content", "reasoning"):
        value = message.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise RequestError(f"{where}.{name}: must be a string, not {kind_of(value)}", f"{where}.{name}",
                               "invalid_type")
        return value
    return None
