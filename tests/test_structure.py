"""The layout's rules, read from the imports (docs/architecture.md, "Dependency direction"): which layer may import
which (engine's packages in the order that page draws, which leaves no circle), who may name a backend, and
modules of a size one can read.

Every import counts, at the top of a module or inside a function: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("goinfer_cli", "commands", "engine")
BACKENDS = ("engine.kernels.cpu", "engine.kernels.webgpu")
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_module(name: str) -> bool:
    return name in modules()


@cache
def imports_of(name: str) -> frozenset[str]:
    """The project modules `name` imports (`from pkg import mod` counts as pkg.mod where mod is a module)."""
    tree = ast.parse(modules()[name].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = [f"{node.module}.{a.name}" for a in node.names]
            found.update(n for n in named if _is_module(n))
            if not all(_is_module(n) for n in named):  # names from the module itself, not its submodules
                found.add(node.module)
    return frozenset(m for m in found if m.split(".")[0] in PACKAGES)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def breaks(rule) -> list[str]:
    """'importer -> imported' for every import the rule (importer, imported) -> bool refuses."""
    return sorted(f"{m} -> {i}" for m in modules() for i in imports_of(m) if not rule(m, i))


def test_the_layers_import_downwards_only():
    """goinfer_cli -> commands -> engine, never back up."""
    order = {"goinfer_cli": 2, "commands": 1, "engine": 0}
    assert breaks(lambda m, i: order[m.split(".")[0]] >= order[i.split(".")[0]]) == []


# Who may import a backend package: the kernels themselves (the registry is their door), the machine's report,
# self-tests and compile-ahead (engine/loading/: about the backends, by name), and the sentence encoder, which
# computes on the CPU's encoder ops directly (it has no Backend of its own).
_BACKEND_USERS = ("engine.kernels", "engine.loading")


def _may_use_backend(importer: str, imported: str) -> bool:
    if not any(_within(imported, b) for b in BACKENDS):
        return True
    if any(_within(importer, u) for u in _BACKEND_USERS):
        return True
    return _within(importer, "engine.embeddings") and imported == "engine.kernels.cpu.encoder_ops"


def test_requests_scheduling_and_server_reach_backends_through_the_registry():
    assert breaks(_may_use_backend) == []


def test_the_kernels_and_models_import_nothing_above_them():
    """The kernels see a model through kernels/backend.py's protocols; a family through the kernels' interface."""
    ground = ("engine.errors", "engine.files")
    kernels_ok = lambda m, i: (not _within(m, "engine.kernels")  # noqa: E731
                               or _within(i, "engine.kernels") or i in ground)
    assert breaks(kernels_ok) == []
    below_models = ("engine.models", "engine.kernels", "engine.formats") + ground
    models_ok = lambda m, i: (not _within(m, "engine.models")  # noqa: E731
                              or any(_within(i, b) for b in below_models) or i == "engine")
    assert breaks(models_ok) == []


def test_wire_formats_build_requests_and_never_run_them():
    """engine/api reads bodies into requests and answers back; the server drives the schedulers."""
    api_ok = lambda m, i: (not _within(m, "engine.api")  # noqa: E731
                           or not any(_within(i, p) for p in ("engine.running", "engine.server", "engine.batch")))
    assert breaks(api_ok) == []


def _unit(name: str) -> str:
    """The package a module belongs to, one level under engine (engine.running, engine.loading)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "engine" and len(parts) > 1 else parts[0]


def documented_layers() -> dict[str, int]:
    """engine's packages -> their line in docs/architecture.md's order (0 the top), read from the doc itself."""
    text = (ROOT / "docs/architecture.md").read_text()
    block = text[text.index("within engine, top to bottom:"):].split("```")[0]
    layers = {}
    for depth, line in enumerate(ln for ln in block.splitlines()[1:] if ln.strip()):
        names = line.split("  ")[1] if line.startswith("  ") else line
        for name in names.replace(",", " ").split():
            if name.startswith("engine."):
                layers[name] = depth
    return layers


def test_every_engine_package_has_its_place_in_the_documented_order():
    units = {_unit(m) for m in modules() if _within(m, "engine") and m != "engine"}
    assert sorted(units - set(documented_layers())) == []


def test_engine_packages_import_only_their_own_line_or_below():
    """The order docs/architecture.md draws, which also rules out a circle between packages."""
    layers = documented_layers()
    inside = lambda n: _within(n, "engine") and n != "engine"  # noqa: E731
    ok = lambda m, i: (not (inside(m) and inside(i)) or _unit(m) == _unit(i)  # noqa: E731
                       or layers.get(_unit(m), -1) <= layers.get(_unit(i), -1))
    assert breaks(ok) == []


def test_engine_packages_form_no_circle():
    """Packages on one line of the order may import each other one way, never both (nor round a longer loop)."""
    graph: dict[str, set[str]] = {}
    for m in modules():
        if _within(m, "engine") and m != "engine":
            graph.setdefault(_unit(m), set()).update(
                _unit(i) for i in imports_of(m) if _within(i, "engine") and i != "engine" and _unit(i) != _unit(m))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
                   for n in graph.get(start, ()))

    assert sorted(u for u in graph if reaches(u, u, set())) == []


def test_every_module_is_on_the_map():
    """docs/architecture.md's map names every module (by its path, or its file name in its package's line)."""
    text = (ROOT / "docs/architecture.md").read_text()
    text = text[text.index("## Map"):text.index("## Dependency direction")]
    unnamed = [str(p.relative_to(ROOT)) for p in modules().values()
               if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in text and p.name not in text]
    assert unnamed == []


@pytest.mark.parametrize("limit,names", [(MAX_LINES, None), (400, ("engine.server.handler", "engine.api.openai"))])
def test_modules_stay_readable_in_one_sitting(limit, names):
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules().items() if names is None or m in names}
    assert {m: n for m, n in sizes.items() if n > limit} == {}
