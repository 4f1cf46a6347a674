"""Built-in chat templates for model files that carry none (`tokenizer.chat_template` absent).

Gemma (`gemma`, `gemma2`, `gemma3`): Gemma's turn format. BOS decision: the template never prints
`bos_token`. Gemma GGUFs set `tokenizer.ggml.add_bos_token = true`, so the tokenizer adds the BOS id itself;
printing `<bos>` as text as well would give a double BOS. (llama.cpp's built-in `gemma` template does the same,
and llama.cpp's own rendering of a gemma chat, the reference the template tests hold, is that text with add_bos
true.) System messages have no turn of their own: their text, then a blank line, opens the next user turn, as
Gemma's official template does for a leading system message. Consecutive turns of the same role are rendered as
given (the official template raises there; llama.cpp's built-in does not, and an API server should not refuse
them).

Anything else: ChatML (`<|im_start|>role\\n...<|im_end|>\\n`), the most common format and llama.cpp's default.
"""

from __future__ import annotations

from engine.templates.chat import ChatTemplate

__all__ = ["GEMMA_TEMPLATE", "CHATML_TEMPLATE", "BUILTIN_TEMPLATES", "builtin_template_source", "template_for"]

GEMMA_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
    {%- set role = message['role'] -%}
    {%- set text = (message['content'] or '') | trim -%}
    {%- if role == 'system' -%}
        {%- set ns.system = ns.system + text -%}
    {%- elif role == 'user' or role == 'assistant' or role == 'model' -%}
        {{- '<start_of_turn>' + ('user' if role == 'user' else 'model') + '\\n' -}}
        {%- if role == 'user' and ns.system -%}
            {{- ns.system + '\\n\\n' -}}
            {%- set ns.system = '' -%}
        {%- endif -%}
        {{- text + '<end_of_turn>\\n' -}}
    {%- else -%}
        {{- raise_exception("Gemma's chat format has no '" + role + "' role (only system, user, assistant)") -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

CHATML_TEMPLATE = """\
{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# GGUF `general.architecture` -> template source for files without their own template.
BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": GEMMA_TEMPLATE,
    "gemma2": GEMMA_TEMPLATE,
    "gemma3": GEMMA_TEMPLATE,
}


def builtin_template_source(arch: str) -> str:
    """The built-in template for an architecture: its own format where we know one, else ChatML."""
    return BUILTIN_TEMPLATES.get(arch, CHATML_TEMPLATE)


def template_for(arch: str, gguf_template: str | None, bos_token: str, eos_token: str) -> ChatTemplate:
    """The model's own template when its file carries one (a broken one raises TemplateError), else a built-in."""
    source = gguf_template if gguf_template and gguf_template.strip() else builtin_template_source(arch)
    return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)
