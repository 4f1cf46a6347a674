"""llama.cpp's request fields on the OpenAI routes: what llama-server's clients (its web UI, editor integrations,
scripts written for it) send to /v1/chat/completions and /v1/completions beside OpenAI's fields.

    translate(body, chat, max_probs) -> (body, extras)
        the body with llama.cpp's fields read into OpenAI's (n_predict as max_tokens, n_probs as logprobs,
        repeat_penalty as repetition_penalty, a sampler chain's left-out samplers turned off) and the request
        settings they add (ignore_eos, timings_per_token, sse_ping_interval's keepalive_s)

Each field is honoured, accepted as a documented no-op (goinfer's design does it anyway), accepted at its neutral
value only (a sampler goinfer does not have), or refused naming it; docs/server.md's table ("llama.cpp's fields")
lists every one, and tests/test_llamacpp_fields.py checks each row. A field of neither dialect stays a 400
(openai.py).
"""

from __future__ import annotations

import math
from typing import Any

from engine.api.fields import bool_field, int_field, is_number, kind_of
from engine.errors import RequestError

__all__ = ["FIELDS", "NO_LIMIT", "translate"]

NO_LIMIT = 1 << 30  # n_predict -1: until the answer ends or the context window is full

# Accepted without effect: goinfer reuses every prompt prefix it can (cache_prompt), has no slots to pick
# (id_slot), arms its control route for every running reply (reasoning_control), and reads no per-request indent.
_NO_OPS = {"cache_prompt", "id_slot", "reasoning_control", "n_indent", "t_max_predict_ms"}
# Samplers goinfer does not have, at the value that turns each off (and the settings that act only with it on)
_NEUTRAL = {"typical_p": 1.0, "typ_p": 1.0, "top_n_sigma": -1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
            "mirostat": 0, "dynatemp_range": 0.0}
_ONLY_WITH = {"dry_base": "dry_multiplier", "dry_allowed_length": "dry_multiplier",
              "dry_penalty_last_n": "dry_multiplier", "dry_sequence_breakers": "dry_multiplier",
              "xtc_threshold": "xtc_probability", "mirostat_tau": "mirostat", "mirostat_eta": "mirostat",
              "dynatemp_exponent": "dynatemp_range"}
# llama.cpp's default sampler chain: the order goinfer's samplers run in (a chain that names them in another order,
# or leaves one out, would sample differently)
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                    "m": "min_p", "x": "xtc", "t": "temperature"}
# Asked for by name and not done yet: refused when on
_NOT_YET = {"return_tokens": "the answer's token ids", "post_sampling_probs": "post-sampling probabilities"}
_RENAMED = {"n_predict", "n_probs", "repeat_penalty", "ignore_eos", "sse_ping_interval", "samplers",
            "timings_per_token", "return_progress", "backend_sampling"}
FIELDS = frozenset(_NO_OPS | set(_NEUTRAL) | set(_ONLY_WITH) | set(_NOT_YET) | _RENAMED)


def translate(body: dict, chat: bool, max_probs: int) -> tuple[dict, dict]:
    """(the body with llama.cpp's fields read into OpenAI's and removed, the request settings they add);
    max_probs: the route's limit on alternatives per token."""
    if body.get("max_tokens") == -1:  # llama.cpp's "no limit" (its web UI's default)
        body = {**body, "max_tokens": NO_LIMIT}
    if not any(k in body for k in FIELDS):
        return body, {}
    out = {k: v for k, v in body.items() if k not in FIELDS}
    _neutral_samplers(body)
    for name, what in _NOT_YET.items():
        if bool_field(body, name, False):
            raise RequestError(f"{name}: {what} are not supported yet", name, "unsupported_value")
    out.update(_samplers(body.get("samplers")))
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
              "return_progress": bool_field(body, "return_progress", False)}
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


def _neutral_samplers(body: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is None:
            continue
        off = is_number(value) and not isinstance(value, bool) and (
            value == neutral or (name == "top_n_sigma" and value <= 0)
            or (name in ("typical_p", "typ_p") and value >= 1))
        if not off:
            raise RequestError(f"{name}: this sampler is not supported; only its neutral value {neutral} (got "
                               f"{value!r})", name, "unsupported_value")


def _samplers(value: Any) -> dict:
    """`samplers` (names, or llama.cpp's letters as one string): a chain in llama.cpp's default order, which
    goinfer's samplers follow (penalties, top_k, top_p, min_p, temperature), any of them left out. Returns the
    settings that turn off the samplers it leaves out (top_k, top_p, min_p; temperature: 1, the chain then draws
    from the plain distribution, as llama.cpp's does). Penalties left out stay as set: older chains never named
    them. Another order is refused."""
    if value is None:
        return {}
    if isinstance(value, str):
        names = [_SAMPLER_LETTERS.get(c, c) for c in value.replace(";", "")] if ";" not in value else \
            value.split(";")
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = list(value)
    else:
        raise RequestError(f"samplers: must be an array of sampler names or a string of their letters, not "
                           f"{kind_of(value)}", "samplers", "invalid_type")
    names = [n.replace("typical_p", "typ_p").replace("top-k", "top_k") for n in names]
    at = [DEFAULT_SAMPLERS.index(n) if n in DEFAULT_SAMPLERS else -1 for n in names]
    if -1 in at or at != sorted(set(at)):
        raise RequestError(f"samplers: goinfer's samplers run in llama.cpp's default order "
                           f"({';'.join(DEFAULT_SAMPLERS)}); a chain may leave some out, not reorder them or name "
                           f"others (got {';'.join(names)})", "samplers", "unsupported_value")
    off = {"top_k": ("top_k", 0), "top_p": ("top_p", 1.0), "min_p": ("min_p", 0.0), "temperature": ("temperature", 1.0)}
    return dict(setting for name, setting in off.items() if name not in names)
