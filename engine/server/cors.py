"""Cross-origin requests from browsers (CORS): which web pages may read this server's answers.

A browser sends a page's request whatever this server says (CORS does not keep anything out: the API key and the
Host check do); it only lets the page read the answer when the answer names the page's origin. By default the
pages of this machine may (an origin on localhost, 127.0.0.1 or [::1], any port: a web UI run locally), as
Ollama allows; `serve --cors-origin ORIGIN` (repeatable) adds others, `*` any. A preflight (OPTIONS with
Access-Control-Request-Method) needs no key, since browsers never send one with it; it is answered 204 with what
may follow, or 403 for an origin that is not allowed.

    parse_origins(values)        --cors-origin values checked (ValueError names a bad one)
    CorsPolicy(origins)          allowed(origin), headers(origin), preflight(origin, request_headers)
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["CorsPolicy", "parse_origins"]

_LOOPBACK = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$")
METHODS = "GET, POST, OPTIONS"
# What a client may read besides the simple response headers: the request's id (to report it) and a 429's wait.
EXPOSED = "X-Request-Id, Retry-After"
MAX_AGE_S = 600


def parse_origins(values: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The origins as given (`*`, or scheme://host[:port] over http or https, no path), lower-cased."""
    out = []
    for value in values:
        origin = value.strip().lower().rstrip("/")
        if origin != "*":
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query:
                raise ValueError(f"--cors-origin {value!r}: an origin is *, or scheme://host[:port] "
                                 "(http or https, no path), e.g. http://localhost:3000")
        out.append(origin)
    return tuple(out)


class CorsPolicy:
    def __init__(self, origins: tuple[str, ...] = ()):
        self._any = "*" in origins
        self._origins = frozenset(origins)

    def allowed(self, origin: str | None) -> bool:
        if not origin:
            return False
        origin = origin.strip().lower()
        return self._any or origin in self._origins or _LOOPBACK.match(origin) is not None

    def headers(self, origin: str | None) -> dict[str, str]:
        """What an answer to a request from `origin` carries (nothing for another origin, or none)."""
        if not self.allowed(origin):
            return {}
        return {"Access-Control-Allow-Origin": origin.strip(), "Vary": "Origin",
                "Access-Control-Expose-Headers": EXPOSED}

    def preflight(self, origin: str | None, request_headers: str | None) -> dict[str, str]:
        """The headers of a 204 answer to an allowed origin's preflight (the caller refuses the others)."""
        out = self.headers(origin)
        out.update({"Access-Control-Allow-Methods": METHODS, "Access-Control-Max-Age": str(MAX_AGE_S)})
        if request_headers:
            out["Access-Control-Allow-Headers"] = request_headers  # all the page means to send: ours to check
        return out
