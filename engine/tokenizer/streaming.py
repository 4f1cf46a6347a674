"""Incremental detokenizer: text that is safe to show after each generated token.

Tokens render to bytes (byte-fallback and byte-level tokens may carry a fraction of a character), so the
bytes go through an incremental UTF-8 decoder that holds back an incomplete trailing sequence until the
token that completes it arrives. SentencePiece's added leading space is dropped from the first text token
exactly as Tokenizer.decode drops it, so the pushes plus flush() equal decode() of the same ids.
"""

from __future__ import annotations

import codecs

from engine.tokenizer.gguf_tokenizer import Tokenizer


class IncrementalDecoder:
    """push(token_id) -> new text (never a broken UTF-8 sequence); flush() -> whatever is still held."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._head: list[int] = []  # the first two ids: all the leading-space rule looks at
        self._n = 0

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        index, self._n = self._n, self._n + 1
        if index < 2:
            self._head.append(token_id)
        piece = self._tok.piece_bytes(token_id, self._skip)
        if index < 2 and piece.startswith(b" ") and self._tok.strips_leading_space(self._head, index):
            piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Emit what is held back (an incomplete sequence becomes U+FFFD, as decode() renders it)."""
        return self._utf8.decode(b"", final=True)
