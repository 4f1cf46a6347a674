"""What a thinking reply is split by: the runner's defaults and one reply's plan.

    ThinkingSettings     the runner's defaults (`serve --thinking`, `--reasoning-budget`, `--reasoning-format`)
    ThinkingPlan         one reply's: the delimiters, whether its prompt opened the block, its budget rule, format
    FORMATS              reasoning_format's values
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FORMATS", "ThinkingPlan", "ThinkingSettings"]

# reasoning_format: auto / deepseek split; none: the raw text in content, nothing split; deepseek-legacy: the
# reasoning split out and the raw text (markup included) in content as well, as llama.cpp's legacy format.
FORMATS = ("auto", "deepseek", "none", "deepseek-legacy")


@dataclass(frozen=True)
class ThinkingSettings:
    """What a runner does for a request that says nothing: the thinking mode, the reasoning budget, the format."""

    mode: str = "template"  # template | asis | on | off (engine/thinking/template.py)
    budget: int | str = "auto"  # N tokens | "auto" (only the room rule) | "unlimited" (no rule of ours)
    format: str = "auto"  # reasoning_format where a request sets none (FORMATS)


@dataclass(frozen=True)
class ThinkingPlan:
    """How one reply's text is split, and its budget rule (the budget itself depends on the reply's room)."""

    open: str
    close: str
    inside: bool  # the prompt opened the block: the reply starts as reasoning
    close_id: int | None = None  # the closing delimiter as one token (None: no budget can be forced)
    requested: int | None = None  # the request's budget (thinking_token_budget, Anthropic's budget_tokens)
    server: int | str = "auto"  # the runner's --reasoning-budget
    format: str = "auto"
    # Harmony (gpt-oss; engine/thinking/harmony.py): the reply is read by channels; the budget forces `close_ids`
    # (the analysis closed and the final channel opened, several tokens); `lead` is the prompt's open header.
    harmony: bool = False
    close_ids: tuple[int, ...] = ()
    lead: str = ""

    @property
    def splits(self) -> bool:
        return self.format != "none"

    @property
    def close_tokens(self) -> tuple[int, ...]:
        """What the budget forces, in order (empty: no budget can be forced)."""
        return self.close_ids or (() if self.close_id is None else (self.close_id,))
