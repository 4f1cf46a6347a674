"""DRY ("don't repeat yourself"), llama.cpp's repetition penalty for whole sequences: a token that would continue
a run of tokens already seen earlier in the context is pushed down by multiplier * base^(run - allowed_length),
so verbatim loops die out while single repeated words (which repetition_penalty hits) go unpunished.

    Dry(tokenizer, multiplier, base, allowed_length, penalty_last_n, breakers)
    dry.penalties(history) -> {token id: amount to subtract from its logit}

As llama.cpp does it (src/llama-sampling.cpp, DRY, ported there from koboldcpp): the window is the last
penalty_last_n tokens of the context, prompt included (-1: all of it). A sequence breaker (a string, by default
newline, colon, double quote and asterisk) ends any run: a run cannot reach back past the latest breaker in the
window, and a token that is a breaker by itself is never penalized. A breaker string matches the tokens whose text
contains it, or a token whose text ends with the breaker's start followed by the tokens of the rest ("head" and
"tail"; tails cut to 20 tokens, breakers to 40 bytes, as llama.cpp cuts them). Run lengths come from a Z-function
over the reversed window (linear time, compiled: a window is the whole context).
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import numpy as np
from numba import njit

from engine.kernels import kernel_cache

kernel_cache.configure()  # numba's cache directory, set before the decorator below runs

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")
_MAX_BREAKER_BYTES = 40
_MAX_TAIL_TOKENS = 20
_FLOAT_MAX_LOG = 88.7228391  # log(float32 max): base^exponent is clamped below it, as llama.cpp clamps it


@njit(cache=True)
def reversed_z(window):
    """z[k] = how many tokens the window's last tokens and those ending k positions earlier have in common
    (z[0] = len): the Z-function of the reversed window."""
    n = window.shape[0]
    z = np.zeros(n, np.int64)
    if n == 0:
        return z
    z[0] = n
    lt, rt = 0, 0  # the Z-box [lt, rt]: r[lt..rt] == r[0..rt-lt], r the reversed window
    for k in range(1, n):
        m = 0
        if k <= rt:
            m = min(rt - k + 1, z[k - lt])
        while k + m < n and window[n - 1 - m] == window[n - 1 - m - k]:
            m += 1
        z[k] = m
        if k + m - 1 > rt:
            lt, rt = k, k + m - 1
    return z


class Dry:
    """One sequence's DRY settings, its breakers read against the model's vocabulary (once per tokenizer and
    breaker set: a pass over the vocabulary)."""

    def __init__(self, tokenizer, multiplier: float, base: float, allowed_length: int, penalty_last_n: int,
                 breakers: Sequence[str] = DEFAULT_BREAKERS):
        self.multiplier, self.base = float(multiplier), float(base)
        self.allowed_length, self.penalty_last_n = int(allowed_length), int(penalty_last_n)
        self.on = self.multiplier != 0.0 and self.base >= 1.0 and self.penalty_last_n != 0
        self._heads = restart_sequences(tokenizer, tuple(breakers)) if self.on else {}
        self._max_exponent = int(_FLOAT_MAX_LOG / math.log(self.base)) if self.base > 1.000001 else 0

    def penalties(self, history: Sequence[int]) -> dict[int, float]:
        """{token: penalty} for the next token after `history` (prompt and generated tokens, oldest first)."""
        if not self.on:
            return {}
        n = len(history) if self.penalty_last_n < 0 else min(len(history), self.penalty_last_n)
        if n <= self.allowed_length:
            return {}
        window = np.asarray(history[len(history) - n:], dtype=np.int64)
        limit = self._run_limit(window)
        if limit < self.allowed_length:
            return {}
        z = reversed_z(window)
        longest: dict[int, int] = {}
        for k in np.flatnonzero(z[1:] >= self.allowed_length) + 1:  # runs long enough to count
            run = min(int(z[k]), limit)
            if run < self.allowed_length:
                continue
            nxt = int(window[n - k])  # the token that followed that earlier run
            if longest.get(nxt, -1) < run:
                longest[nxt] = run
        out = {}
        for tok, run in longest.items():
            if () in self._heads.get(tok, ()):
                continue  # a breaker by itself is never penalized
            exponent = run - self.allowed_length
            if self._max_exponent > 0:
                exponent = min(exponent, self._max_exponent)
            out[tok] = self.multiplier * self.base ** exponent
        return out

    def _run_limit(self, window: np.ndarray) -> int:
        """How far back a run may reach: up to the end of the latest breaker in the window (all of it if none)."""
        n = len(window)
        for i in range(n):  # i tokens from the end
            tails = self._heads.get(int(window[n - 1 - i]))
            if not tails:
                continue
            longest = -1
            for tail in tails:
                if longest < len(tail) <= i and all(tail[j] == window[n - i + j] for j in range(len(tail))):
                    longest = len(tail)
            if longest >= 0:
                return i - longest
        return n


# (id of the tokenizer, breakers) -> (the tokenizer, its restart sequences): a few, newest last
_CACHE: dict[tuple[int, tuple[str, ...]], tuple[object, dict[int, set[tuple[int, ...]]]]] = {}
_CACHE_LOCK = threading.Lock()


def restart_sequences(tokenizer, breakers: tuple[str, ...]) -> dict[int, set[tuple[int, ...]]]:
    """{head token: its tails}: () for a token whose text holds a breaker; otherwise, for a token whose text ends
    with the start of a breaker, the tokens of the breaker's rest."""
    key = (id(tokenizer), breakers)
    with _CACHE_LOCK:
        if key in _CACHE and _CACHE[key][0] is tokenizer:
            return _CACHE[key][1]
    pieces = [tokenizer.piece_bytes(i) for i in range(tokenizer.vocab_size)]
    heads: dict[int, set[tuple[int, ...]]] = {}
    for breaker in breakers:
        b = breaker.encode("utf-8")[:_MAX_BREAKER_BYTES]
        if not b:
            continue
        for tok, word in enumerate(pieces):
            if b in word:
                heads.setdefault(tok, set()).add(())
                continue
            for cut in range(1, min(len(b), len(word) + 1)):  # the word ends with b[:cut]
                if word.endswith(b[:cut]):
                    rest = b[cut:].decode("utf-8", errors="ignore")
                    tail = tuple(tokenizer.encode(rest, add_bos=False, add_eos=False)[:_MAX_TAIL_TOKENS])
                    heads.setdefault(tok, set()).add(tail)
    with _CACHE_LOCK:
        _CACHE[key] = (tokenizer, heads)
        if len(_CACHE) > 8:
            _CACHE.pop(next(iter(_CACHE)))
    return heads
