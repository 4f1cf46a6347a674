"""The server's route table: method + path -> the function that answers, with what the handler must know of a route
before it answers (its error shape, its body limit, whether it waits for the models, whether it needs the key).

Each module that answers routes lists its own as a ROUTES tuple (Route, and a Subtree for the paths under its
prefix that no route of its has); handler.py joins them into the one table. A route's path is exact or a pattern:
`{name}` takes one path segment, `{name:REGEX}` what the regex matches (`{id:.*}`: the rest of the path, slashes
too). A function answers as answer(ex, **params), ex being the request's Exchange (exchange.py).

The table refuses a path that no route has with 404 (listing the routes), and a method that no route on the path
has with 405 and Allow. The 404 list and docs/server.md's route tables come from here (tests/test_routes.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.api.openai_objects import error_object
from engine.server.intake import HTTPError

__all__ = ["Match", "Route", "RouteTable", "Subtree", "not_found", "unknown_model"]

_PARAM = re.compile(r"\{(\w+)(?::([^}]*))?\}")


def _pattern(path: str) -> re.Pattern:
    out, at = [], 0
    for m in _PARAM.finditer(path):
        out += [re.escape(path[at:m.start()]), f"(?P<{m.group(1)}>{m.group(2) or '[^/]+'})"]
        at = m.end()
    return re.compile("".join(out) + re.escape(path[at:]))


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    answer: Callable[..., None]
    public: bool = False  # answered without the API key (the chat page: a browser cannot send one to open it)
    when: Callable[[Any], bool] | None = None  # served only while when(state) holds (admin: --allow-admin)
    dialect: Callable[[Any], Any] | None = None  # a generation route's wire format: dialect(response_store)
    body_cap: Callable[[Any], int] | None = None  # its own body limit (state -> bytes), else the server's
    waits_for_models: bool = True  # a body read while the server loads is held until the models are in
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "regex", _pattern(self.path))

    @property
    def shown(self) -> str:
        """As the docs and the 404 list write it: `GET /v1/files/{id}`."""
        return f"{self.method} {_PARAM.sub(lambda m: '{' + m.group(1) + '}', self.path)}"


@dataclass(frozen=True)
class Subtree:
    """Paths under `prefix` that no route has: refuse(rest) is their 404 (naming the family, in its shape)."""

    prefix: str
    refuse: Callable[[str], HTTPError]
    when: Callable[[Any], bool] | None = None


@dataclass
class Match:
    route: Route | None  # the route that answers this method on this path, or None
    params: dict[str, str]
    on_path: list[Route]  # every served route on this path, whatever its method

    @property
    def rules(self) -> Route | None:
        """The route whose limits and error shape apply before routing: this method's, else the path's first."""
        return self.route or (self.on_path[0] if self.on_path else None)


class RouteTable:
    def __init__(self, *entries: Route | Subtree):
        self.routes = [e for e in entries if isinstance(e, Route)]
        self.subtrees = [e for e in entries if isinstance(e, Subtree)]

    def served(self, state) -> list[Route]:
        return [r for r in self.routes if r.when is None or r.when(state)]

    def match(self, method: str, path: str, state) -> Match:
        found = Match(None, {}, [])
        for r in self.served(state):
            m = r.regex.fullmatch(path)
            if m is None:
                continue
            found.on_path.append(r)
            if r.method == method and found.route is None:
                found.route, found.params = r, m.groupdict()
        return found

    def refusal(self, method: str, path: str, found: Match, state) -> HTTPError:
        """The answer to a request no route answers: 405 where the path has routes, else 404."""
        if found.on_path:
            allowed = list(dict.fromkeys(r.method for r in found.on_path))
            return HTTPError(405, error_object(f"{method} is not allowed here; use {' or '.join(allowed)}",
                                               "invalid_request_error", None, "method_not_allowed"),
                             {"Allow": ", ".join(allowed)})
        for sub in self.subtrees:
            if path.startswith(sub.prefix + "/") and (sub.when is None or sub.when(state)):
                return sub.refuse(path[len(sub.prefix) + 1:])
        return HTTPError(404, error_object(f"no route {method} {path} (routes: {', '.join(self.listing(state))})",
                                           "invalid_request_error", None, "not_found"))

    def listing(self, state=None) -> list[str]:
        """Every route as `METHOD /path` (those served with `state`, or all), HEAD left out: it is a GET without
        its body."""
        routes = self.routes if state is None else self.served(state)
        return list(dict.fromkeys(r.shown for r in routes if r.method != "HEAD"))


def not_found(what: str, name: str) -> HTTPError:
    return HTTPError(404, error_object(f"no {what} {name!r}", "invalid_request_error", None, "not_found"))


def unknown_model(state, name: str | None) -> HTTPError:
    served = ", ".join(state.models)
    return HTTPError(404, error_object(f"model {name!r} does not exist here (served: {served})",
                                       "invalid_request_error", "model", "model_not_found"))
