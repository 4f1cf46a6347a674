"""Tool calls read while they are generated: text pieces in; content, call starts, argument pieces and call
ends out, each as soon as it is certain. The three streaming wire formats (chat chunks, Anthropic events,
Responses events) are built from these events.

Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks stream: a call starts once its name
is read and checked, and its arguments follow token by token, re-written as json.dumps writes them
(json_stream), so the pieces join up to exactly the `arguments` that parse_tool_calls reads from the whole
answer. Markup split across pieces ("<tool" + "_call>") is held back only while it could still be markup.

Gemma 4's own blocks (`<|tool_call>call:NAME{...}<tool_call|>`) are rewritten into Hermes ones as each closes
(tools.Gemma4Calls), so they stream as a call whole at their close.
Qwen3.5's XML form inside a block (`<function=NAME><parameter=K>...`) is read whole at the block's close, its
values typed by the tools' schemas as parse_tool_calls types them.

Where the whole-answer parser decides differently, the stream decides the same way: an answer whose first
block is no call streams as plain text; text before the first opener loses its trailing whitespace (the
parser strips it); text between and after blocks is dropped. Llama-3 bare JSON and Mistral `[TOOL_CALLS]`
answers (never produced under our grammar) are held and parsed whole at the end. What cannot be taken back
once sent: a call cut off by max_tokens or a stop string still arrives, with the arguments it got.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.templates.json_stream import STR_CLOSE, STR_OPEN, STR_PART, JsonLexer, JsonStreamError, dumps
from engine.templates.markup import partial_suffix
from engine.templates.tools import Gemma4Calls, ToolCall, new_call_id, parse_tool_calls, read_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
_ARGS = ("arguments", "parameters")


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place in this answer: 0, 1, ...
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int
    call: ToolCall  # its arguments: all the pieces sent, joined


Event = Text | CallStart | CallArguments | CallEnd


@dataclass
class _Block:
    """One `<tool_call>` block being read: its raw text, and where the reader stands in its JSON object."""

    raw: str = ""  # text after the opener (up to the close, once seen)
    fed: int = 0  # how much of raw the lexer has read
    lexer: JsonLexer = field(default_factory=JsonLexer)
    phase: str = "open"  # open, key, keystr, colon, value, after, end; "bad": not a call
    depth: int = 0  # nesting, the call object itself being 1
    in_str: bool = False
    key: str = ""
    role: str = "skip"  # what the value being read is: name, args (streamed), skip
    name: str | None = None
    index: int | None = None  # set once the call is started
    call_id: str = ""
    args: list[str] = field(default_factory=list)  # the argument pieces sent
    args_seen: bool = False  # an arguments value was met (streamed, or left for the end when it could not be)


class ToolCallStream:
    """Feed an answer's pieces with push(); finish() at its end. `tool_names`: the tools the answer may call
    (None: any name; a mapping to their parameters' schemas types Qwen3.5's XML values). `started` counts the
    calls begun so far."""

    def __init__(self, tool_names: Collection[str] | None = None):
        self._names = tool_names
        self._mode = "start"  # start, text, calls, whole (parsed at the end), plain (no calls: all is text)
        self._held = ""  # start / whole: all so far; text: trailing whitespace and a partial opener
        self._since_open = ""  # from the text dropped before the first opener on: sent if that is no call
        self._gap = ""  # between blocks: a tail that may become the next opener
        self._block: _Block | None = None
        self._out: list[Event] = []
        self._gemma4 = Gemma4Calls()  # Gemma 4's own call blocks, rewritten as Hermes ones as each closes
        self.started = 0

    # ------------------------------------------------------------------ feeding

    def push(self, text: str) -> list[Event]:
        """The events this piece of the answer makes certain."""
        self._feed(self._gemma4.push(text))
        return self._take()

    def finish(self) -> list[Event]:
        """The events still held, at the end of the answer."""
        self._feed(self._gemma4.finish())
        if self._mode in ("start", "whole"):
            content, calls = parse_tool_calls(self._held, self._names)
            if content:
                self._out.append(Text(content))
            for call in calls:
                self._start(call.name, call.id)
                self._out.append(CallArguments(self.started - 1, call.arguments))
                self._out.append(CallEnd(self.started - 1, call))
        elif self._mode == "text" and self._held:
            self._out.append(Text(self._held))
        elif self._mode == "calls" and self._block is not None:
            self._end_block()
        self._held = ""
        return self._take()

    def _feed(self, text: str) -> None:
        if self._mode == "start":  # the first text decides: a bare JSON or Mistral answer is parsed whole
            self._held += text
            head = self._held.lstrip()
            if head.startswith("{") or head.startswith(MISTRAL):
                self._mode = "whole"
                return
            if not head or MISTRAL.startswith(head):
                return
            self._mode, text, self._held = "text", self._held, ""
        if self._mode == "whole":
            self._held += text
        elif self._mode == "text":
            self._text(text)
        elif self._mode == "calls":
            if not self.started:
                self._since_open += text
            self._calls(text)
        elif self._mode == "plain":
            self._out.append(Text(text))

    def _text(self, text: str) -> None:
        buf = self._held + text
        at = buf.find(OPEN)
        if at >= 0:
            kept = buf[:at].rstrip()  # the parser strips the text before the calls
            if kept:
                self._out.append(Text(kept))
            self._mode, self._held, self._since_open = "calls", "", buf[len(kept):]
            self._block = _Block()
            self._calls(buf[at + len(OPEN):])
            return
        hold = partial_suffix(buf, OPEN)
        body = buf[:len(buf) - hold]
        kept = body.rstrip()  # whitespace waits: dropped if an opener comes next
        if kept:
            self._out.append(Text(kept))
        self._held = buf[len(kept):]

    def _calls(self, text: str) -> None:
        while text and self._mode == "calls":
            if self._block is None:  # between blocks: what is not an opener is dropped, as the parser skips it
                buf = self._gap + text
                at = buf.find(OPEN)
                if at < 0:
                    self._gap = buf[len(buf) - partial_suffix(buf, OPEN):]
                    return
                self._gap, self._block, text = "", _Block(), buf[at + len(OPEN):]
                continue
            text = self._block_text(text)

    def _block_text(self, text: str) -> str:
        """Read text into the open block; what follows its close is returned."""
        b = self._block
        b.raw += text
        at = b.raw.find(CLOSE, b.fed)
        end = at if at >= 0 else len(b.raw) - partial_suffix(b.raw, CLOSE)
        if end > b.fed:
            self._lex(b, b.raw[b.fed:end])
            b.fed = end
        if at < 0 or self._block is not b:  # no close yet, or the block turned the answer into plain text
            return ""
        rest, b.raw = b.raw[at + len(CLOSE):], b.raw[:at]
        self._end_block()
        return rest

    # ------------------------------------------------------------------ reading one call's JSON

    def _lex(self, b: _Block, text: str) -> None:
        if b.phase in ("end", "bad"):
            return  # past the object: whether the block is a call is decided at its end
        if b.phase == "open":
            text = text.lstrip()  # the parser strips the block
            if not text:
                return
            if text.startswith("<"):  # Qwen3.5's XML form: read whole at the block's close (_end_block)
                b.phase = "end"
                return
        try:
            tokens = b.lexer.feed(text)
        except JsonStreamError:
            return self._bad(b)
        for kind, value in tokens:
            self._token(b, kind, value)
            if b.phase in ("end", "bad") or self._mode != "calls":
                return

    def _token(self, b: _Block, kind: str, value: str) -> None:
        phase = b.phase
        if phase == "value":
            return self._value(b, kind, value)
        if phase == "open" and kind == "{":
            b.phase, b.depth = "key", 1
        elif phase == "key" and kind == STR_OPEN:
            b.phase, b.key = "keystr", ""
        elif phase in ("key", "after") and kind == "}":
            b.phase, b.depth = "end", 0
        elif phase == "keystr" and kind in (STR_PART, STR_CLOSE):
            b.key += value
            b.phase = "colon" if kind == STR_CLOSE else phase
        elif phase == "colon" and kind == ":":
            b.phase, b.role = "value", "skip"
            if b.key == "name" and b.name is None:
                b.role, b.name = "name", ""
            elif b.key in _ARGS and not b.args_seen:
                b.args_seen = True
                b.role = "args" if b.index is not None else "skip"  # no name yet: sent whole at the end
        elif phase == "after" and kind == ",":
            b.phase = "key"
        else:
            self._bad(b)

    def _value(self, b: _Block, kind: str, value: str) -> None:
        first = b.depth == 1 and not b.in_str
        if first and kind in ("}", "]", ":", ","):
            return self._bad(b)
        if b.role == "name":
            if kind not in (STR_OPEN, STR_PART, STR_CLOSE):
                return self._bad(b)  # the parser wants a string name
            b.name += value
            if kind == STR_CLOSE:
                if self._names is not None and b.name not in self._names:
                    return self._bad(b)
                b.index, b.call_id = self.started, new_call_id()
                self._start(b.name, b.call_id)
        elif b.role == "args":
            if first and kind == STR_OPEN:
                b.role = "skip"  # arguments as a JSON string: decoded at the end, sent whole
            else:
                piece = dumps([(kind, value)])
                b.args.append(piece)
                self._out.append(CallArguments(b.index, piece))
        b.in_str = (b.in_str or kind == STR_OPEN) and kind != STR_CLOSE
        b.depth += 1 if kind in ("{", "[") else -1 if kind in ("}", "]") else 0
        if b.depth == 1 and not b.in_str:
            b.phase = "after"

    def _bad(self, b: _Block) -> None:
        """This block is not a call. Before any call, the parser then reads the whole answer as text."""
        b.phase = "bad"
        if not self.started:
            self._mode, self._block = "plain", None
            self._out.append(Text(self._since_open))
            self._since_open = ""

    def _end_block(self) -> None:
        b, self._block = self._block, None
        if b.index is not None:  # started: end it, with its arguments if they could not stream
            if not b.args:
                call = read_call(_strip(b.raw), self._names)
                if call is not None:
                    b.args.append(call.arguments)
                    self._out.append(CallArguments(b.index, call.arguments))
            self._out.append(CallEnd(b.index, ToolCall(b.name, "".join(b.args), b.call_id)))
            return
        call = None if b.phase == "bad" else read_call(_strip(b.raw), self._names)
        if call is not None:  # a call whose arguments came before its name: sent whole now
            self._start(call.name, call.id)
            self._out.append(CallArguments(self.started - 1, call.arguments))
            self._out.append(CallEnd(self.started - 1, call))
        elif not self.started and self._mode == "calls":
            self._bad(b)

    def _start(self, name: str, call_id: str) -> None:
        self._out.append(CallStart(self.started, call_id, name))
        self.started += 1
        self._since_open = ""

    def _take(self) -> list[Event]:
        """The events made since the last call, neighbours of one kind joined (fewer chunks on the wire)."""
        out: list[Event] = []
        for e in self._out:
            if out and isinstance(e, Text) and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + e.text)
            elif out and isinstance(e, CallArguments) and isinstance(out[-1], CallArguments) \
                    and e.index == out[-1].index:
                out[-1] = CallArguments(e.index, out[-1].text + e.text)
            elif not (isinstance(e, Text) and not e.text):
                out.append(e)
        self._out = []
        return out


def _strip(raw: str) -> str:
    """The block as the parser's pattern reads it (`<tool_call>\\s*(.*?)\\s*</tool_call>`)."""
    return re.sub(r"\s+\Z", "", re.sub(r"\A\s+", "", raw))
