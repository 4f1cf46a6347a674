"""Options that several commands share, each defined once so their flags and help cannot drift apart.

Use one as a parameter's type and give the default at the parameter: `quant: QuantOption = "auto"`.
Options whose meaning differs between commands (serve's repeatable --model NAME=REF, its per-model
--threads, the sampling flags that batch only fills in where a line sets none) stay in their command.
"""

from __future__ import annotations

import copy
from typing import Annotated, List, Optional, get_args

import typer

__all__ = ["in_panel", "BackendOption", "ModelOption", "NoSelftestOption", "QuantOption", "ReasoningBudgetOption",
           "ReasoningFormatOption",
           "LoraOption", "SpeculateOption", "DraftMaxOption", "lora_choice", "ThinkingOption", "ThreadsOption", "backend_choice",
           "speculation_choice", "thinking_settings"]

ModelOption = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="A .gguf path, a safetensors checkpoint directory, a built-in name or "
                          "hf:OWNER/REPO[:QUANT] (or :safetensors).")]

QuantOption = Annotated[str, typer.Option(help="Compute path: auto or f32.")]

# A plain str checked by backend_choice, not a click Choice: click's refusal is a boxed usage block, ours one line.
BackendOption = Annotated[str, typer.Option(
    "--backend", help="cpu (default), webgpu (the best WebGPU adapter, software ones included), or auto (a real GPU "
                      "that passes the self-test, else cpu).")]

EmbedQuantOption = Annotated[str, typer.Option(
    "--embed-quant", help="Embedding models: f32 (the checkpoint's numbers) or q8 (an encoder's matrices as Q8_0 "
                          "blocks, a quarter of the memory; a decoder on the int8 fast path).")]

LoraOption = Annotated[Optional[List[str]], typer.Option(
    "--lora", metavar="DIR[,scale=S]", help="A LoRA adapter (a PEFT directory: adapter_config.json, "
                                            "adapter_model.safetensors) merged into the model's weights at load, at "
                                            "its own alpha/r times S (default 1); repeatable.")]

SpeculateOption = Annotated[str, typer.Option(
    "--speculate", help="ngram (default): guess a reply's next tokens from the text so far and check several in one "
                        "decode step (the same reply, sooner where it repeats its context); off: one a step.")]

DraftMaxOption = Annotated[int, typer.Option(
    "--draft-max", help="The most tokens --speculate ngram guesses at once (1-16).")]

ThreadsOption = Annotated[Optional[int], typer.Option(
    help="CPU threads for the kernels and BLAS (default: all cores).")]

NoSelftestOption = Annotated[bool, typer.Option("--no-selftest", help="Skip the kernel self-test at model load.")]

ThinkingOption = Annotated[str, typer.Option(
    "--thinking", help="Thinking models: template (what the model's chat template does unasked), asis (no block "
                       "after the assistant header; the model decides), on or off. A request's own choice wins.")]

ReasoningFormatOption = Annotated[str, typer.Option(
    "--reasoning-format", help="How a thinking reply comes back where a request does not say: auto / deepseek "
                               "(reasoning apart from the answer), none (the raw text, markup included) or "
                               "deepseek-legacy (both).")]

ReasoningBudgetOption = Annotated[str, typer.Option(
    "--reasoning-budget", help="Tokens a reply may think before its answer is forced: N, auto (at most 3/4 of the "
                               "reply's max tokens) or unlimited. A request's own budget comes first.")]


def in_panel(option, panel: str):
    """A shared option (one of the Annotated types above) listed under the help panel PANEL of a command's --help
    (Typer's rich_help_panel), the shared definition left as it is."""
    kind, info = get_args(option)[:2]
    info = copy.copy(info)
    info.rich_help_panel = panel
    return Annotated[kind, info]


def backend_choice(value: str) -> str:
    """--backend checked before any model is read: a bad value is a one-line usage error."""
    from commands.errors import fail
    from engine.loading.placement import BACKEND_CHOICES
    if value not in BACKEND_CHOICES:
        raise fail(f"--backend must be one of {', '.join(BACKEND_CHOICES)}, got {value!r}")
    return value


def thinking_settings(mode: str, budget: str, fmt: str = "auto"):
    """--thinking, --reasoning-budget and --reasoning-format as engine settings; a bad value is a one-line usage
    error."""
    from commands.errors import fail
    from engine.thinking.budget import parse_budget
    from engine.thinking.plan import FORMATS, ThinkingSettings
    from engine.thinking.template import MODES
    if mode not in MODES:
        raise fail(f"--thinking must be one of {', '.join(MODES)}, got {mode!r}")
    if fmt not in FORMATS:
        raise fail(f"--reasoning-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    try:
        return ThinkingSettings(mode, parse_budget(budget), fmt)
    except ValueError:
        raise fail(f"--reasoning-budget must be a number of tokens, auto or unlimited, got {budget!r}") from None


def speculation_choice(method: str, draft_max: int):
    """--speculate and --draft-max as an engine Speculation (None: off); a bad value is a one-line usage error."""
    from commands.errors import fail
    from engine.generation.speculation import speculation_of
    try:
        return speculation_of(method, draft_max)
    except ValueError as e:
        raise fail(str(e).replace("the draft length", "--draft-max")) from None


def lora_choice(values) -> list[tuple[str, float]]:
    """--lora DIR[,scale=S] values as (directory, multiplier) pairs; a bad scale is a one-line usage error."""
    from commands.errors import fail
    out = []
    for value in values or ():
        path, _, rest = value.partition(",scale=") if ",scale=" in value else (value, "", "1")
        try:
            scale = float(rest)
        except ValueError:
            raise fail(f"--lora {value}: scale must be a number, got {rest!r}") from None
        out.append((path, scale))
    return out
