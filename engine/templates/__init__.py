"""Chat templates: sandboxed jinja2 rendering with transformers semantics, and built-ins for files without one."""

from engine.templates.builtin import (
    BUILTIN_TEMPLATES,
    CHATML_TEMPLATE,
    GEMMA_TEMPLATE,
    builtin_template_source,
    template_for,
)
from engine.templates.chat import ChatTemplate, normalize_messages

__all__ = [
    "BUILTIN_TEMPLATES",
    "CHATML_TEMPLATE",
    "GEMMA_TEMPLATE",
    "ChatTemplate",
    "builtin_template_source",
    "normalize_messages",
    "template_for",
]
