"""Thinking (reasoning) as a checkpoint's own chat template expresses it, and prompts rendered with it on or off.

Nothing is hard-wired per family: `read_thinking` renders a probe conversation with the template three ways
(`enable_thinking` unset, true, false) and reads what its generation prompt does after the assistant header:
    open    it opens the block (`<think>\\n`): the reply starts inside the thinking (Qwen3.5, DeepSeek-R1 distills)
    closed  it writes an empty closed block (`<think>\\n\\n</think>\\n\\n`): the model answers directly
    free    it writes nothing: the model decides, and a thinking model opens the block itself (Qwen3)
A template is recognised as a thinking template when it names one of the known delimiter pairs (DELIMITERS)
and either switches thinking with the `enable_thinking` variable or opens the block itself. Anything else is
rendered exactly as before and its replies are not split.

Modes (`serve --thinking`, a request's enable_thinking / reasoning_effort / Anthropic `thinking`):
    template  what the template renders when thinking is unspecified (the model card's default)
    asis      the prompt before thinking was modelled: no block after the assistant header, replayed reasoning
              dropped; the model decides
    on / off  forced: through `enable_thinking` where the template reads it, else by opening the block or writing
              an empty closed one after the header, in the template's own spelling
A final assistant message is continued rather than answered anew (assistant prefill), the way transformers'
`continue_final_message` does it: the conversation rendered whole, cut after that message's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest, TemplateError
from engine.templates.chat import ChatTemplate
from engine.thinking.harmony import CHANNEL, EFFORTS, END, MESSAGE, is_harmony

__all__ = ["DELIMITERS", "MODES", "PromptText", "ThinkingTemplate", "read_thinking", "render_prompt"]

# The block delimiters recognised (open, close): Qwen3, Qwen3.5, DeepSeek-R1 and QwQ's block; Gemma 4's thought
# channel (its canonical template: `<|channel>thought\n...<channel|>`, switched on by `<|think|>` in the system turn).
DELIMITERS = (("<think>", "</think>"), ("<|channel>thought", "<channel|>"))
MODES = ("template", "asis", "on", "off")
_PROBE = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class ThinkingTemplate:
    """How one chat template thinks."""

    open: str  # the block's opening delimiter as text
    close: str  # ... and its closing one
    switch: bool  # the template turns thinking on and off with the `enable_thinking` variable
    default: str  # its generation prompt with thinking unspecified: "open", "closed" or "free"
    open_id: int | None  # the delimiters as single tokens, where the tokenizer has them (None: several tokens)
    close_id: int | None
    harmony: bool = False  # gpt-oss: the reply's channels say what is reasoning (engine/thinking/harmony.py)

    @property
    def thinks_by_default(self) -> bool:
        return self.default != "closed"


@dataclass(frozen=True)
class PromptText:
    """A rendered chat prompt, and whether it leaves the model inside an open thinking block."""

    text: str
    inside: bool = False


def _single_token(tokenizer: Any, text: str) -> int | None:
    try:
        ids = tokenizer.encode(text, add_bos=False)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: treat as several tokens
        return None
    return int(ids[0]) if len(ids) == 1 else None


def _shape(region: str, open_: str, close: str) -> str:
    """What a generation prompt's tail does with the block: "open", "closed" or "free"."""
    at = region.rfind(open_)
    if at < 0:
        return "free"
    return "closed" if close in region[at + len(open_):] else "open"


def _suffix(template: ChatTemplate, **variables: Any) -> str | None:
    """The generation prompt the template adds to the probe under `variables` (None: it rewrites the history)."""
    base = template.render(_PROBE, add_generation_prompt=False, **variables)
    text = template.render(_PROBE, add_generation_prompt=True, **variables)
    return text[len(base):] if text.startswith(base) else None


def read_thinking(template: ChatTemplate, tokenizer: Any) -> ThinkingTemplate | None:
    """The template's thinking, or None where it has no recognised thinking control."""
    if is_harmony(template.source):  # always reasons, on its analysis channel; no off form, no switch
        return ThinkingTemplate(f"{CHANNEL}analysis{MESSAGE}", END, False, "free", None, None, harmony=True)
    for open_, close in DELIMITERS:
        if open_ not in template.source or close not in template.source:
            continue
        try:
            tails = [_suffix(template), _suffix(template, enable_thinking=True),
                     _suffix(template, enable_thinking=False)]
        except TemplateError:
            return None
        if any(t is None for t in tails):
            return None  # the generation prompt rewrites the history: not a shape we can read
        default, on, off = (_shape(t, open_, close) for t in tails)
        switch = "enable_thinking" in template.source and on != off
        if not switch and default != "open":
            return None  # mentions the delimiters (e.g. to strip them from history) but never thinks
        return ThinkingTemplate(open_, close, switch, default, _single_token(tokenizer, open_),
                                _single_token(tokenizer, close))
    return None


