"""Chat templates: a model's Jinja template rendered the way Hugging Face transformers renders it.

Same environment as transformers' `apply_chat_template`, so a template written for transformers renders
byte-identically here: ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text as is. Every failure (syntax,
runtime, sandbox refusal) surfaces as `engine.errors.TemplateError` with a one-line message.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import GoinferError, InvalidRequest, TemplateError

__all__ = ["ChatTemplate", "normalize_messages"]


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation they cannot express (e.g. roles out of order).
    raise TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and ' (\u003c ...); tool schemas must reach the model verbatim.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant spans with it; we render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Environment(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The stock sandbox returns an Undefined that prints as "" (a probe renders silently); refuse loudly.
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> _Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True,
                       extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(content: Any, index: int) -> Any:
    """A message's content as one string: text parts joined by newlines (llama.cpp and vLLM join with "\\n")."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"messages[{index}]: content part of type {kind!r} is not supported "
                                     "(only text parts)")
        return "\n".join(texts)
    raise InvalidRequest(f"messages[{index}]: content must be a string or a list of text parts, "
                         f"not {type(content).__name__}")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Copies of `messages` whose content is a plain string (or None); the caller's dicts are left untouched."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object, not {type(message).__name__}")
        copy = dict(message)
        if "content" in copy:
            copy["content"] = _content_text(copy["content"], i)
        out.append(copy)
    return out


def _where(exc: BaseException) -> str:
    lineno = getattr(exc, "lineno", None)
    return f" (line {lineno})" if lineno else ""


class ChatTemplate:
    """A compiled chat template. `render(messages)` returns the prompt text to tokenize.

    `bos_token` / `eos_token` are the token *texts* the template may print (`{{ bos_token }}`); whether the
    tokenizer also adds a BOS id is the tokenizer's business.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str):
            raise TemplateError(f"chat template must be a string, not {type(source).__name__}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template syntax error{_where(exc)}: {exc.message}") from None
        except jinja2.TemplateError as exc:  # e.g. an unknown extension tag reported at compile time
            raise TemplateError(f"chat template does not compile: {exc}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               **extra: Any) -> str:
        """Render `messages` (content: a string or a list of text parts) to the prompt text.

        `extra` reaches the template as more variables (e.g. `enable_thinking`, `documents`) and may
        override `bos_token` / `eos_token`.
        """
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra,
                   "messages": normalize_messages(messages), "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except GoinferError:
            raise  # raise_exception's TemplateError, or a typed error from our own helpers
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"chat template refused by the sandbox: {exc}") from None
        except jinja2.UndefinedError as exc:
            raise TemplateError(f"chat template uses an undefined value: {exc}") from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed{_where(exc)}: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
                OverflowError, RecursionError) as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"
