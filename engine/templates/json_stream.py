"""JSON read as it arrives, a piece at a time: tokens as soon as each is certain, and the text json.dumps writes
for them.

A tool call's arguments are sent as `json.dumps(json.loads(what the model wrote), ensure_ascii=False)`, which
differs from the model's text (spaces after `:` and `,`, escapes re-written, numbers normalised). Streaming
them piece by piece must join up to exactly that text, so each token is re-written the way json.dumps writes
it: strings as their characters arrive, numbers and literals once the next character ends them.

    lexer = JsonLexer(); tokens = lexer.feed('{"a":1'); dumps(tokens)  -> '{"a": '  (1 waits for its end)
"""

from __future__ import annotations

import json
import re
from json.encoder import encode_basestring  # what json.dumps(..., ensure_ascii=False) escapes strings with

STR_OPEN, STR_PART, STR_CLOSE, SCALAR = "s<", "s", "s>", "w"  # plus the punctuation itself: { } [ ] : ,

_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters that need no decoding
_WORD = re.compile(r"[A-Za-z0-9+\-.]+")  # numbers, true / false / null, and the NaN / Infinity json.loads takes
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = set("0123456789abcdefABCDEF")
_DUMPS = {"{": "{", "}": "}", "[": "[", "]": "]", ":": ": ", ",": ", ", STR_OPEN: '"', STR_CLOSE: '"'}


class JsonStreamError(ValueError):
    """The text is not JSON (json.loads would refuse it too)."""


class JsonLexer:
    """Turns JSON text, fed in any pieces, into (kind, value) tokens: punctuation, STR_OPEN / STR_PART (decoded
    characters) / STR_CLOSE, and SCALAR (a number or literal, already as json.dumps writes it). Structure is
    not checked here; a caller that cares follows the tokens."""

    def __init__(self):
        self._state = ""  # "" between tokens, "str", "esc" (after a backslash), "uni" (in \\uXXXX), "word"
        self._buf = ""  # the word or the \\u digits read so far
        self._high: int | None = None  # a high surrogate: joined with a low one if the next escape is one

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        i, n = 0, len(text)
        while i < n:
            state = self._state
            if state == "str":
                m = _PLAIN.match(text, i)
                if m:
                    self._part(out, m.group())
                    i = m.end()
                    continue
                c, i = text[i], i + 1
                if c == '"':
                    self._part(out, "")  # a pending surrogate stays alone, as json.loads leaves it
                    out.append((STR_CLOSE, ""))
                    self._state = ""
                elif c == "\\":
                    self._state = "esc"
                else:
                    raise JsonStreamError(f"control character {c!r} in a string")
            elif state == "esc":
                c, i = text[i], i + 1
                if c == "u":
                    self._state, self._buf = "uni", ""
                elif c in _ESCAPES:
                    self._part(out, _ESCAPES[c])
                    self._state = "str"
                else:
                    raise JsonStreamError(f"invalid escape \\{c}")
            elif state == "uni":
                take = text[i:i + 4 - len(self._buf)]
                if not set(take) <= _HEX:
                    raise JsonStreamError(f"invalid \\u escape \\u{self._buf + take}")
                self._buf, i = self._buf + take, i + len(take)
                if len(self._buf) == 4:
                    self._code(out, int(self._buf, 16))
                    self._state = "str"
            elif state == "word":
                m = _WORD.match(text, i)
                if m:
                    self._buf, i = self._buf + m.group(), m.end()
                if i < n:  # the next character ends the word
                    out.append(self._word())
            else:
                c = text[i]
                if c in " \t\n\r":
                    i += 1
                elif c in "{}[]:,":
                    out.append((c, ""))
                    i += 1
                elif c == '"':
                    out.append((STR_OPEN, ""))
                    self._state = "str"
                    i += 1
                elif _WORD.match(c):
                    self._state, self._buf = "word", ""
                else:
                    raise JsonStreamError(f"unexpected character {c!r}")
        return out

    def _word(self) -> tuple[str, str]:
        try:
            value = json.loads(self._buf)
        except ValueError:
            raise JsonStreamError(f"not a JSON value: {self._buf!r}") from None
        self._state, self._buf = "", ""
        return SCALAR, json.dumps(value)

    def _part(self, out: list, chars: str) -> None:
        if self._high is not None:
            chars, self._high = chr(self._high) + chars, None
        if not chars:
            return
        if out and out[-1][0] == STR_PART:
            out[-1] = (STR_PART, out[-1][1] + chars)
        else:
            out.append((STR_PART, chars))

    def _code(self, out: list, code: int) -> None:
        """One \\uXXXX escape; a surrogate pair becomes one character, as json.loads joins it."""
        if self._high is not None and 0xDC00 <= code <= 0xDFFF:
            high, self._high = self._high, None
            self._part(out, chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
        elif 0xD800 <= code <= 0xDBFF:
            self._part(out, "")
            self._high = code
        else:
            self._part(out, chr(code))


def dumps(tokens: list[tuple[str, str]]) -> str:
    """The text json.dumps (default separators, ensure_ascii=False) writes for these tokens."""
    return "".join(encode_basestring(v)[1:-1] if k == STR_PART else v if k == SCALAR else _DUMPS[k]
                   for k, v in tokens)
