"""The built-in chat page (GET /, and its script): static files from engine/server/web/, served without the API
key (a browser cannot send one when it opens a page; the page asks for the key). `serve --no-web` turns it off."""

from __future__ import annotations

from pathlib import Path

from engine.server.routes import Route

__all__ = ["ROUTES"]

_WEB_DIR = Path(__file__).with_name("web")
_HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def _file(name: str, content_type: str):
    def answer(ex) -> None:
        ex.send_body(200, (_WEB_DIR / name).read_bytes(), content_type, _HEADERS)
    return answer


_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/ui/chat.js": ("chat.js", "text/javascript; charset=utf-8")}

ROUTES = tuple(Route(method, path, _file(name, kind), public=True, when=lambda state: state.web)
               for path, (name, kind) in _FILES.items() for method in ("GET", "HEAD"))
