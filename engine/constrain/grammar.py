"""llguidance glue: grammars from JSON schemas / Lark, our vocabulary as an llguidance tokenizer, and the
logits processor that masks every token the grammar does not allow at this step.

A mask costs a small fraction of the model step's time per token (SmolLM2's 49k vocabulary, JSON schema and the
auto tool grammar; docs/benchmarks.md, "Measurements behind the code", grammar mask), so it is computed inline.
(Computing it on a helper thread during the model step measured slower here: thread hand-off and GIL contention
with the numba kernels cost more than the mask.)
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.errors import RequestError

try:  # a CPU install without llguidance still loads models; constrained requests then get a clear 400
    import llguidance
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
except ImportError:  # pragma: no cover - llguidance is a declared dependency
    llguidance = None

# Compact separators: what OpenAI's structured outputs produce, and the fewest tokens for a small model.
_JSON_OPTIONS = {"whitespace_flexible": False}
_NO_LLG = "structured output needs the llguidance package (pip install llguidance)"


@dataclass(frozen=True)
class Grammar:
    """A checked llguidance grammar (its serialized form) and what it constrains, for messages."""

    spec: str
    what: str  # "json_schema", "json_object", "tool_calls"
    schema: Any = field(default=None, compare=False)  # the JSON schema a json_schema grammar was made from


def _check(spec: str, param: str, what: str) -> Grammar:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(spec, None)
    if is_error:
        lines = [ln.strip() for ln in (messages[0] if messages else "invalid").splitlines()]
        msg = " ".join(ln for ln in lines if ln.strip("^ "))[:300]  # llguidance's caret lines dropped
        kind = "schema" if what in ("json_schema", "json_object", "tool_calls") else what
        raise RequestError(f"{param}: the {kind} is invalid or unsupported: {msg}", param,
                           "invalid_schema" if kind == "schema" else "invalid_grammar")
    return Grammar(spec, what)


def json_schema_grammar(schema: Any, param: str = "response_format.json_schema.schema") -> Grammar:
    """The grammar of JSON documents valid under `schema` (RequestError, naming `param`, if it cannot be)."""
    if llguidance is None:
        raise RequestError(_NO_LLG, param, "unsupported_parameter")
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: a JSON schema must be an object", param, "invalid_schema")
    try:
        spec = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise RequestError(f"{param}: the schema is invalid: {e}", param, "invalid_schema") from None
    return Grammar(_check(spec, param, "json_schema").spec, "json_schema", schema)


def json_object_grammar() -> Grammar:
    """Any JSON object (response_format json_object)."""
    return Grammar(json_schema_grammar({"type": "object"}, "response_format").spec, "json_object")


def text_grammar(kind: str, text: Any, param: str) -> Grammar:
    """A request's own grammar: `grammar` (llama.cpp's GBNF, or Lark), `regex` (the whole answer matches it) or
    `choice` (the answer is one of these strings). RequestError, naming `param`, if it cannot be enforced."""
    if llguidance is None:
        raise RequestError(_NO_LLG, param, "unsupported_parameter")
    what = kind
    if kind == "choice":
        if not isinstance(text, list) or not text or not all(isinstance(c, str) and c for c in text):
            raise RequestError(f"{param}: must be a non-empty array of non-empty strings", param, "invalid_value")
        text = "|".join(_regex_literal(c) for c in text)
        kind = "regex"
    elif not isinstance(text, str) or not text.strip():
        raise RequestError(f"{param}: must be a non-empty string", param, "invalid_type")
    try:
        spec = llguidance.grammar_from("regex" if kind == "regex" else "grammar", text)
    except (ValueError, TypeError) as e:
        raise RequestError(f"{param}: the {kind} is invalid: {str(e)[:300]}", param, "invalid_grammar") from None
    return _check(spec, param, what)


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\/" else ch for ch in text)


def lark_grammar(source: str, param: str, what: str) -> Grammar:
    if llguidance is None:
        raise RequestError(_NO_LLG, param, "unsupported_parameter")
    return _check(LLMatcher.grammar_from_lark(source), param, what)


# ---------------------------------------------------------------------------------------------- tokenizer

_LLG_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LLG_LOCK = threading.Lock()


def llg_tokenizer(tokenizer) -> Any:
    """Our Tokenizer as an llguidance LLTokenizer (built once per tokenizer: it takes a noticeable fraction of a
    second; docs/benchmarks.md, "Measurements behind the code", llguidance tokenizer).
    Token bytes are our own pieces; control tokens carry llguidance's 0xFF marker so grammars never
    produce them as text; end-of-generation ids are the tokenizer's."""
    with _LLG_LOCK:
        llt = _LLG_TOKENIZERS.get(tokenizer)
        if llt is None:
            llt = _LLG_TOKENIZERS[tokenizer] = LLTokenizer(TokenizerWrapper(_Wrapped(tokenizer)),
                                                           eos_token=sorted(tokenizer.eog_ids))
        return llt


