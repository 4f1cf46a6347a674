"""Reading markup out of text that arrives in pieces: how much of a piece's end must wait for the next."""

from __future__ import annotations

__all__ = ["partial_suffix"]


def partial_suffix(text: str, markup: str) -> int:
    """Length of the longest end of `text` that is a proper start of `markup` (what may still become it)."""
    for k in range(min(len(markup) - 1, len(text)), 0, -1):
        if text.endswith(markup[:k]):
            return k
    return 0
