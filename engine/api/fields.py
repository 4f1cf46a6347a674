"""Field validators every wire format shares: each reads one field of a parsed JSON body and raises RequestError
naming the field (and the error code the wire formats map) when it has the wrong type or lies out of range."""

from __future__ import annotations

from typing import Any

from engine.errors import RequestError


def object_body(body: Any) -> dict:
    """The request body itself, which must be a JSON object."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {kind_of(body)}", None, "invalid_type")
    return body


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def kind_of(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def int_field(body: dict, name: str, low: int | None, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise RequestError(f"{name}: must be an integer, not {kind_of(v)}", name, "invalid_type")
    if (low is not None and v < low) or (high is not None and v > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{name}: must be {bounds} (got {v})", name, "invalid_value")
    return v


def float_field(body: dict, name: str, low: float, high: float | None, low_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not is_number(v):
        raise RequestError(f"{name}: must be a number, not {kind_of(v)}", name, "invalid_type")
    if v < low or (low_open and v == low) or (high is not None and v > high):
        lo = "(" if low_open else "["
        bounds = (f"> {low}" if low_open else f">= {low}") if high is None else f"in {lo}{low}, {high}]"
        raise RequestError(f"{name}: must be {bounds} (got {v})", name, "invalid_value")
    return float(v)


def bool_field(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{name}: must be true or false, not {kind_of(v)}", name, "invalid_type")
    return v


def str_field(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise RequestError(f"{name}: must be a string, not {kind_of(v)}", name, "invalid_type")
    return v


def known_fields(body: dict, fields: set[str] | frozenset[str]) -> None:
    """Refuse a field the route does not take, naming it and what it does take."""
    unknown = sorted(k for k in body if k not in fields)
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown field (accepted: {', '.join(sorted(fields))})", unknown[0],
                           "unknown_parameter")
