"""The route table (engine/server/routes.py, joined in handler.py): the docs list exactly its routes, and it matches,
refuses (404, 405 with Allow, a family's own 404) and hides the routes a flag turns off. No model is loaded."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from engine.server.handler import TABLE

DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"
_DOC_ROUTE = re.compile(r"`((?:GET|POST|PUT|PATCH|DELETE|HEAD) /[^`]*)`")


def _state(admin=True, web=True):
    return SimpleNamespace(admin=object() if admin else None, web=web, models={"m": None})


def test_the_docs_list_every_route_of_the_table_and_no_other():
    documented = set()
    for line in DOCS.read_text().splitlines():
        if line.startswith("| `"):  # a table row whose first cell names routes
            documented.update(_DOC_ROUTE.findall(line.split(" | ")[0]))
    assert documented == set(TABLE.listing())


def test_a_route_is_found_with_its_parameters():
    found = TABLE.match("GET", "/v1/files/file-abc/content", _state())
    assert found.route.shown == "GET /v1/files/{id}/content" and found.params == {"id": "file-abc"}
    found = TABLE.match("GET", "/v1/models/hf:org/name", _state())
    assert found.params == {"id": "hf:org/name"}  # a model's name may hold slashes
    found = TABLE.match("POST", "/v1/messages/batches/msgbatch_1/cancel", _state())
    assert found.route.shown == "POST /v1/messages/batches/{id}/cancel"


def test_a_wrong_method_is_405_with_allow_and_an_unknown_path_404_listing_the_routes():
    state = _state()
    found = TABLE.match("PUT", "/v1/files/file-abc", state)
    e = TABLE.refusal("PUT", "/v1/files/file-abc", found, state)
    assert e.status == 405 and e.headers == {"Allow": "GET, DELETE"}
    found = TABLE.match("GET", "/v1/images", state)
    e = TABLE.refusal("GET", "/v1/images", found, state)
    assert e.status == 404 and e.body["error"]["code"] == "not_found"
    assert all(r in e.body["error"]["message"] for r in TABLE.listing(state))


def test_a_family_refuses_its_unknown_paths_in_its_own_words():
    state = _state()
    e = TABLE.refusal("GET", "/v1/files/a/b", TABLE.match("GET", "/v1/files/a/b", state), state)
    assert e.status == 404 and e.body["error"]["message"] == "no file route 'a/b'"
    e = TABLE.refusal("GET", "/v1/messages/batches/x", TABLE.match("GET", "/v1/messages/batches/x", state), state)
    assert e.status == 404 and e.body["type"] == "error"  # Anthropic's shape


def test_routes_a_flag_turns_off_are_not_served():
    state = _state(admin=False, web=False)
    assert TABLE.match("GET", "/admin/models", state).route is None
    assert TABLE.match("GET", "/", state).route is None
    e = TABLE.refusal("GET", "/admin/models/x", TABLE.match("GET", "/admin/models/x", state), state)
    assert e.body["error"]["message"].startswith("no route GET /admin/models/x")
    assert "GET /admin/models" not in TABLE.listing(state)
    assert TABLE.match("HEAD", "/", _state()).route.public