def render_prompt(template: ChatTemplate, thinking: ThinkingTemplate | None, messages: list[dict], *,
                  tools: list | None = None, mode: str = "template", variables: dict | None = None,
                  effort: str | None = None) -> PromptText:
    """The prompt for `messages` under thinking `mode` (see the module's doc). A final assistant message with text
    is continued; `variables` reach the template (chat_template_kwargs; `enable_thinking` there is the caller's
    to fold into `mode`). `effort` (reasoning_effort) is written on a Harmony template's `Reasoning:` line when
    it is one of low / medium / high; any other value, and every other template, ignore it."""
    if mode not in MODES:
        raise InvalidRequest(f"thinking: must be one of {', '.join(MODES)} (got {mode!r})")
    variables = {k: v for k, v in (variables or {}).items() if k != "enable_thinking"}
    if thinking is not None and thinking.harmony:  # gpt-oss reasons whatever the mode: no off form to render
        if isinstance(effort, str) and effort.strip().lower() in EFFORTS:
            variables.setdefault("reasoning_effort", effort.strip().lower())
        thinking, mode = None, "template"
    if thinking is None or mode == "asis":
        messages = [_without_reasoning(m) for m in messages]
    elif thinking.switch and mode in ("on", "off"):
        variables["enable_thinking"] = mode == "on"
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant" and not last.get("tool_calls"):
        if _text(last.get("content")).strip():
            return _continue_final(template, thinking, messages, tools, variables)
        messages = messages[:-1]  # an empty prefill: nothing to continue, answer as usual
    text = template.render(messages, add_generation_prompt=True, tools=tools, **variables)
    if thinking is None:
        return PromptText(text)
    base = template.render(messages, add_generation_prompt=False, tools=tools, **variables)
    if not text.startswith(base):
        return PromptText(text, _shape(text, thinking.open, thinking.close) == "open")
    head, region = text[:len(base)], _forced(text[len(base):], thinking, mode)
    return PromptText(head + region, _shape(region, thinking.open, thinking.close) == "open")


def _forced(region: str, thinking: ThinkingTemplate, mode: str) -> str:
    """The generation prompt's tail with the block as `mode` wants it, where the template did not do it. An empty
    tail is left alone: the template continues a turn still open (Gemma 4 after a tool result), no new reply."""
    if not region:
        return region
    shape, open_, close = _shape(region, thinking.open, thinking.close), thinking.open, thinking.close
    header = region[:region.find(open_)] if shape != "free" else region
    if mode == "asis":
        return header
    if mode == "off" and shape != "closed":
        return f"{header}{open_}\n\n{close}\n\n"
    if mode == "on" and shape == "closed":
        return f"{header}{open_}\n"
    return region


def _continue_final(template: ChatTemplate, thinking: ThinkingTemplate | None, messages: list[dict],
                    tools: list | None, variables: dict) -> PromptText:
    """The conversation rendered whole and cut right after the final (assistant) message's text, as transformers'
    continue_final_message cuts it (the text stripped, its last occurrence)."""
    text = template.render(messages, add_generation_prompt=False, tools=tools, **variables)
    content = _text(messages[-1].get("content"))
    candidates = [content.strip()]
    if thinking is not None and thinking.close in content:  # templates move a closed block out of the content
        candidates.append(content.split(thinking.close)[-1].strip())
    for wanted in candidates:
        at = text.rfind(wanted) if wanted else -1
        if at >= 0:
            text = text[:at + len(wanted)]
            break
    else:
        raise InvalidRequest("messages: the final assistant message cannot be continued: this model's chat "
                             "template does not write its text as given")
    if thinking is None:
        return PromptText(text)
    try:
        start = len(template.render(messages[:-1], add_generation_prompt=False, tools=tools, **variables))
    except TemplateError:
        start = 0
    opened, closed = text.rfind(thinking.open), text.rfind(thinking.close)
    return PromptText(text, opened >= start and opened > closed)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


def _without_reasoning(message: dict) -> dict:
    if "reasoning_content" not in message:
        return message
    return {k: v for k, v in message.items() if k != "reasoning_content"}
