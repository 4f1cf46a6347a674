"""Samplers and logits processors as plain callables.

A processor maps (logits (vocab,) f32, history: list[int]) -> logits; a sampler maps logits -> token id.
Order follows llama.cpp's default chain: penalties and bias, then top-k, top-p, min-p, temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine.errors import InvalidRequest

Processor = Callable[[np.ndarray, list[int]], np.ndarray]
Sampler = Callable[[np.ndarray], int]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # how many recent tokens the penalties look at (llama.cpp's default)
    logit_bias: dict[int, float] = field(default_factory=dict)

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
        for tok in self.logit_bias:
            if not 0 <= int(tok) < vocab_size:
                raise InvalidRequest(f"logit_bias names token {tok}, outside the vocabulary of {vocab_size}")


def make_logits_processors(p: SamplingParams) -> list[Processor]:
    procs: list[Processor] = []
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
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
        recent = history[-last_n:] if last_n > 0 else history
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


def make_sampler(p: SamplingParams) -> Sampler:
    if p.temperature <= 0:
        return lambda logits: int(np.argmax(logits))  # greedy; lowest id on ties
    rng = np.random.default_rng(p.seed)

    def sample(logits: np.ndarray) -> int:
        cand = np.arange(len(logits))
        vals = logits.astype(np.float64)
        if 0 < p.top_k < len(vals):
            keep = np.argpartition(-vals, p.top_k - 1)[: p.top_k]
            cand, vals = cand[keep], vals[keep]
        order = np.lexsort((cand, -vals))  # descending logit, then ascending id: deterministic
        cand, vals = cand[order], vals[order]
        probs = _softmax(vals)
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            cand, vals = cand[:cut], vals[:cut]
            probs = _softmax(vals)
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            cand, vals = cand[keep], vals[keep]
        probs = _softmax(vals / p.temperature)
        return int(cand[rng.choice(len(cand), p=probs)])

    return sample


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
