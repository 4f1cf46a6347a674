"""How tokens are picked: the one record of a sequence's sampling settings, and the samplers and logits processors
built from it as plain callables.

`SamplingParams` is declared here and nowhere else: a request's settings become one (engine/requests/request.py,
`SamplingOptions.to_sampling_params`, after the request body, a runner's flags and the API defaults are merged)
and Generation / generate() take it whole (engine/generation/generate.py), as vLLM's SamplingParams and mlx-lm's
make_sampler are passed down.

A processor maps (logits (vocab,) f32, history: list[int]) -> logits; a sampler maps (logits, history) -> token id
and says, after a draw, what it drew from (`drawn(token, n)`: the candidates left, with their probabilities:
llama.cpp's post-sampling probabilities). Order follows llama.cpp's default chain: penalties and bias, then top-k,
top-p, min-p, temperature. A request that turns on one of llama.cpp's other samplers (typical_p, top_n_sigma, DRY, XTC,
dynamic temperature, mirostat) or reorders them gets llama.cpp's chain (sampler_chain.py) instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from engine.errors import InvalidRequest
from engine.generation.sampler_chain import ChainSampler, ChainSettings
from engine.kernels import nucleus, vmath

HEAP_MAX_K = 1024  # top-k selection by a compiled heap up to here (0.1 ms on 262k logits), argpartition above

Processor = Callable[[np.ndarray, list[int]], np.ndarray]


class Sampler(Protocol):
    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int: ...

    def drawn(self, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        """Of the last draw: token's probability, and the n likeliest candidates (id, probability), best first."""


@dataclass(frozen=True)
class SamplingParams:
    """One sequence's sampling settings; the defaults change nothing (greedy, every processor off)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # how many recent tokens the penalties look at (llama.cpp's default; -1: all, 0: none)
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)  # token id -> added to its logit
    chain: ChainSettings | None = None  # llama.cpp's other samplers and their order (None: none of them)

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", dict(self.logit_bias or {}))  # None reads as none; a copy of ours

    def validate(self, vocab_size: int) -> None:
        if not (self.temperature >= 0):
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0):
            raise InvalidRequest(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.penalty_last_n < -1:
            raise InvalidRequest(f"repeat_last_n must be >= -1 (-1: every token so far), got {self.penalty_last_n}")
        for tok in self.logit_bias:
            if not 0 <= int(tok) < vocab_size:
                raise InvalidRequest(f"logit_bias names token {tok}, outside the vocabulary of {vocab_size}")
        if self.chain is not None:
            self.chain.validate()

    @property
    def uses_chain(self) -> bool:
        return self.chain is not None and self.chain.needed


def make_logits_processors(p: SamplingParams) -> list[Processor]:
    procs: list[Processor] = []
    # (llama.cpp's chain applies the penalties itself, where its order puts them)
    if (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty) and not p.uses_chain:
        procs.append(_penalties(p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.penalty_last_n))
    if p.logit_bias:
        ids = np.array([int(k) for k in p.logit_bias], dtype=np.int64)
        vals = np.array(list(p.logit_bias.values()), dtype=np.float32)

        def bias(logits: np.ndarray, history: list[int]) -> np.ndarray:
            logits[ids] += vals
            return logits

        procs.append(bias)
    return procs


def _penalties(repeat: float, presence: float, frequency: float, last_n: int) -> Processor:
    def apply(logits: np.ndarray, history: list[int]) -> np.ndarray:
        recent = history[-last_n:] if last_n > 0 else history if last_n < 0 else []  # as llama.cpp's repeat_last_n
        if not recent:
            return logits
        ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        vals = logits[ids]
        if repeat != 1.0:  # CTRL-style: shrink positive logits, push negative ones further down
            vals = np.where(vals > 0, vals / repeat, vals * repeat)
        vals = vals - counts * np.float32(frequency) - np.float32(presence)
        logits[ids] = vals
        return logits

    return apply


def make_sampler(p: SamplingParams, tokenizer=None) -> Sampler:
    """The sampler for p: llama.cpp's chain where p asks for it (tokenizer: DRY reads its breakers with it), else
    goinfer's fast one."""
    return ChainSampler(p, tokenizer) if p.uses_chain else FastSampler(p)


