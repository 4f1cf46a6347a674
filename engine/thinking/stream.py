"""A thinking reply split as it streams: the reasoning apart from the answer, piece by piece.

    ReasoningSplitter    text in, (reasoning, answer) out, piece by piece; holds back what may be a delimiter
    splitter(plan)       the plan's reader (engine/thinking/plan.py): a ReasoningSplitter, or Harmony's
                         (engine/thinking/harmony.py)

The split is on text, so it works whatever the tokenizer makes of the delimiters.
"""

from __future__ import annotations

from engine.templates.markup import partial_suffix
from engine.thinking.harmony import HarmonySplitter
from engine.thinking.plan import ThinkingPlan

__all__ = ["ReasoningSplitter", "splitter"]


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
