"""Generation: prefill the prompt, then decode token by token, as a generator of events.

Ends at an end-of-generation token (yielded last, with empty text), at a stop string (text cut
before it), or at max_tokens. Text is streamed through the incremental detokenizer and held back
while it could still be the start of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from engine import memory
from engine.errors import ContextOverflow, InvalidRequest
from engine.kernels.backend import KVCache
from engine.kernels.cpu import vmath
from engine.models.base import Model
from engine.sampling import Processor, SamplingParams, make_logits_processors, make_sampler
from engine.tokenizer import IncrementalDecoder


@dataclass
class TokenEvent:
    token: int
    text: str  # text this token adds for the user (control tokens and held-back text excluded)
    logprob: float | None  # log-probability of this token under the model (before sampling processors);
    # None under generate(logprobs=False)
    finish_reason: str | None = None  # "stop" (EOG or stop string) or "length" on the last event
    # the most likely tokens at this step as (id, logprob), best first; only when generate(top_logprobs=k)
    top_logprobs: list[tuple[int, float]] | None = None
    stop_sequence: str | None = None  # the stop string that ended generation, if one did


def generate(model: Model, prompt_ids: Sequence[int], max_tokens: int = 256, temperature: float = 0.0,
             seed: int | None = None, stop: str | Sequence[str] | None = None, *, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             logit_bias: dict[int, float] | None = None, cache: KVCache | None = None,
             top_logprobs: int = 0, logprobs: bool = True, on_prefill: Callable[[int], None] | None = None,
             processors: Sequence[Processor] = ()) -> Iterator[TokenEvent]:
    """Checks every argument now (raising InvalidRequest / ContextOverflow); the work starts at the first
    next(). `on_prefill(done)` is called after each prompt chunk (an exception it raises ends the run).
    `processors` run after the sampling ones (a grammar mask last); one with an `accept(token)` method is
    told each sampled token before the model evaluates it (so it can prepare the next step meanwhile).
    `logprobs=False` leaves each event's `.logprob` None and skips its normalizer (a pass over the vocabulary
    per token): what a caller that shows no log-probabilities passes. `cache` (default: a new one) may hold the
    prompt's first positions already (a warm session): those are not evaluated again."""
    window = cache.max_tokens if cache is not None else model.context_length
    gen = Generation(model, prompt_ids, max_tokens, window=window, temperature=temperature, seed=seed, stop=stop,
                     top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                     top_logprobs=top_logprobs, logprobs=logprobs, processors=processors)
    cache = cache if cache is not None else model.new_cache(gen.cache_tokens)
    return _run(model, gen, cache, on_prefill)


