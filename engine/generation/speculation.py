"""Speculative decoding by prompt lookup: a sequence's next tokens guessed from its own earlier tokens, and checked
by the model in one decode step.

Replies often copy from their prompt or from themselves: code edited in place, a document quoted or summarised, a
JSON record's keys, a list's repeated phrasing. Where the sequence's last few tokens (an n-gram, `ngram_max` down
to `ngram_min` long) occurred before, the tokens that followed them then are the draft. The decode step takes the
sequence's token and the draft as a run (Model.decode_runs): every weight is read once for all of them, so a run
of four costs ~1.6-1.7 steps of one on the 2-core dev machine (docs/benchmarks.md; less where a step is bound by
memory) and gives up to four tokens.

Nothing about the reply changes. The sequence decides each token from its run's rows in order, exactly as it would
from one step each (generate.Generation: sampler, seed, grammar, stops, logprobs), and stops at the first token
that differs from the draft (that token is still the right one: it was decided from the right logits); the rows
after it are dropped and the cache rewound past them. A run's row gets the very numbers a step of that one token
gives (the step computes each row on its own: tests/test_speculation.py checks them bit for bit), so greedy and
seeded replies are the same tokens with speculation on or off; only the time differs.

The draft's length adapts to how well it guesses (`Drafter.verified`): it grows by one after a draft taken whole
and halves after one refused at its first token, and a sequence whose guesses keep missing pauses drafting for a
while, so text that does not repeat itself pays little. Beside other sequences (the scheduler's batches), where a
draft row costs a larger share of a step, a sequence drafts only while most of its recent drafts were taken
(`Drafter.rate`, stepper.BATCH_DRAFT_RATE). Models with recurrent state (Qwen3.5, LFM2) do not
speculate (a rejected draft would need the state from before it), nor do backends without a run step (WebGPU).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METHODS", "Drafter", "Speculation", "speculation_of"]

METHODS = ("off", "ngram")


@dataclass(frozen=True)
class Speculation:
    """How a sequence drafts: by prompt lookup over n-grams of ngram_min..ngram_max tokens, at most draft_max
    tokens a step."""

    draft_max: int = 4
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self):
        if not 1 <= self.draft_max <= 16:
            raise ValueError(f"the draft length must be 1-16 tokens, got {self.draft_max}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 8:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max <= 8, got {self.ngram_min}..{self.ngram_max}")

    def drafter(self, tokens) -> Drafter:
        return Drafter(self, tokens)


def speculation_of(method: str, draft_max: int = 4) -> Speculation | None:
    """A command line's choice (--speculate METHOD --draft-max N) as a Speculation, None for "off"."""
    if method not in METHODS:
        raise ValueError(f"--speculate {method!r}: choose from {', '.join(METHODS)}")
    return None if method == "off" else Speculation(draft_max=draft_max)


_PAUSE = 16  # tokens without a draft after MISSES_TO_PAUSE drafts in a row refused at their first token
_MISSES_TO_PAUSE = 3
_RATE_WEIGHT = 0.3  # of the latest draft in the running rate of taken draft tokens


class Drafter:
    """One sequence's drafts: the tokens so far (prompt and reply), indexed by the n-grams they contain."""

    def __init__(self, spec: Speculation, tokens):
        self.spec = spec
        self.tokens: list[int] = []
        # n -> {the n tokens before a position: that position} (its latest occurrence; the continuation is there)
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(spec.ngram_min, spec.ngram_max + 1)}
        self.length = spec.draft_max  # the draft length now (adapts)
        self._misses = 0  # drafts in a row refused at their first token
        self._pause = 0  # tokens still to go without drafting
        self.drafted = self.accepted = 0  # this sequence's draft tokens checked and taken, in all
        self.rate = 0.75  # the share of recent drafts' tokens that were taken (a running mean; hopeful at first)
        for t in tokens:
            self.push(t)

    def push(self, token: int) -> None:
        """The sequence's next token (a prompt token, or one the reply decided)."""
        self.tokens.append(int(token))
        end = len(self.tokens) - 1  # the n-grams that end just before the new token now have a continuation
        for n, index in self._index.items():
            if end >= n:
                index[tuple(self.tokens[end - n : end])] = end
        if self._pause:
            self._pause -= 1

    def draft(self, limit: int) -> list[int]:
        """Up to min(limit, the current length) tokens guessed to follow the tokens so far; [] without a match."""
        limit = min(limit, self.length)
        if limit < 1 or self._pause:
            return []
        for n in range(self.spec.ngram_max, self.spec.ngram_min - 1, -1):
            if len(self.tokens) < n:
                continue
            at = self._index[n].get(tuple(self.tokens[-n:]))
            if at is not None:
                return self.tokens[at : at + limit]
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens was checked: its first `accepted` were the sequence's own next tokens."""
        if not drafted:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.rate += _RATE_WEIGHT * (accepted / drafted - self.rate)
        if accepted == drafted:
            self.length = min(self.spec.draft_max, self.length + 1)
            self._misses = 0
        elif accepted == 0:
            self.length = max(1, self.length // 2)
            self._misses += 1
            if self._misses >= _MISSES_TO_PAUSE:
                self._pause, self._misses = _PAUSE, 0
        else:
            self._misses = 0
