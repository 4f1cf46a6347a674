"""llama.cpp's request fields on the OpenAI routes: what llama-server's clients (its web UI, editor integrations,
scripts written for it) send to /v1/chat/completions and /v1/completions beside OpenAI's fields.

    translate(body, chat, max_probs) -> (body, extras)
        the body with llama.cpp's fields read into OpenAI's (n_predict as max_tokens, n_probs as logprobs,
        repeat_penalty as repetition_penalty, a sampler chain's left-out samplers turned off) and the request
        settings they add (ignore_eos, timings_per_token, sse_ping_interval's keepalive_s, return_tokens,
        post_sampling_probs, and `chain`: llama.cpp's other samplers, engine/generation/sampler_chain.py)

Each field is honoured, or accepted as a documented no-op (goinfer's design does it anyway); docs/server.md's table
("llama.cpp's fields") lists every one, and tests/test_llamacpp_fields.py checks each row. A field of neither
dialect stays a 400 (openai.py).
"""

from __future__ import annotations

import math
from typing import Any

from engine.api.fields import bool_field, float_field, int_field, kind_of
from engine.errors import RequestError
from engine.generation.sampler_chain import DEFAULT_ORDER, ChainSettings

__all__ = ["FIELDS", "NO_LIMIT", "translate"]

NO_LIMIT = 1 << 30  # n_predict -1: until the answer ends or the context window is full

# Accepted without effect: goinfer reuses every prompt prefix it can (cache_prompt), has no slots to pick
# (id_slot), arms its control route for every running reply (reasoning_control), and reads no per-request indent.
_NO_OPS = {"cache_prompt", "id_slot", "reasoning_control", "n_indent", "t_max_predict_ms"}
# llama.cpp's samplers beyond OpenAI's: (low, high) of each number (None: unbounded); sampler_chain.py runs them
_CHAIN_FLOATS = {"typical_p": (0.0, None), "top_n_sigma": (-math.inf, None), "xtc_probability": (0.0, 1.0),
                 "xtc_threshold": (0.0, 1.0), "dynatemp_range": (0.0, None), "dynatemp_exponent": (0.0, None),
                 "mirostat_tau": (0.0, None), "mirostat_eta": (0.0, None), "dry_multiplier": (0.0, None),
                 "dry_base": (1.0, None)}
_CHAIN_INTS = {"mirostat": (0, 2), "min_keep": (0, None), "dry_allowed_length": (0, None),
               "dry_penalty_last_n": (-1, None)}
_SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                    "m": "min_p", "x": "xtc", "t": "temperature"}
_RENAMED = {"n_predict", "n_probs", "repeat_penalty", "ignore_eos", "sse_ping_interval", "samplers",
            "timings_per_token", "return_progress", "backend_sampling", "return_tokens", "post_sampling_probs",
            "typ_p", "dry_sequence_breakers"}
FIELDS = frozenset(_NO_OPS | set(_CHAIN_FLOATS) | set(_CHAIN_INTS) | _RENAMED)


def translate(body: dict, chat: bool, max_probs: int) -> tuple[dict, dict]:
    """(the body with llama.cpp's fields read into OpenAI's and removed, the request settings they add);
    max_probs: the route's limit on alternatives per token."""
    if body.get("max_tokens") == -1:  # llama.cpp's "no limit" (its web UI's default)
        body = {**body, "max_tokens": NO_LIMIT}
    if not any(k in body for k in FIELDS):
        return body, {}
    out = {k: v for k, v in body.items() if k not in FIELDS}
    order = _samplers(body.get("samplers"))
    if order is not None:
        out.update(_left_out(order))
    if body.get("repeat_penalty") is not None:
        _set(out, "repetition_penalty", body["repeat_penalty"], "repeat_penalty")
    n_predict = int_field(body, "n_predict", -1)
    if n_predict == 0:
        raise RequestError("n_predict: must be >= 1, or -1 (no limit)", "n_predict", "invalid_value")
    if n_predict is not None:
        limit = NO_LIMIT if n_predict < 0 else n_predict
        for ours in ("max_tokens", "max_completion_tokens"):
            if out.get(ours) is not None and out[ours] != limit:
                raise RequestError(f"n_predict: disagrees with {ours}; send one of them", "n_predict",
                                   "invalid_value")
        out["max_tokens"] = limit
    n_probs = int_field(body, "n_probs", 0, max_probs)
    if n_probs:
        if chat:
            _set(out, "logprobs", True, "n_probs")
            _set(out, "top_logprobs", n_probs, "n_probs")
        else:
            _set(out, "logprobs", n_probs, "n_probs")
    extras = {"ignore_eos": bool_field(body, "ignore_eos", False),
              "timings_per_token": bool_field(body, "timings_per_token", False),
              "return_progress": bool_field(body, "return_progress", False),
              "return_tokens": bool_field(body, "return_tokens", False),
              "post_sampling_probs": bool_field(body, "post_sampling_probs", False)}
    chain = _chain(body, order)
    if chain is not None:
        extras["chain"] = chain
    bool_field(body, "backend_sampling", False)  # where the samplers run: goinfer's always run on the CPU
    ping = int_field(body, "sse_ping_interval", None)
    if ping is not None:  # a stream's keep-alive comments every `ping` seconds; <= 0 (llama.cpp's -1): none
        extras["keepalive_s"] = float(ping) if ping > 0 else math.inf
    return out, extras