class Generation:
    """One sequence's decisions, token by token: given the model's logits after the latest token, `next` samples
    (processors, then the sampler), and says what the user sees (streamed text, held back while it could still
    start a stop string) and whether the sequence has ended. The model's passes are the caller's: `generate`
    runs one sequence, the scheduler many at once, and a sequence decides the same in both."""

    def __init__(self, model: Model, prompt_ids: Sequence[int], max_tokens: int, *, window: int,
                 temperature: float = 0.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None, top_logprobs: int = 0, logprobs: bool = True,
                 processors: Sequence[Processor] = ()):
        """Checks every argument (InvalidRequest, ContextOverflow); `window` is the most tokens the sequence may
        hold, prompt included."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, logit_bias=dict(logit_bias or {}))
        params.validate(model.vocab_size)
        self.prompt_ids = [int(t) for t in prompt_ids]
        if not self.prompt_ids:
            raise InvalidRequest("the prompt is empty (no tokens)")
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
        if not 0 <= top_logprobs <= model.vocab_size:
            raise InvalidRequest(f"top_logprobs must be in [0, {model.vocab_size}], got {top_logprobs}")
        if len(self.prompt_ids) >= window:
            raise ContextOverflow(f"the prompt has {len(self.prompt_ids)} tokens; the context window is {window}")
        # The sequence's cache holds the prompt and every generated token but the last (never evaluated).
        self.cache_tokens = min(window, len(self.prompt_ids) + max_tokens)
        self.max_tokens = self.cache_tokens - len(self.prompt_ids)
        self._stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        self._tok = model.tokenizer
        self._processors = make_logits_processors(params) + list(processors)
        self._accepts = [p.accept for p in self._processors if hasattr(p, "accept")]
        self._sampler = make_sampler(params)
        self._decoder = IncrementalDecoder(model.tokenizer, skip_special=True)
        self._top_logprobs = top_logprobs
        self._want_logprob = logprobs or top_logprobs > 0
        self._history = list(self.prompt_ids)
        self._pending = ""  # decoded text not yet shown: it may be the start of a stop string
        self.generated = 0
        self.finished = False

    def next(self, logits: np.ndarray) -> TokenEvent:
        """The next token from logits (vocab,), the model's output after the latest token; the event's
        finish_reason is set when this token ends the sequence (then `finished` is True)."""
        want_logprob, processors = self._want_logprob, self._processors
        # The normalizer is a pass over the vocabulary (0.35 ms a token on a 262k one): only when asked for.
        lse = _logsumexp(logits) if want_logprob else 0.0
        work = logits.copy() if want_logprob and processors else logits  # processors work in place
        for proc in processors:
            work = proc(work, self._history)
        token = self._sampler(work)
        self._history.append(token)
        self.generated += 1
        for accept in self._accepts:
            accept(token)
        lp = float(logits[token]) - lse if want_logprob else None
        top = top_logprobs_of(logits.astype(np.float64) - lse, self._top_logprobs) if self._top_logprobs else None
        ev = self._event(token, lp, top)
        self.finished = ev.finish_reason is not None
        return ev

    def _event(self, token: int, lp: float | None, top) -> TokenEvent:
        if token in self._tok.eog_ids:
            return TokenEvent(token, self._pending + self._decoder.flush(), lp, "stop", top)
        self._pending += self._decoder.push(token)
        pending, stops = self._pending, self._stops
        cut = _find_stop(pending, stops)
        if cut is not None:
            which = next(st for st in stops if pending.find(st) == cut)
            return TokenEvent(token, pending[:cut], lp, "stop", top, which)
        if self.generated == self.max_tokens:
            return TokenEvent(token, pending + self._decoder.flush(), lp, "length", top)
        safe = _safe_prefix_len(pending, stops)
        self._pending = pending[safe:]
        return TokenEvent(token, pending[:safe], lp, None, top)


def _run(model: Model, gen: Generation, cache: KVCache, on_prefill=None) -> Iterator[TokenEvent]:
    # A cache that already holds the prompt's first positions (a warm session, engine/sessions.py) goes on from
    # there.
    logits = model.prefill(gen.prompt_ids[cache.length :], cache, on_chunk=on_prefill)[0]
    yield from continue_from(model, gen, cache, logits)


def continue_from(model: Model, gen: Generation, cache: KVCache, logits: np.ndarray) -> Iterator[TokenEvent]:
    """The sequence's tokens from the logits (vocab,) after its prompt, which cache holds; one at a time."""
    try:
        while True:
            ev = gen.next(logits)
            yield ev
            if gen.finished:
                return
            logits = model.decode([ev.token], [cache])[0]
    finally:  # decode's freed logits stay in the heap for the next token (engine/memory.py); not after the last
        model.backend.end_sequences()
        memory.trim()


def _logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))): the normalizer of one row of logits (compiled: a 262k vocabulary each token)."""
    return float(vmath.logsumexp(np.ascontiguousarray(logits, np.float32)))


def top_logprobs_of(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely (id, logprob) of one row (vocab,), best first; ties by ascending id."""
    k = min(k, len(logprobs))
    ids = np.argpartition(-logprobs, k - 1)[:k]
    ids = ids[np.lexsort((ids, -logprobs[ids]))]
    return [(int(i), float(logprobs[i])) for i in ids]


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _safe_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the prefix of text that cannot be part of a stop string still to come."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold
