"""llama.cpp's sampler chain, for the samplers goinfer's fast path does not have: typical_p, top_n_sigma, DRY,
XTC, dynamic temperature, mirostat 1 and 2, min_keep, and the chain in any order (llama.cpp's `samplers`).

    ChainSettings(...)              what a request asks of the chain beyond SamplingParams' own fields
    ChainSampler(params, tokenizer) sampler(logits, history) -> token id; .drawn(token, n): what it drew from

Each step works on the candidates left by the one before (ids and float32 logits), as llama.cpp's do
(src/llama-sampling.cpp): the same tests, the same order of operations, the same ties (here: by ascending id).
Candidates whose logit is -inf (a grammar's mask, top_n_sigma's cut) are dropped: they can never be drawn. The
random draws are numpy's, seeded by the request's seed, not llama.cpp's mt19937: the same distributions, not the
same tokens. sampling.make_sampler picks this chain only when a request turns one of these on; goinfer's
compiled fast path (sampling.py) serves every other request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Sequence

import numpy as np

from engine.errors import InvalidRequest
from engine.generation.dry import DEFAULT_BREAKERS, Dry
from engine.kernels import vmath

if TYPE_CHECKING:
    from engine.generation.sampling import SamplingParams

# llama.cpp's default chain: the order goinfer's fast path also follows
DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_MIROSTAT_M = 100  # tokens mirostat 1 estimates the distribution's shape from (llama.cpp's m)
HEAP_MAX_K = 1024  # the k best by a compiled heap up to here, argpartition above (as sampling.py's fast path)


@dataclass(frozen=True)
class ChainSettings:
    """The chain's own settings; the defaults turn each of its samplers off and keep llama.cpp's default order."""

    order: tuple[str, ...] = DEFAULT_ORDER
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 1 or 2: replaces the whole chain (temperature, then mirostat)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0  # the fewest candidates top_p, min_p, typical_p and XTC leave
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS

    @property
    def needed(self) -> bool:
        """Whether these ask for more than the fast path does: a sampler of the chain's own turned on, min_keep,
        or an order other than the default one (samplers may be left out of it: their settings turn them off)."""
        return (self.typical_p < 1.0 or self.top_n_sigma > 0 or self.xtc_probability > 0 or self.dynatemp_range > 0
                or self.mirostat != 0 or self.dry_multiplier != 0 or self.min_keep > 0
                or not _is_default_subsequence(self.order))

    def validate(self) -> None:
        unknown = [s for s in self.order if s not in DEFAULT_ORDER]
        if unknown or len(set(self.order)) != len(self.order):
            raise InvalidRequest(f"samplers: each of {', '.join(DEFAULT_ORDER)} at most once (got {list(self.order)})")
        checks = [(self.mirostat in (0, 1, 2), "mirostat must be 0, 1 or 2"),
                  (self.min_keep >= 0, "min_keep must be >= 0"),
                  (self.dry_base >= 1, "dry_base must be >= 1"),
                  (self.dry_allowed_length >= 0, "dry_allowed_length must be >= 0"),
                  (self.dry_penalty_last_n >= -1, "dry_penalty_last_n must be >= -1 (-1: the whole context)"),
                  (bool(self.dry_sequence_breakers), "dry_sequence_breakers must be a non-empty array of strings"),
                  (self.dynatemp_range >= 0, "dynatemp_range must be >= 0"),
                  (self.mirostat_tau >= 0 and self.mirostat_eta >= 0, "mirostat_tau and mirostat_eta must be >= 0")]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequest(f"{f.name} must be a finite number")


def _is_default_subsequence(order: Sequence[str]) -> bool:
    at = [DEFAULT_ORDER.index(s) for s in order if s in DEFAULT_ORDER]
    return len(at) == len(order) and at == sorted(at)


class ChainSampler:
    """One sequence's chain: stateful where llama.cpp's is (mirostat's mu, the random generator)."""

    def __init__(self, p: SamplingParams, tokenizer=None):
        self.p, self.c = p, p.chain or ChainSettings()
        self.rng = np.random.default_rng(p.seed)
        self.mu = 2.0 * self.c.mirostat_tau
        order = self.c.order
        # Penalties a chain leaves unnamed still apply, first (older chains never named them).
        self.steps = order if "penalties" in order else ("penalties",) + tuple(order)
        c = self.c
        self.dry = Dry(tokenizer, c.dry_multiplier, c.dry_base, c.dry_allowed_length, c.dry_penalty_last_n,
                       c.dry_sequence_breakers) if c.dry_multiplier != 0 and "dry" in order else None
        self._last: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0))

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        row = np.asarray(logits, np.float32)
        finite = np.isfinite(row)
        if finite.all():
            cand = _Candidates(np.arange(len(row)), row.copy())  # (the steps change logits in place)
        elif finite.any():
            ids = np.flatnonzero(finite)
            cand = _Candidates(ids, row[ids])
        else:  # every token masked: nothing to weigh (the first of the vocabulary, as argmax gives)
            self._last = (np.zeros(1, np.int64), np.ones(1))
            return 0
        if self.c.mirostat:  # llama.cpp's mirostat chain: logit bias, temperature, mirostat (no penalties)
            _temperature(cand, self.p.temperature)
            return self._mirostat(cand, len(logits))
        for step in self.steps:
            getattr(self, "_" + step)(cand, history)
        probs = cand.probs()
        i = int(self.rng.choice(len(probs), p=probs)) if len(probs) > 1 else 0
        self._last = (cand.ids, probs)
        return int(cand.ids[i])

    def drawn(self, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        """Of the last draw: token's probability after the whole chain, and the n likeliest candidates left (id,
        probability), best first (llama.cpp's post-sampling probabilities)."""
        ids, probs = self._last
        hit = np.flatnonzero(ids == token)
        order = np.lexsort((ids, -probs))[:n]
        return (float(probs[hit[0]]) if len(hit) else 0.0), [(int(ids[i]), float(probs[i])) for i in order]

    # ------------------------------------------------------------------ the steps, in llama.cpp's terms
    def _penalties(self, cand: _Candidates, history: Sequence[int]) -> None:
        p = self.p
        if not (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty) or p.penalty_last_n == 0:
            return
        recent = history[-p.penalty_last_n:] if p.penalty_last_n > 0 else history
        if not len(recent):
            return
        toks, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        at, found = cand.positions(toks)
        v = cand.logits[at]
        v = np.where(v <= 0, v * p.repetition_penalty, v / p.repetition_penalty)
        cand.logits[at] = v - counts[found] * p.frequency_penalty - p.presence_penalty

    def _dry(self, cand: _Candidates, history: Sequence[int]) -> None:
        if self.dry is None:
            return
        pens = self.dry.penalties(history)
        if pens:
            toks = np.fromiter(pens, np.int64, len(pens))
            at, found = cand.positions(toks)
            cand.logits[at] -= np.array(list(pens.values()))[found]

    def _top_n_sigma(self, cand: _Candidates, history) -> None:
        n = self.c.top_n_sigma
        if n <= 0 or cand.size <= 1:
            return
        v = cand.logits
        cand.keep(v >= v.max() - n * v.std())  # population std over the finite logits, as llama.cpp's

    def _top_k(self, cand: _Candidates, history) -> None:
        if self.p.top_k > 0:
            cand.top(self.p.top_k)

    def _typ_p(self, cand: _Candidates, history) -> None:
        if self.c.typical_p >= 1.0:
            return
        probs = cand.probs()
        with np.errstate(divide="ignore"):
            logp = np.log(probs)
        entropy = -np.sum(probs * np.where(probs > 0, logp, 0.0))
        # Most typical first (the shifted score |-log p - entropy| ascending), found as top_p finds the nucleus:
        # only as many of the most typical as the mass needs are sorted, growing the set until it holds them.
        shifted = np.abs(-logp - entropy)
        k = 256
        while True:
            at = np.argpartition(shifted, k - 1)[:k] if k < cand.size else np.arange(cand.size)
            order = at[np.lexsort((cand.ids[at], shifted[at]))]
            cum = np.cumsum(probs[order])
            hits = np.flatnonzero((cum > self.c.typical_p) & (np.arange(1, len(order) + 1) >= self.c.min_keep))
            if len(hits) or len(order) == cand.size:
                cand.take(order[:int(hits[0]) + 1] if len(hits) else order, sorted_=False)
                return
            k *= 4

    def _top_p(self, cand: _Candidates, history) -> None:
        if self.p.top_p >= 1.0:
            return
        probs = cand.probs()  # over every candidate; only as many of the best as the nucleus needs are sorted
        k = 64
        while True:
            best = cand.best(k)
            cum = np.cumsum(probs[best])
            hits = np.flatnonzero((cum >= self.p.top_p) & (np.arange(1, len(best) + 1) >= self.c.min_keep))
            if len(hits) or len(best) == cand.size:
                cand.take(best[:int(hits[0]) + 1] if len(hits) else best, sorted_=True)
                return
            k *= 4

    def _min_p(self, cand: _Candidates, history) -> None:
        if self.p.min_p <= 0 or not cand.size:
            return
        keep = cand.logits >= cand.logits.max() + math.log(self.p.min_p)
        if keep.sum() >= max(self.c.min_keep, 1):
            cand.keep(keep)
        else:
            cand.top(max(int(keep.sum()), self.c.min_keep, 1))

    def _xtc(self, cand: _Candidates, history) -> None:
        c = self.c
        if c.xtc_probability <= 0 or c.xtc_threshold > 0.5 or cand.size < 2:
            return
        if self.rng.random() > c.xtc_probability:
            return
        probs = cand.probs()
        above = np.flatnonzero(probs >= c.xtc_threshold)  # (the likeliest few: sorted, they lead)
        if len(above) < 2 or cand.size - (len(above) - 1) < c.min_keep:
            return
        stays = above[np.lexsort((-cand.ids[above], probs[above]))[0]]  # the least likely of them (last in order)
        drop = np.zeros(cand.size, bool)
        drop[above] = True
        drop[stays] = False
        cand.keep(~drop)

    def _temperature(self, cand: _Candidates, history) -> None:
        c, t = self.c, self.p.temperature
        if c.dynatemp_range > 0:
            if cand.size <= 1:
                return
            low, high = max(0.0, t - c.dynatemp_range), t + c.dynatemp_range
            probs = cand.probs()
            entropy = -np.sum(probs[probs > 0] * np.log(probs[probs > 0]))
            t = low + (high - low) * (entropy / math.log(cand.size)) ** c.dynatemp_exponent
        _temperature(cand, t)

    def _mirostat(self, cand: _Candidates, n_vocab: int) -> int:
        c = self.c
        probs = cand.probs()
        if c.mirostat == 1 and cand.size > 1:  # Zipf's exponent from the best 100, then top-k by it
            m = min(_MIROSTAT_M - 1, cand.size - 1)
            best = probs[cand.best(m + 1)]
            t = np.log(np.arange(2, m + 2) / np.arange(1, m + 1))
            with np.errstate(all="ignore"):
                b = np.log(best[:m] / best[1:m + 1])
                s_hat = float(np.sum(t * b) / np.sum(t * t))
                eps = s_hat - 1
                k = (eps * 2.0 ** self.mu / (1 - n_vocab ** -eps)) ** (1 / s_hat)
            cand.top(max(int(k), 1) if math.isfinite(k) else cand.size)
        elif c.mirostat == 2:  # the tokens whose surprise is at most mu (a prefix of the sorted ones), at least one
            with np.errstate(divide="ignore"):
                keep = -np.log2(probs) <= self.mu
            if keep.any():
                cand.keep(keep)
            else:
                cand.top(1)
        probs = cand.probs()
        i = int(self.rng.choice(len(probs), p=probs)) if len(probs) > 1 else 0
        self.mu -= c.mirostat_eta * (-math.log2(probs[i]) - c.mirostat_tau)
        self._last = (cand.ids, probs)
        return int(cand.ids[i])


def _temperature(cand: _Candidates, t: float) -> None:
    """Divide by t; t <= 0 keeps only the likeliest (the first of equals in the current order)."""
    if t <= 0:
        cand.take(np.array([int(np.argmax(cand.logits))]), sorted_=True)
    else:
        cand.logits /= t


class _Candidates:
    """The candidates a step sees: token ids and their logits, sorted (by logit, then id) when `sorted`."""

    def __init__(self, ids: np.ndarray, logits: np.ndarray):
        self.ids, self.logits, self.sorted = ids, logits, False
        self.by_id = True  # ids ascending (as they start): found by binary search without a sort

    @property
    def size(self) -> int:
        return len(self.ids)

    def best(self, k: int) -> np.ndarray:
        """Where the k best are (by logit, then id), best first: a partial selection, then a sort of those k."""
        if self.sorted:
            return np.arange(min(k, self.size))
        if k >= self.size:
            at = np.arange(self.size)
        elif k <= HEAP_MAX_K:  # a compiled heap: 0.1 ms on 152k logits, where argpartition took 3.5
            at = vmath.top_k_indices(np.ascontiguousarray(self.logits), k)
        else:
            at = np.argpartition(-self.logits, k - 1)[:k]
        return at[np.lexsort((self.ids[at], -self.logits[at]))]

    def top(self, k: int) -> None:
        """Keep the k best, sorted."""
        self.take(self.best(k), sorted_=True)

    def take(self, at: np.ndarray, sorted_: bool) -> None:
        self.ids, self.logits, self.sorted, self.by_id = self.ids[at], self.logits[at], sorted_, len(at) <= 1

    def keep(self, mask: np.ndarray) -> None:
        self.ids, self.logits = self.ids[mask], self.logits[mask]

    def probs(self) -> np.ndarray:
        """The candidates' softmax, in float64 (logits are float32, as the model's and llama.cpp's are)."""
        e = np.exp(self.logits - self.logits.max(), dtype=np.float64)
        return e / e.sum()

    def positions(self, toks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(where each of toks that is a candidate sits, which of toks those are)."""
        if not self.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        order = np.arange(self.size) if self.by_id else np.argsort(self.ids)
        at = np.minimum(np.searchsorted(self.ids, toks, sorter=None if self.by_id else order), self.size - 1)
        found = np.flatnonzero(self.ids[order[at]] == toks)
        return order[at[found]], found
