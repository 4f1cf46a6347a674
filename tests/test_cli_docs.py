"""docs/cli.md is generated from --help (python -m goinfer_cli.gen_docs) and must not drift from it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_reference_matches_help():
    # A fresh process: the generator fixes Typer's width and colour settings before Typer is imported.
    r = subprocess.run([sys.executable, "-m", "goinfer_cli.gen_docs", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"{r.stderr}\n{r.stdout[-3000:]}"


def test_cli_reference_covers_every_command():
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for command in ("chat", "batch", "serve", "pull", "cache", "cache rm", "check"):
        assert f"## `goinfer {command}`" in text
        assert f"Usage: goinfer {command}" in text