class FastSampler:
    """Greedy, or a draw after top-k, top-p, min-p and temperature: the samplers most requests use, fast (compiled
    passes over the vocabulary; a sort of only the top-k set, or of the one value bucket the top-p cut and the draw
    land in: engine/kernels/nucleus.py). Draws are the inverse CDF over the kept tokens in rank order, seed for seed
    the draws of a sampler that sorts the whole vocabulary (tests/test_generate.py)."""

    def __init__(self, p: SamplingParams):
        self.p = p
        self.rng = np.random.default_rng(p.seed) if p.temperature > 0 else None
        self._last: tuple = ()

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p = self.p
        if p.temperature <= 0:
            token = int(np.argmax(logits))  # greedy; lowest id on ties
            self._last = ("one", token)
            return token
        row = np.ascontiguousarray(logits, dtype=np.float32)
        n = len(row)
        if not 0 < p.top_k < n and p.top_p >= 1.0 and p.min_p <= 0:
            # Every token is a candidate: one compiled pass, in id order (no sort of the vocabulary per token).
            self._last = ("all", row)
            return int(vmath.softmax_draw(row, np.float32(1.0 / p.temperature), self.rng.random()))
        if 0 < p.top_k < n:
            c, v = self._top_k_candidates(row)
            probs = _softmax(v / p.temperature)
            self._last = ("some", c, probs)
            return int(c[self.rng.choice(len(c), p=probs)])
        # top-p and/or min-p over the whole vocabulary: the kept set is every token ranked at or above a cut, found
        # and drawn from without sorting the vocabulary (engine/kernels/nucleus.py); one uniform per draw, as
        # Generator.choice takes.
        m, cut_value, cut_id = nucleus.nucleus_cut(row, p.top_p, p.min_p)
        if not m > -np.inf:  # every logit masked: the first token, as argmax would give
            self._last = ("one", 0)
            return 0
        inv_temp = 1.0 / p.temperature
        token, total = nucleus.draw_above(row, m, cut_value, cut_id, inv_temp, self.rng.random())
        self._last = ("cut", row, m, cut_value, cut_id, inv_temp, total)
        return int(token)

    def _top_k_candidates(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids top-k, then top-p and min-p over the top-k set, keep, and their logits (f64), most likely first."""
        p = self.p
        # Selection runs on the f32 logits (4x faster than on an f64 copy), the kept few in f64.
        k = p.top_k
        take = vmath.top_k_indices(row, k) if k <= HEAP_MAX_K else np.argpartition(-row, k - 1)[:k]
        cv = row[take].astype(np.float64)
        order = np.lexsort((take, -cv))  # descending logit, then ascending id: deterministic
        c, v = take[order], cv[order]
        e = np.exp(v - v[0])  # v[0] is the maximum
        probs = e / e.sum()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            c, v, probs = c[:cut], v[:cut], probs[:cut]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            c, v = c[keep], v[keep]
        return c, v

    def drawn(self, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        if self._last[0] == "one":
            return float(token == self._last[1]), [(self._last[1], 1.0)]
        if self._last[0] == "all":  # the whole vocabulary at the temperature
            v = self._last[1].astype(np.float64) / self.p.temperature
            lse = v.max() + np.log(np.exp(v - v.max()).sum())
            ids = np.argpartition(-v, n - 1)[:n] if 0 < n < len(v) else np.arange(len(v) if n else 0)
            ids = ids[np.lexsort((ids, -v[ids]))]
            return float(np.exp(v[token] - lse)), [(int(i), float(np.exp(v[i] - lse))) for i in ids]
        if self._last[0] == "cut":
            _, row, m, cut_value, cut_id, inv_temp, total = self._last
            best = vmath.top_k_indices(row, min(n, len(row))) if n else np.zeros(0, np.int64)
            best = best[np.lexsort((best, -row[best]))]
            best = best[(row[best] > cut_value) | ((row[best] == cut_value) & (best <= cut_id))]

            def prob(i: int) -> float:
                return math.exp((float(row[i]) - m) * inv_temp) / total

            kept = row[token] > cut_value or (row[token] == cut_value and token <= cut_id)
            return (prob(token) if kept else 0.0), [(int(i), prob(int(i))) for i in best]
        _, c, probs = self._last
        hit = np.flatnonzero(c == token)
        return (float(probs[hit[0]]) if len(hit) else 0.0), [(int(t), float(q)) for t, q in zip(c[:n], probs[:n])]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
