"""Generate docs/cli.md from the `--help` of every command, so the reference cannot drift.

    python -m goinfer_cli.gen_docs          rewrite docs/cli.md
    python -m goinfer_cli.gen_docs --check  exit 1 (with a diff) when docs/cli.md is stale

Help is rendered at a fixed width without colour, in this fresh process (Typer reads its terminal
settings at import), so the output is the same on every machine.
"""

from __future__ import annotations

import os

# Before typer/rich are imported: they read these once.
os.environ.update({"TERMINAL_WIDTH": "100", "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb",
                   "_TYPER_FORCE_DISABLE_TERMINAL": "1"})
os.environ.pop("FORCE_COLOR", None)

import difflib  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import typer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from goinfer_cli.app import app  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"

HEADER = """# Command-line reference

Generated from `--help` by `python -m goinfer_cli.gen_docs`; do not edit by hand (a test compares).
Conventions: data on stdout, progress and errors on stderr; exit status 2 for bad usage or input.
"""


def _commands(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path, depth first; groups (Typer's own click) have a `commands` mapping."""
    out = [path]
    for name, sub in (getattr(command, "commands", None) or {}).items():  # registration order, as --help lists
        if not getattr(sub, "hidden", False):
            out += _commands(sub, path + (name,))
    return out


def _help(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], prog_name="goinfer", terminal_width=100, color=False)
    if result.exit_code != 0:
        raise RuntimeError(f"goinfer {' '.join(path)} --help failed: {result.output}")
    lines = [line.rstrip() for line in result.output.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines).rstrip() + "\n"


def render() -> str:
    parts = [HEADER]
    for path in _commands(typer.main.get_command(app)):
        title = "goinfer " + " ".join(path) if path else "goinfer"
        parts.append(f"\n## `{title.strip()}`\n\n```text\n{_help(path)}```\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                       "docs/cli.md", "generated"))
            print("docs/cli.md is stale: run python -m goinfer_cli.gen_docs", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