class _Wrapped:
    """What llguidance's TokenizerWrapper reads: token bytes, specials, and an encoder of bytes."""

    def __init__(self, tok):
        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids)
        self.bos_token_id = tok.bos_id
        n = tok.vocab_size
        self.special_token_ids = [i for i in range(n) if tok.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [(b"\xff" if i in special else b"") + tok.piece_bytes(i) for i in range(n)]

    def __call__(self, data: bytes) -> list[int]:
        return self._tok.encode(data.decode("utf-8", errors="replace"), add_bos=False, add_eos=False)


# ---------------------------------------------------------------------------------------------- processor

class GrammarProcessor:
    """A logits processor (logits (vocab,), history) -> logits: tokens the grammar forbids get -inf.

    Tokens are fed to the matcher from `history` (everything after the prompt); `accept(token)` (generate
    calls it after sampling) feeds the sampled token at once, so a finished grammar is seen early."""

    def __init__(self, matcher, vocab_size: int, eog_ids: frozenset[int]):
        self._m = matcher
        self._eog = np.array(sorted(eog_ids), dtype=np.int64)
        self._mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # (words,) one bit per token
        self._start: int | None = None  # history length at the first step: the prompt
        self._fed = 0  # generated tokens given to the matcher

    @property
    def matcher(self):
        return self._m

    def _observe(self, logits: np.ndarray, allowed: np.ndarray) -> None:
        """A step's logits and the grammar's 0/1 mask over them, before masking (confidence.py records them)."""

    def accept(self, token: int) -> None:
        """The sampled token: advance the matcher."""
        if not self._m.is_error() and not self._m.is_stopped():
            self._m.consume_token(int(token))
        self._fed += 1

    def __call__(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        if self._start is None:
            self._start = len(history)
        for t in history[self._start + self._fed:]:  # tokens nobody told us about (no accept calls)
            self.accept(t)
        if self._m.is_error() or self._m.is_stopped():
            # Nothing more may follow (or the matcher gave up): only end-of-generation is allowed.
            out = np.full_like(logits, -np.inf)
            out[self._eog] = logits[self._eog]
            return out
        self._m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: len(logits)]  # (vocab,) 0/1
        self._observe(logits, allowed)
        logits[: len(allowed)][allowed == 0] = -np.inf
        logits[len(allowed):] = -np.inf  # rows past the tokenizer's vocabulary (padding) are never text
        return logits


def grammar_processor(tokenizer, grammar: Grammar, kind: type[GrammarProcessor] = GrammarProcessor):
    """A fresh processor (one per generated answer: it holds the parse state); `kind` a GrammarProcessor class
    (confidence.ConfidenceGrammar records what it allowed)."""
    matcher = LLMatcher(llg_tokenizer(tokenizer), grammar.spec, log_level=0)
    if matcher.is_error():
        raise RequestError(f"the {grammar.what} grammar cannot be used: {matcher.get_error()}", None,
                           "invalid_schema")
    return kind(matcher, tokenizer.vocab_size, tokenizer.eog_ids)
