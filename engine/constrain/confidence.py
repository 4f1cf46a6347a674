"""Per-field confidence of a schema-constrained answer (`goinfer_confidence: true`): for each enum, boolean and
integer field, the model's probability over what the schema allowed at the position that decided it.

    ConfidenceGrammar           the grammar's logits processor, recording at every step what the grammar allowed
                                and the model's probabilities over it (the mask and the answer are unchanged)
    field_confidences(...)      after the answer: its JSON walked with byte offsets, each field's kind read from
                                the schema, and its record built from the steps that wrote its value

A record: {"path", "kind", "value", "confidence", "distribution", "undecided", "free_tokens", "calibrated": false}.
- enum / boolean: the deciding position is the step at which the value's text first fits one option only;
  `distribution` sums, by the option each spells, the probabilities of every token the grammar allowed there (a
  literal split across tokens is not diluted). Its keys are exactly the schema's options (a string option as
  itself, any other as its JSON text: "true", "false", "3"); `undecided`, a field of its own beside it, is the mass
  of tokens that fit several options yet, or none. The distribution's values and `undecided` sum to 1.
  `confidence` is the chosen option's share.
- integer: `confidence` is the lowest probability among the tokens that wrote its digits; no distribution and no
  `undecided` (both null).
- `free_tokens`: the value's steps at which the grammar allowed more than one token. A field with none (a
  one-option enum, a const) says nothing about the model and is not reported; neither are numbers and strings.
It is the model's probability over what the schema allowed, not the probability that the value is right.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from engine.constrain.grammar import GrammarProcessor

__all__ = ["ConfidenceGrammar", "field_confidences"]

MAX_KEPT = 4096  # allowed tokens at a step above which only the chosen token's probability is kept (free text)


@dataclass
class _Step:
    allowed: int  # how many tokens the grammar allowed
    ids: np.ndarray | None  # which (when at most MAX_KEPT)
    probs: np.ndarray | None  # the model's probabilities over them (renormalised over the allowed)
    lse: float  # log-sum-exp of the allowed logits
    chosen: int = -1
    p_chosen: float = 1.0


class ConfidenceGrammar(GrammarProcessor):
    def __init__(self, matcher, vocab_size: int, eog_ids: frozenset[int]):
        super().__init__(matcher, vocab_size, eog_ids)
        self.steps: list[_Step] = []
        self._logits: np.ndarray | None = None

    def _observe(self, logits: np.ndarray, allowed: np.ndarray) -> None:
        ids = np.flatnonzero(allowed)
        z = logits[ids].astype(np.float64)
        top = z.max() if len(z) else 0.0
        e = np.exp(z - top)
        total = e.sum()
        lse = top + math.log(total) if total > 0 else 0.0
        kept = len(ids) <= MAX_KEPT
        self.steps.append(_Step(len(ids), ids if kept else None, e / total if kept and total > 0 else None, lse))
        self._logits = logits  # the chosen token's logit is read from here (allowed tokens are left unmasked)

    def accept(self, token: int) -> None:
        if self.steps and self.steps[-1].chosen < 0 and self._logits is not None:
            step = self.steps[-1]
            step.chosen = int(token)
            step.p_chosen = float(math.exp(float(self._logits[token]) - step.lse)) if step.allowed > 1 else 1.0
        super().accept(token)


# ---------------------------------------------------------------------------------------------- the answer's JSON

def _scalars(b: bytes, i: int, path: str, out: list) -> int:
    """Walk the JSON value at b[i:]: append (path, start, end, value) for every scalar; return the end."""
    while b[i:i + 1] in (b" ", b"\n", b"\t", b"\r"):
        i += 1
    c = b[i:i + 1]
    if not c:
        raise ValueError("the JSON ends early")
    if c in (b"{", b"["):
        close, k = (b"}", b"]")[c == b"["], 0
        i += 1
        while True:
            while b[i:i + 1] in (b" ", b"\n", b"\t", b"\r", b","):
                i += 1
            if i >= len(b):
                raise ValueError("the JSON ends early")
            if b[i:i + 1] == close:
                return i + 1
            if c == b"{":
                end = _string_end(b, i)
                key = json.loads(b[i:end])
                i = end
                while b[i:i + 1] in (b" ", b"\n", b"\t", b"\r", b":"):
                    i += 1
                i = _scalars(b, i, f"{path}.{key}" if path else key, out)
            else:
                i = _scalars(b, i, f"{path}[{k}]", out)
                k += 1
    end = _string_end(b, i) if c == b'"' else _literal_end(b, i)
    out.append((path, i, end, json.loads(b[i:end])))
    return end


def _string_end(b: bytes, i: int) -> int:
    j = i + 1
    while b[j:j + 1] != b'"':
        if j >= len(b):
            raise ValueError("a string never ends")
        j += 2 if b[j:j + 1] == b"\\" else 1
    return j + 1


def _literal_end(b: bytes, i: int) -> int:
    j = i
    while j < len(b) and b[j:j + 1] not in (b",", b"}", b"]", b" ", b"\n", b"\t", b"\r"):
        j += 1
    return j


# ---------------------------------------------------------------------------------------------- the schema

def _resolve(s, root):
    """A $ref to the schema's own definitions followed (other references: unknown)."""
    seen = 0
    while isinstance(s, dict) and "$ref" in s and seen < 32:
        ref, seen = s["$ref"], seen + 1
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return None
        node = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        s = node
    return s


