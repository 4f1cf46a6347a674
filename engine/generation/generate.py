"""Generation: prefill the prompt, then decode token by token, as a generator of events.

Ends at an end-of-generation token (yielded last, with empty text), at a stop string (text cut
before it), or at max_tokens. Text is streamed through the incremental detokenizer and held back
while it could still be the start of a stop string.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from engine.kernels import memory
from engine.errors import ContextOverflow, InvalidRequest
from engine.kernels.backend import KVCache
from engine.kernels import vmath
from engine.models.base import Model
from engine.thinking.budget import thinking_budget
from engine.thinking.plan import ThinkingPlan
from engine.thinking.stream import splitter
from engine.generation.sampling import Processor, SamplingParams, make_logits_processors, make_sampler
from engine.generation.speculation import Speculation
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
    reasoning: str = ""  # thinking text this token adds (a reply split by a ThinkingPlan); `text` is the answer
    thinking: bool = False  # the token was generated inside the thinking block (a reasoning token)


def generate(model: Model, prompt_ids: Sequence[int], max_tokens: int = 256, *, sampling: SamplingParams | None = None,
             stop: str | Sequence[str] | None = None, cache: KVCache | None = None, top_logprobs: int = 0,
             logprobs: bool = True, on_prefill: Callable[[int], None] | None = None,
             processors: Sequence[Processor] = (), thinking: ThinkingPlan | None = None,
             speculation: Speculation | None = None, **settings) -> Iterator[TokenEvent]:
    """Checks every argument now (raising InvalidRequest / ContextOverflow); the work starts at the first
    next(). `sampling` says how tokens are picked (engine/generation/sampling.py; default: greedy); a caller that
    builds none may name its fields as keywords instead (temperature=0.7, seed=1, top_p=0.9, ...), not both.
    `on_prefill(done)` is called after each prompt chunk (an exception it raises ends the run).
    `processors` run after the sampling ones (a grammar mask last); one with an `accept(token)` method is
    told each sampled token before the model evaluates it (so it can prepare the next step meanwhile).
    `logprobs=False` leaves each event's `.logprob` None and skips its normalizer (a pass over the vocabulary
    per token): what a caller that shows no log-probabilities passes. `cache` (default: a new one) may hold the
    prompt's first positions already (a warm session): those are not evaluated again. `thinking` splits a
    thinking reply: each event's `reasoning` apart from its `text` (stop strings match the answer only), with the
    reasoning budget forced (engine/thinking/budget.py). `speculation` drafts tokens by prompt lookup and checks them
    several a step (engine/generation/speculation.py): the same tokens, sooner where the reply repeats its context."""
    if settings and sampling is not None:
        raise TypeError(f"generate: pass sampling= or its fields ({', '.join(settings)}), not both")
    if settings:
        sampling = SamplingParams(**settings)  # an unknown name is a TypeError, as for any function
    window = cache.max_tokens if cache is not None else model.context_length
    gen = Generation(model, prompt_ids, max_tokens, window=window, sampling=sampling, stop=stop,
                     top_logprobs=top_logprobs, logprobs=logprobs, processors=processors, thinking=thinking)
    cache = cache if cache is not None else model.new_cache(gen.cache_tokens)
    return run_generation(model, gen, cache, on_prefill, speculation)


class Generation:
    """One sequence's decisions, token by token: given the model's logits after the latest token, `next` samples
    (processors, then the sampler), and says what the user sees (streamed text, held back while it could still
    start a stop string) and whether the sequence has ended. The model's passes are the caller's: `generate`
    runs one sequence, the scheduler many at once, and a sequence decides the same in both."""

    def __init__(self, model: Model, prompt_ids: Sequence[int], max_tokens: int, *, window: int,
                 sampling: SamplingParams | None = None, stop: str | Sequence[str] | None = None,
                 top_logprobs: int = 0, logprobs: bool = True, processors: Sequence[Processor] = (),
                 thinking: ThinkingPlan | None = None, post_sampling: bool = False):
        """Checks every argument (InvalidRequest, ContextOverflow); `window` is the most tokens the sequence may
        hold, prompt included; `sampling` (default: greedy) how its tokens are picked. post_sampling: an event's
        logprob and top_logprobs are those of the distribution the token was drawn from, after every sampler
        (llama.cpp's post_sampling_probs; log 0 = -inf for a token they cut), not the model's."""
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.sampling.validate(model.vocab_size)
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
        self._processors = make_logits_processors(self.sampling) + list(processors)
        self._accepts = [p.accept for p in self._processors if hasattr(p, "accept")]
        self._sampler = make_sampler(self.sampling, model.tokenizer)
        self._post_sampling = post_sampling
        self._decoder = IncrementalDecoder(model.tokenizer, skip_special=True)
        self._top_logprobs = top_logprobs
        self._want_logprob = logprobs or top_logprobs > 0
        self._history = list(self.prompt_ids)
        self._pending = ""  # decoded text not yet shown: it may be the start of a stop string
        self.generated = 0
        self.finished = False
        # A thinking reply: its text split as it comes, and the budget after which the close is forced.
        self._plan = thinking
        self._split = splitter(thinking) if thinking else None
        self._budget = thinking_budget(self._plan, self.max_tokens) if self._plan else None
        self._forcing: list[int] = []  # the rest of a close of several tokens being forced
        self.thought_tokens = 0  # tokens generated inside the thinking block (what the budget counts)

    def end_reasoning(self) -> bool:
        """Close the thinking at the next token, as a spent budget would (a client's request, from any thread:
        the next `next` reads it). False where there is nothing to close (not a thinking reply, or past it)."""
        if self._plan is None or not self._plan.close_tokens or not self._split.thinking or self.finished:
            return False
        self._budget = 0
        return True

    @property
    def processors(self) -> list[Processor]:
        """The logits processors of this sequence (sampling ones, then a grammar's)."""
        return self._processors

    @property
    def splits(self) -> bool:
        """The reply is split into reasoning and answer (reasoning_format none keeps the raw text)."""
        return self._plan is not None and self._plan.splits

    def next(self, logits: np.ndarray) -> TokenEvent:
        """The next token from logits (vocab,), the model's output after the latest token; the event's
        finish_reason is set when this token ends the sequence (then `finished` is True)."""
        want_logprob, processors = self._want_logprob, self._processors
        # The normalizer is a pass over the vocabulary (0.35 ms a token on a 262k one): only when asked for.
        lse = _logsumexp(logits) if want_logprob else 0.0
        work = logits.copy() if want_logprob and processors else logits  # processors work in place
        if not self._forcing and self._budget is not None and self._split.can_close and \
                self.thought_tokens >= self._budget:
            self._forcing = list(self._plan.close_tokens)  # the budget is spent: the block closes, the answer follows
        forced = bool(self._forcing)
        if forced:
            token = self._forcing.pop(0)
        else:
            for proc in processors:
                work = proc(work, self._history)
            token = self._sampler(work, self._history)
        self._history.append(token)
        self.generated += 1
        for accept in self._accepts:
            accept(token)
        if self._post_sampling and want_logprob:
            lp, top = self._drawn_from(token, forced)
        else:
            lp = float(logits[token]) - lse if want_logprob else None
            top = top_logprobs_of(logits.astype(np.float64) - lse, self._top_logprobs) if self._top_logprobs else None
        was_thinking = self._split is not None and self._split.thinking
        ev = self._event(token, lp, top)
        if self._split is not None and (was_thinking or self._split.thinking):
            ev.thinking = True  # the open and close delimiters count as reasoning tokens too
            self.thought_tokens += self._split.thinking
        self.finished = ev.finish_reason is not None
        return ev

    def _drawn_from(self, token: int, forced: bool) -> tuple[float, list[tuple[int, float]] | None]:
        """(log p of token, the top_logprobs likeliest as (id, log p)) in the distribution it was drawn from; a
        forced token (a thinking block's close) was certain."""
        prob, cands = (1.0, [(token, 1.0)]) if forced else self._sampler.drawn(token, self._top_logprobs)
        top = [(t, math.log(q) if q > 0 else -math.inf) for t, q in cands[:self._top_logprobs]]
        return (math.log(prob) if prob > 0 else -math.inf), (top if self._top_logprobs else None)

    def _event(self, token: int, lp: float | None, top) -> TokenEvent:
        eog = token in self._tok.eog_ids
        last = eog or self.generated == self.max_tokens
        text = "" if eog else self._decoder.push(token)
        if last:
            text += self._decoder.flush()
        reasoning, answer = self._route(text, last)
        pending, stops = self._pending + answer, self._stops
        if eog:
            return TokenEvent(token, pending, lp, "stop", top, reasoning=reasoning)
        cut = _find_stop(pending, stops)
        if cut is not None:
            which = next(st for st in stops if pending.find(st) == cut)
            return TokenEvent(token, pending[:cut], lp, "stop", top, which, reasoning)
        if last:
            return TokenEvent(token, pending, lp, "length", top, reasoning=reasoning)
        safe = _safe_prefix_len(pending, stops)
        self._pending = pending[safe:]
        return TokenEvent(token, pending[:safe], lp, None, top, reasoning=reasoning)

    def _route(self, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, answer) of a token's text. The splitter runs whatever the format (it tells the budget when
        the block is open); none and deepseek-legacy answer with the raw text, none with no reasoning apart."""
        if self._split is None:
            return "", text
        reasoning, answer = self._split.push(text)
        if last:
            more = self._split.flush()
            reasoning, answer = reasoning + more[0], answer + more[1]
        fmt = self._plan.format
        if fmt in ("none", "deepseek-legacy"):
            return ("" if fmt == "none" else reasoning), text
        return reasoning, answer


def run_generation(model: Model, gen: Generation, cache: KVCache, on_prefill: Callable[[int], None] | None = None,
                   speculation: Speculation | None = None) -> Iterator[TokenEvent]:
    """The sequence's tokens, its prompt evaluated into cache first. A cache that already holds the prompt's first
    positions (a warm session, engine/sessions/pool.py) goes on from there."""
    logits = model.prefill(gen.prompt_ids[cache.length :], cache, on_chunk=on_prefill)[0]
    yield from continue_from(model, gen, cache, logits, speculation)


def continue_from(model: Model, gen: Generation, cache: KVCache, logits: np.ndarray,
                  speculation: Speculation | None = None) -> Iterator[TokenEvent]:
    """The sequence's tokens from the logits (vocab,) after its prompt, which cache holds; with a speculation,
    several a step where its drafts guess right (engine/generation/speculation.py), the same tokens either way."""
    drafter = speculation.drafter(gen.prompt_ids) if speculation is not None and model.runs_on(cache) else None
    rows, run = [logits], []  # the rows to decide from, and the run of tokens they came from (none: the prompt)
    try:
        while True:
            for j, row in enumerate(rows):  # a run's rows, until the sequence decides other than its draft
                ev = gen.next(row)
                if drafter is not None:
                    drafter.push(ev.token)
                if gen.finished or j + 1 == len(rows) or ev.token != run[j + 1]:
                    break
                yield ev
            if len(rows) > 1:  # the rows after the one decided from are dropped
                cache.truncate(cache.length - len(rows) + j + 1)
                drafter.verified(len(rows) - 1, j)
            yield ev
            if gen.finished:
                return
            run = [ev.token] + (drafter.draft(draft_room(gen, cache)) if drafter is not None else [])
            rows = model.decode_runs([run], [cache])[0]
    finally:  # decode's freed logits stay in the heap for the next token (engine/kernels/memory.py); not after the last
        model.backend.end_sequences()
        memory.trim()


def draft_room(gen: Generation, cache: KVCache) -> int:
    """The most draft tokens worth checking after the sequence's latest token: each must fit its reply's
    max_tokens and its cache."""
    return min(gen.max_tokens - gen.generated, cache.max_tokens - cache.length) - 1


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
