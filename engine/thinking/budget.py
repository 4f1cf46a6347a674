"""The reasoning budget: how many tokens a reply may think before its close is forced, leaving room to answer.

    parse_budget(text)            `--reasoning-budget` as typed: N, auto or unlimited
    thinking_budget(plan, n)      the budget of one reply of at most n tokens (the seed's rule; see the function)

The budget needs the closing delimiter as one token (Harmony's: several), which it forces; where the tokenizer
has none there is no budget.
"""

from __future__ import annotations

from engine.thinking.plan import ThinkingPlan

__all__ = ["MIN_TURN", "parse_budget", "thinking_budget"]

MIN_TURN = 4  # a reply allowed fewer tokens than this has no budget: there is no room to think and answer


def parse_budget(text: str) -> int | str:
    """`--reasoning-budget` as typed: a count of tokens, auto or unlimited (ValueError otherwise)."""
    value = text.strip().lower()
    if value in ("auto", "unlimited"):
        return value
    n = int(value)
    if n < 0:
        raise ValueError("a reasoning budget is a count of tokens, >= 0")
    return n


def thinking_budget(plan: ThinkingPlan, max_tokens: int) -> int | None:
    """Tokens the reasoning may take before its close is forced, for a reply of at most `max_tokens`: the smaller
    of the request's budget (else the runner's number) and the room rule (three quarters of max_tokens, leaving at
    least 2 to answer; dropped under "unlimited"). A close of several tokens (Harmony's) counts as reasoning: it
    starts that much earlier. None: no budget (no close to force, a turn under MIN_TURN tokens, or nothing asked
    under "unlimited")."""
    close = len(plan.close_tokens)
    if not close or max_tokens < MIN_TURN + close - 1:
        return None
    room = None if plan.server == "unlimited" else max(0, min(max_tokens * 3 // 4, max_tokens - 2 - (close - 1)))
    asked = plan.requested if plan.requested is not None else (plan.server if isinstance(plan.server, int) else None)
    if asked is not None:
        asked = max(0, asked - (close - 1))
    limits = [x for x in (asked, room) if x is not None]
    return min(limits) if limits else None
