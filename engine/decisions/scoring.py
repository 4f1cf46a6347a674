"""Label scoring: each question's options' probabilities from one prefill, no decode.

For a question, the model's next-token logits at the answer position, read at its options' label tokens (see
requests/prompts.py) and renormalised over them: p_i = softmax(z_label_i / T) over the options (the full vocabulary's
normaliser cancels), T a kind's fitted temperature (1 when not calibrated).

A request's questions share their prompts' leading tokens (the state comes first): that prefix is prefilled once
and each question continues from a copy of its cache. The prefix is cut at a whole number of the prompt tiles
that make a position's numbers independent of how its prompt was split (kernels/backend.py, PROMPT_TILE), so a
shared-state answer is the one a cold prefill of the whole question gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.api.decisions import DecisionRequest
from engine.decisions.prompts import Prompt, question_prompt
from engine.errors import ContextOverflow, UnsupportedModel
from engine.kernels.backend import PROMPT_TILE
from engine.models.base import Model

__all__ = ["Scored", "score_request", "shared_prefix"]


@dataclass
class Scored:
    probabilities: dict[str, list[float]]  # question name -> options' probabilities, in option order
    label_logits: dict[str, np.ndarray]  # question name -> raw logits of its labels (what calibration fits)
    input_tokens: int  # tokens prefilled: the shared prefix once, then each question's own


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares and can be prefilled once: whole prompt tiles, and at least
    one token of each prompt left to prefill (the answer position's logits come from its own pass)."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n - n % PROMPT_TILE


def softmax(z: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(z, np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def score_request(model: Model, req: DecisionRequest, template: str, *, temperatures: dict[str, float] | None = None,
                  share_state: bool = True, window: int | None = None) -> Scored:
    """Every question of req scored on model. share_state=False prefills each question whole (the reference
    the shared path is tested against)."""
    prompts: list[Prompt] = [question_prompt(model, template, req.state, q) for q in req.questions]
    limit = window or model.context_length
    for q, p in zip(req.questions, prompts):
        if len(p.ids) > limit:
            raise ContextOverflow(f"question {q.name!r}: its prompt is {len(p.ids)} tokens, over the model's "
                                  f"{limit}-token context")
        if len(set(p.label_ids)) != len(p.label_ids):
            raise UnsupportedModel(f"{model.name}: the labels of question {q.name!r} do not encode to distinct "
                                   "tokens; label scoring cannot tell its options apart")
    prefix = shared_prefix([p.ids for p in prompts]) if share_state else 0
    base = None
    if prefix:
        base = model.new_cache(max(len(p.ids) for p in prompts))
        model.prefill(prompts[0].ids[:prefix], base)
    probabilities, logits_of, tokens = {}, {}, prefix
    for q, p in zip(req.questions, prompts):
        cache = base.fork() if base is not None else model.new_cache(len(p.ids))
        logits = model.prefill(p.ids[prefix:], cache)[-1]
        tokens += len(p.ids) - prefix
        z = np.asarray(logits, np.float64)[p.label_ids]
        logits_of[q.name] = z
        t = (temperatures or {}).get(q.kind, 1.0)
        probabilities[q.name] = [float(x) for x in softmax(z, t)]
    return Scored(probabilities, logits_of, tokens)
