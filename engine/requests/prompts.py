"""A request's prompt: a chat rendered by the model's own template (thinking as the runner and the request say,
a final assistant message continued), or a completion's text or token ids; and the plan its reply is split by.

    render_request(model, req, settings) -> PromptText     the chat's prompt text (and whether it opens thinking)
    prompt_ids(model, req, settings)     -> token ids       what the model evaluates
    thinking_plan(model, req, prompt, settings)              how the reply is split (None: not a thinking model)
    reply_plan(model, prompt, ...)                           the same from its parts
    continuation_ids(model, req, reply)                      how the next turn's prompt will likely start
    message_starts(model, text, messages, ids)               where the first and the last user message start
"""

from __future__ import annotations

import weakref

from engine.errors import RequestError
from engine.models.base import Model
from engine.thinking.plan import ThinkingPlan, ThinkingSettings
from engine.sessions.pool import shared_prefix
from engine.thinking.harmony import ANSWER_NOW, FINAL, START, harmony_messages
from engine.thinking.template import PromptText, ThinkingTemplate, read_thinking, render_prompt
from engine.templates.tools import render_messages

# `req` below is an engine.requests.request.GenerationRequest (not imported: that module builds on this one).

__all__ = ["answer_at_once", "continuation_ids", "encode_prompt", "message_starts", "prompt_ids", "render_request",
           "reply_plan", "thinking_mode", "thinking_of", "thinking_plan"]


def encode_prompt(model: Model, text: str) -> list[int]:
    """Token ids of a rendered prompt. A template that writes the BOS text itself must not get a second
    BOS from the tokenizer."""
    tok = model.tokenizer
    bos_text = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
    starts_with_bos = bool(bos_text) and text.startswith(bos_text)
    return tok.encode(text, add_bos=False if starts_with_bos else None)


_THINKING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def thinking_of(model: Model) -> ThinkingTemplate | None:
    """How the model's chat template thinks (None: no recognised thinking control); read once per model."""
    if model not in _THINKING:
        _THINKING[model] = read_thinking(model.template, model.tokenizer)
    return _THINKING[model]


def thinking_mode(req, settings: ThinkingSettings) -> str:
    """The mode a chat request renders with: off when constrained from the first token (a prompt that ends inside
    an open block would contradict the grammar), else the request's own choice, else the runner's."""
    if req.constrained:
        return "off"
    return req.thinking or settings.mode


def render_request(model: Model, req, settings: ThinkingSettings = ThinkingSettings()
                   ) -> PromptText:
    """A chat request's prompt text, thinking as `settings` and the request say."""
    tools = list(req.tools or ()) if req.calls_tools else None
    messages, template_tools = render_messages(list(req.messages), tools, model.template.source)
    thinking = thinking_of(model)
    if thinking is not None and thinking.harmony:
        messages = harmony_messages(messages)
    prompt = render_prompt(model.template, thinking, messages, tools=template_tools,
                           mode=thinking_mode(req, settings), variables=req.template_variables,
                           effort=req.reasoning_effort)
    if thinking is not None and thinking.harmony and req.constrained:
        return answer_at_once(prompt)
    return prompt


def answer_at_once(prompt: PromptText) -> PromptText:
    """A Harmony prompt whose reply must be the grammar's from its first token: its final channel opened after
    the generation prompt (no analysis first), as llama.cpp constrains gpt-oss's final message."""
    if prompt.text.endswith(f"{START}assistant"):
        return PromptText(prompt.text + ANSWER_NOW, False)
    return prompt


def prompt_ids(model: Model, req, settings: ThinkingSettings = ThinkingSettings()) -> list[int]:
    if req.messages is not None:
        return encode_prompt(model, render_request(model, req, settings).text)
    if isinstance(req.prompt, str):
        return encode_prompt(model, req.prompt)
    ids = [int(t) for t in req.prompt or ()]
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise RequestError(f"prompt: token id {bad[0]} is outside the vocabulary of {model.vocab_size}", "prompt")
    return ids


def thinking_plan(model: Model, req, prompt: PromptText,
                  settings: ThinkingSettings = ThinkingSettings()) -> ThinkingPlan | None:
    """How a chat reply is split (None: a completion, or a model whose template does not think)."""
    if req.messages is None:
        return None
    return reply_plan(model, prompt, requested=req.thinking_budget, server=settings.budget,
                      fmt=req.reasoning_format or settings.format, constrained=req.constrained)


def reply_plan(model: Model, prompt: PromptText, *, requested: int | None = None, server: int | str = "auto",
               fmt: str = "auto", constrained: bool = False) -> ThinkingPlan | None:
    """How the reply to a rendered chat prompt is split, and its budget (None: the template does not think). A
    Harmony reply constrained from its first token is the grammar's text alone: nothing to split."""
    thinking = thinking_of(model)
    if thinking is None:
        return None
    if thinking.harmony:
        if constrained:
            return None
        close = tuple(model.tokenizer.encode(FINAL, add_bos=False))
        lead = prompt.text[max(0, prompt.text.rfind(START)):]
        return ThinkingPlan(thinking.open, thinking.close, False, None, requested, server, fmt, harmony=True,
                            close_ids=close, lead=lead)
    return ThinkingPlan(thinking.open, thinking.close, prompt.inside, thinking.close_id, requested, server, fmt)


def continuation_ids(model: Model, req, reply: str) -> list[int] | None:
    """How the next turn's prompt will likely start after this request's reply: the messages and the reply,
    closed by the chat template (a chat), or the prompt text and the reply (a completion). None where that cannot
    be told (token prompts, tool calls) or the template refuses the shape."""
    try:
        if req.messages is not None and not req.calls_tools:
            messages, _ = render_messages(list(req.messages) + [{"role": "assistant", "content": reply}], None,
                                          model.template.source)
            return encode_prompt(model, model.render_chat(messages, add_generation_prompt=False))
        if isinstance(req.prompt, str):
            return encode_prompt(model, req.prompt + reply)
    except Exception:  # noqa: BLE001 - a template that wants another shape: no guess, nothing warmed
        return None
    return None


# How much of a message's text is looked for in its rendered prompt (enough to find it, short enough to be cheap).
_PROBE_CHARS = 48


def message_starts(model: Model, text: str, messages, ids: list[int], *, last: bool = True) -> tuple[int, ...]:
    """Token positions of ids (text's tokens) at or before where the first and (last=True) the last user message's
    text starts: a later prompt with the same system prompt, or the same conversation with its last message edited
    or regenerated, shares the prompt up to there (engine/sessions/pool.py keeps what it holds there for them). A
    message found in the text, each after the one before; one not found ends the search (fewer marks)."""
    found, at = [], 0
    for message in messages:
        content = message.get("content") if message.get("role") == "user" else None
        if isinstance(content, list):
            content = next((c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"), None)
        probe = content.strip()[:_PROBE_CHARS] if isinstance(content, str) else ""
        if not probe:
            continue
        at = text.find(probe, at)
        if at < 0:
            break
        found.append(at)
        if not last:
            break
    starts = sorted({found[0], found[-1]}) if found else []
    # A prefix's own tokens match the whole text's up to (about) where the prefix ends: tokens there may merge.
    return tuple(shared_prefix(ids, encode_prompt(model, text[:c])) for c in starts)