def _schema_at(schema, path: list, root):
    s = _resolve(schema, root)
    for part in path:
        if not isinstance(s, dict):
            return None
        if isinstance(part, int):
            prefix = s.get("prefixItems")
            s = prefix[part] if isinstance(prefix, list) and part < len(prefix) else s.get("items")
        else:
            props = s.get("properties") or {}
            s = props.get(part, s.get("additionalProperties") if isinstance(s.get("additionalProperties"), dict)
                          else None)
        s = _resolve(s, root)
    return s


def _kind(s) -> str | None:
    """enum | boolean | integer for a field goinfer reports; None for the rest (and for forced values)."""
    if not isinstance(s, dict) or "const" in s:
        return None
    if isinstance(s.get("enum"), list):
        return "enum" if len(s["enum"]) >= 2 else None
    t = s.get("type")
    return t if t in ("boolean", "integer") else None


def _path_parts(path: str) -> list:
    parts: list = []
    for piece in path.replace("[", ".[").split("."):
        if piece.startswith("["):
            parts.append(int(piece[1:-1]))
        elif piece:
            parts.append(piece)
    return parts


# ---------------------------------------------------------------------------------------------- the records

def field_confidences(rec: ConfidenceGrammar, schema, tokenizer) -> list[dict]:
    """The goinfer_confidence records of the answer `rec` saw generated under `schema`."""
    pieces = [b"" if s.chosen in tokenizer.eog_ids or s.chosen < 0 else tokenizer.piece_bytes(s.chosen)
              for s in rec.steps]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    text = b"".join(pieces)
    scalars: list = []
    try:
        _scalars(text, 0, "", scalars)
    except (ValueError, IndexError, UnicodeDecodeError):
        # cut by max_tokens: the fields written whole are reported (a value that runs to the cut may be partial)
        scalars = [x for x in scalars if x[2] < len(text)]
    out = []
    for path, s, e, value in scalars:
        kind = _kind(_schema_at(schema, _path_parts(path), schema))
        if kind is None or (kind == "boolean" and not isinstance(value, bool)) or (
                kind == "integer" and not isinstance(value, int)):
            continue
        steps = [k for k in range(len(rec.steps)) if starts[k + 1] > s and starts[k] < e]
        free = [k for k in steps if rec.steps[k].allowed > 1]
        if not free:
            continue  # the schema forced it
        record = {"path": path, "kind": kind, "value": value, "confidence": None, "distribution": None,
                  "undecided": None, "free_tokens": len(free), "calibrated": False}
        if kind == "integer":
            record["confidence"] = round(min(rec.steps[k].p_chosen for k in free), 6)
        else:
            options = _schema_at(schema, _path_parts(path), schema).get("enum") if kind == "enum" else [True, False]
            found = _distribution(rec, text, starts, s, e, steps, options, tokenizer)
            if found is None:
                continue
            dist, record["undecided"] = found
            record["distribution"] = dist
            record["confidence"] = dist.get(_key(value), 0.0)
        out.append(record)
    return out


def _key(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _distribution(rec, text: bytes, starts, s: int, e: int, steps: list[int], options: list,
                  tokenizer) -> tuple[dict, float] | None:
    """({option: probability} over exactly the schema's options, the undecided mass) at the deciding step."""
    literals = [(_key(o), json.dumps(o, ensure_ascii=False, separators=(",", ":")).encode()) for o in options]
    for k in steps:  # the deciding step: the first after which the value's text fits one option only
        done = text[s:min(e, starts[k + 1])]
        fits = [key for key, lit in literals if lit.startswith(done) or done.startswith(lit)]
        if len(fits) <= 1 and rec.steps[k].allowed > 1:
            break
    else:
        return None
    step = rec.steps[k]
    if step.ids is None:
        return None
    before = text[starts[k]:s] if starts[k] < s else b""  # the token's part ahead of the value (":" or "")
    prefix = text[s:max(s, starts[k])]
    mass = {key: 0.0 for key, _ in literals}
    undecided = 0.0
    for token, p in zip(step.ids.tolist(), step.probs.tolist()):
        piece = b"" if token in tokenizer.eog_ids else tokenizer.piece_bytes(token)
        if not piece.startswith(before):
            undecided += p
            continue
        cand = prefix + piece[len(before):]
        fit = [key for key, lit in literals if cand and (lit.startswith(cand) or cand.startswith(lit))]
        if len(fit) == 1:
            mass[fit[0]] += p
        else:
            undecided += p
    return {key: round(v, 6) for key, v in mass.items()}, round(undecided, 6)
