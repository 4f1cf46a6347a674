"""A thinking reply split as it streams: the reasoning apart from the answer, and the budget that leaves room to
answer.

    ThinkingSettings     the runner's defaults (`serve --thinking`, `--reasoning-budget`)
    ThinkingPlan         one reply's: the delimiters, whether its prompt opened the block, its budget rule, format
    ReasoningSplitter    text in, (reasoning, answer) out, piece by piece; holds back what may be a delimiter
    splitter(plan)       the plan's reader: a ReasoningSplitter, or Harmony's (engine/thinking/harmony.py)
    thinking_budget      the reasoning budget of one reply (the seed's rule; see the function)

The split is on text, so it works whatever the tokenizer makes of the delimiters; the budget needs the closing
delimiter as one token (it forces that token), and is off where the tokenizer has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.thinking.harmony import HarmonySplitter
from engine.templates.markup import partial_suffix

__all__ = ["FORMATS", "ReasoningSplitter", "ThinkingPlan", "ThinkingSettings", "parse_budget", "splitter",
           "thinking_budget"]

# reasoning_format: auto / deepseek split; none: the raw text in content, nothing split; deepseek-legacy: the
# reasoning split out and the raw text (markup included) in content as well, as llama.cpp's legacy format.
FORMATS = ("auto", "deepseek", "none", "deepseek-legacy")
MIN_TURN = 4  # a reply allowed fewer tokens than this has no budget: there is no room to think and answer


@dataclass(frozen=True)
class ThinkingSettings:
    """What a runner does for a request that says nothing: the thinking mode, the reasoning budget, the format."""

    mode: str = "template"  # template | asis | on | off (engine/thinking/template.py)
    budget: int | str = "auto"  # N tokens | "auto" (only the room rule) | "unlimited" (no rule of ours)
    format: str = "auto"  # reasoning_format where a request sets none (FORMATS)


def parse_budget(text: str) -> int | str:
    """`--reasoning-budget` as typed: a count of tokens, auto or unlimited (ValueError otherwise)."""
    value = text.strip().lower()
    if value in ("auto", "unlimited"):
        return value
    n = int(value)
    if n < 0:
        raise ValueError("a reasoning budget is a count of tokens, >= 0")
    return n


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


def splitter(plan: ThinkingPlan) -> ReasoningSplitter | HarmonySplitter:
    """The reader of a reply split by `plan`."""
    if plan.harmony:
        return HarmonySplitter(plan.lead)
    return ReasoningSplitter(plan.open, plan.close, plan.inside)


_START, _THINKING, _AFTER, _ANSWER = "start", "thinking", "after", "answer"


class ReasoningSplitter:
    """Generated text in, (reasoning, answer) out. A reply whose prompt did not open the block may open it
    itself, first thing (leading whitespace aside); the reasoning is trimmed of the newlines around it and the
    answer of the whitespace after the block, as the templates write them back. Text that may still turn out to be
    a delimiter is held until it is told apart (`flush` at the end gives it up)."""

    def __init__(self, open_: str, close: str, inside: bool = False):
        self._open, self._close = open_, close
        self._state = _THINKING if inside else _START
        self._buf = ""
        self._reasoned = False  # some reasoning text has been given out (its leading whitespace is gone)

    @property
    def thinking(self) -> bool:
        """Inside the block now."""
        return self._state == _THINKING

    @property
    def can_close(self) -> bool:
        """The budget may force the close now."""
        return self._state == _THINKING

    def push(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, answer = [], []
        while True:
            state, buf = self._state, self._buf
            if state == _START:
                rest = buf.lstrip()
                if rest.startswith(self._open):
                    self._state, self._buf = _THINKING, rest[len(self._open):]
                    continue
                if not rest or self._open.startswith(rest):
                    break  # whitespace, or the start of the opening delimiter: not told apart yet
                self._state = _ANSWER
                continue
            if state == _THINKING:
                at = buf.find(self._close)
                if at >= 0:
                    reasoning.append(self._reasoning(buf[:at].rstrip()))
                    self._state, self._buf = _AFTER, buf[at + len(self._close):]
                    continue
                keep = partial_suffix(buf, self._close)
                out = buf[:len(buf) - keep].rstrip()  # trailing whitespace waits: it may end the reasoning
                reasoning.append(self._reasoning(out))
                self._buf = buf[len(out):]
                break
            if state == _AFTER:
                rest = buf.lstrip()
                self._buf = rest
                if not rest:
                    break
                self._state = _ANSWER
                continue
            answer.append(buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What is still held, at the end of the reply."""
        buf, self._buf = self._buf, ""
        if self._state == _THINKING:
            return self._reasoning(buf.rstrip()), ""
        return "", buf if self._state in (_START, _ANSWER) else buf.lstrip()

    def _reasoning(self, text: str) -> str:
        if not self._reasoned:
            text = text.lstrip()
            self._reasoned = bool(text)
        return text