def _set(out: dict, ours: str, value: Any, theirs: str) -> None:
    """out[ours] = value (from llama.cpp's `theirs`); a body that sends both with different values is refused."""
    if out.get(ours) is not None and out[ours] != value:
        raise RequestError(f"{theirs}: disagrees with {ours}; send one of them", theirs, "invalid_value")
    out[ours] = value


def _chain(body: dict, order: tuple[str, ...] | None) -> ChainSettings | None:
    """The chain settings the body states (None: none that the fast path does not do as well)."""
    stated: dict[str, Any] = {}
    for name, (low, high) in _CHAIN_FLOATS.items():
        if body.get(name) is not None:
            stated[name] = float_field(body, name, low, high)
    for name, (low, high) in _CHAIN_INTS.items():
        if body.get(name) is not None:
            stated[name] = int_field(body, name, low, high)
    if body.get("typ_p") is not None:  # the sampler's own name, as some clients spell the field
        typ = float_field(body, "typ_p", 0.0, None)
        if stated.get("typical_p", typ) != typ:
            raise RequestError("typ_p: disagrees with typical_p; send one of them", "typ_p", "invalid_value")
        stated["typical_p"] = typ
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None:
        if not (isinstance(breakers, list) and breakers and all(isinstance(b, str) and b for b in breakers)):
            raise RequestError("dry_sequence_breakers: must be a non-empty array of non-empty strings",
                               "dry_sequence_breakers", "invalid_value")
        stated["dry_sequence_breakers"] = tuple(breakers)
    if order is not None:
        stated["order"] = order
    chain = ChainSettings(**stated)
    return chain if chain.needed else None  # all off, in the fast path's order: the fast path does the same


def _samplers(value: Any) -> tuple[str, ...] | None:
    """`samplers` (names, or llama.cpp's letters as one string) -> the chain's order; each at most once."""
    if value is None:
        return None
    if isinstance(value, str):
        names = value.split(";") if ";" in value else [_SAMPLER_LETTERS.get(c, c) for c in value]
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = list(value)
    else:
        raise RequestError(f"samplers: must be an array of sampler names or a string of their letters, not "
                           f"{kind_of(value)}", "samplers", "invalid_type")
    names = [{"typical_p": "typ_p", "top-k": "top_k", "top-p": "top_p", "min-p": "min_p"}.get(n, n) for n in names]
    bad = [n for n in names if n not in DEFAULT_ORDER]
    if bad or len(set(names)) != len(names):
        what = f"names {bad[0]!r}, not one of them" if bad else "names one twice"
        raise RequestError(f"samplers: a chain of {', '.join(DEFAULT_ORDER)}, each at most once, in any order "
                           f"(this one {what})", "samplers", "unsupported_value")
    return tuple(names)


def _left_out(order: tuple[str, ...]) -> dict:
    """The settings that turn off the fast path's samplers a chain leaves out (top_k, top_p, min_p; temperature:
    1, the chain then draws from the plain distribution, as llama.cpp's does). Penalties left out stay as set:
    older chains never named them."""
    off = {"top_k": ("top_k", 0), "top_p": ("top_p", 1.0), "min_p": ("min_p", 0.0), "temperature": ("temperature", 1.0)}
    return dict(setting for name, setting in off.items() if name not in order)
