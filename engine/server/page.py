"""The built-in chat page: GET / (index.html), /favicon.ico, and /ui/<file> for the page's script, style and the
two libraries it vendors (engine/server/web/ and web/vendor/). Served without the API key (a browser cannot send
one when it opens a page; the page asks for the key) and under a Content-Security-Policy that admits nothing but
this server: replies are untrusted text, and the policy is the second wall behind the page's sanitizer.
`serve --no-web` turns it all off."""

from __future__ import annotations

from pathlib import Path

from engine.server.routes import Route, not_found

__all__ = ["ROUTES"]

_WEB_DIR = Path(__file__).with_name("web")
_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


# A fixed table made once from the folder's own files: no path from a request ever reaches the file system.
_FILES = {p.relative_to(_WEB_DIR).as_posix(): p for p in sorted(_WEB_DIR.rglob("*")) if p.suffix in _TYPES}


def _send(ex, path: Path) -> None:
    ex.send_body(200, path.read_bytes(), _TYPES[path.suffix], _HEADERS)


def _ui_file(ex, file: str) -> None:
    if file not in _FILES:
        raise not_found("file", file)
    _send(ex, _FILES[file])


_ANSWERS = {"/": lambda ex: _send(ex, _WEB_DIR / "index.html"),
            "/favicon.ico": lambda ex: _send(ex, _WEB_DIR / "favicon.svg"), "/ui/{file:.+}": _ui_file}

ROUTES = tuple(Route(method, path, answer, public=True, when=lambda state: state.web)
               for path, answer in _ANSWERS.items() for method in ("GET", "HEAD"))
