"""gpt-oss's Harmony format: a reply is a run of messages on channels, read here into what the user sees.

    <|channel|>analysis<|message|>...<|end|>                               reasoning (reasoning_content)
    <|start|>assistant<|channel|>final<|message|>...<|return|>             the answer (content)
    <|start|>assistant<|channel|>commentary<|message|>...<|end|>           a preamble to a call: content too
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>   a call

The generation prompt ends at `<|start|>assistant`, so a reply opens with the rest of a header. A call is handed
on as the Hermes block every route already reads (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, its
arguments streamed as they come), so the three wire formats need nothing of their own for it. Text the model
writes outside any message (no header before it: a grammar-constrained reply, or a model that ignores the format)
is the answer, as it is: nothing is dropped. Several messages of one kind are joined by a blank line.

    is_harmony(source)          a chat template that writes Harmony
    HarmonySplitter(lead)       text in, (reasoning, answer) out, piece by piece (as thinking/stream.py's splitter)
    FINAL                       what the reasoning budget forces: the analysis closed and the final channel opened
    ANSWER_NOW                  what a prompt that must be answered at once (a grammar from the first token, a
                                decision's label) ends with: the final channel opened, no analysis
    harmony_messages(messages)  a request's messages as the template reads them (reasoning as `thinking`, a
                                call's arguments as an object)
"""

from __future__ import annotations

import json
import re

from engine.templates.markup import partial_suffix
from engine.templates.tools import with_object_arguments

__all__ = ["ANSWER_NOW", "EFFORTS", "FINAL", "HarmonySplitter", "harmony_messages", "is_harmony"]

START, CHANNEL, MESSAGE, END, CALL, RETURN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", \
    "<|return|>"
FINAL = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
ANSWER_NOW = f"{CHANNEL}final{MESSAGE}"  # after the generation prompt: the reply opens on the final channel
EFFORTS = ("low", "medium", "high")  # the template's `Reasoning:` line
_TERMINATORS = (END, CALL, RETURN, START)  # a message ends at these (<|start|>: a model that skipped its <|end|>)
_HEADER = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_ROLE = re.compile(r"^\s*<\|start\|>(assistant)?")  # a header's `<|start|>assistant`: never the user's text
_HEAD, _REASONING, _ANSWER, _CALL = "head", "reasoning", "answer", "call"


def is_harmony(source: str) -> bool:
    """A chat template that writes Harmony messages (gpt-oss)."""
    return all(marker in source for marker in (CHANNEL, MESSAGE, f"{START}assistant"))


class HarmonySplitter:
    """Generated text in, (reasoning, answer) out. `lead` is the end of the prompt the reply continues (from its
    last `<|start|>`): the generation prompt's `<|start|>assistant`, or a final message being continued. Text that
    may still be a marker, and a header until its `<|message|>`, are held back (`flush` gives them up)."""

    def __init__(self, lead: str = ""):
        self._state, self._buf = _HEAD, ""
        self._said = {_REASONING: False, _ANSWER: False}
        self._gap = False  # a new message of a kind already said: a blank line before its first text
        self.push(lead)  # what the prompt wrote is not the reply's: read for the state only

    @property
    def thinking(self) -> bool:
        """Not in an answer or a call yet: what the reasoning budget counts."""
        return self._state in (_HEAD, _REASONING)

    @property
    def can_close(self) -> bool:
        """The budget may close the reasoning now (FINAL): inside an analysis message, or before a header has
        named its channel (a header half written waits for its <|message|>)."""
        return self._state == _REASONING or (self._state == _HEAD and CHANNEL not in self._buf)

    def push(self, text: str) -> tuple[str, str]:
        self._buf += text
        out = {_REASONING: [], _ANSWER: []}
        while self._buf:
            if self._state == _HEAD:
                if not self._read_header(out):
                    break
                continue
            at, marker = _first(self._buf, _TERMINATORS)
            if at < 0:
                keep = max(partial_suffix(self._buf, m) for m in _TERMINATORS)
                self._body(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._body(self._buf[:at], out)
            self._end_message(out)
            self._buf = self._buf[at + (0 if marker == START else len(marker)):]
        return "".join(out[_REASONING]), "".join(out[_ANSWER])

    def flush(self) -> tuple[str, str]:
        """What is still held, at the end of the reply."""
        out = {_REASONING: [], _ANSWER: []}
        buf, self._buf = self._buf, ""
        if self._state == _HEAD:
            self._emit(_ANSWER, _ROLE.sub("", buf), out)  # a header never finished: the text is the answer
        else:
            self._body(buf, out)
            if self._state == _CALL:  # the reply ends here: the state stays (the last token is the message's)
                out[_ANSWER].append("}</tool_call>")
        return "".join(out[_REASONING]), "".join(out[_ANSWER])

    def _read_header(self, out) -> bool:
        """Reads a whole header from the buffer (True), or waits for the rest of it (False)."""
        at, marker = _first(self._buf, (MESSAGE, END, CALL, RETURN))
        if at < 0:
            return False
        header, self._buf = self._buf[:at], self._buf[at + len(marker):]
        if marker != MESSAGE:  # closed before any message: not Harmony; the text is the answer
            self._emit(_ANSWER, _ROLE.sub("", header), out)
            return True
        channel, recipient = _HEADER.search(header), _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1).removeprefix("functions.")
            out[_ANSWER].append(f'<tool_call>{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ')
            self._state = _CALL
        elif channel is None or channel.group(1) in ("final", "commentary"):
            self._state = _ANSWER
        else:
            self._state = _REASONING  # analysis (and any channel of the model's own)
        self._gap = self._state in self._said and self._said[self._state]
        return True

    def _body(self, text: str, out) -> None:
        if text:
            self._emit(self._state if self._state != _CALL else _ANSWER, text, out, call=self._state == _CALL)

    def _emit(self, kind: str, text: str, out, call: bool = False) -> None:
        if not text:
            return
        if not call:
            if self._gap:
                text, self._gap = "\n\n" + text, False
            self._said[kind] = True
        out[kind].append(text)

    def _end_message(self, out) -> None:
        if self._state == _CALL:
            out[_ANSWER].append("}</tool_call>")
        self._state, self._gap = _HEAD, False


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `markers` in `text`: (where, which), or (-1, "")."""
    hits = [(i, m) for i, m in ((text.find(m), m) for m in markers) if i >= 0]
    return min(hits) if hits else (-1, "")


def harmony_messages(messages: list[dict]) -> list[dict]:
    """Messages as a Harmony template reads them: an assistant call's arguments as an object (the template writes
    them with tojson; the wire sends a JSON string) and its replayed reasoning as `thinking` in place of content
    (the template takes one analysis text per call and refuses both); other turns' reasoning dropped, as the
    template drops it."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            reasoning = m.get("reasoning_content")
            m = with_object_arguments({k: v for k, v in m.items() if k != "reasoning_content"})
            if m.get("tool_calls") and reasoning:
                m["thinking"], m["content"] = reasoning, ""
        out.append(m)
    return out
