"""Every command's --help fits an 80-column terminal: flags show no value, no option name is cut (issue 46)."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from goinfer_cli.app import build

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CUT_NAME = re.compile(r"(?<![\w-])-[\w-]*…")  # `--decisions-templa…`: Rich ran out of room for a name


def _paths(command, path=()):
    out = [path]
    for name, sub in (getattr(command, "commands", None) or {}).items():
        if not getattr(sub, "hidden", False):
            out += _paths(sub, path + (name,))
    return out


def _command(root, path):
    for name in path:
        root = root.commands[name]
    return root


APP = build()
ROOT = typer.main.get_command(APP)
PATHS = _paths(ROOT)


def _help(path, monkeypatch) -> str:
    import typer.rich_utils

    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 80, raising=False)  # TERMINAL_WIDTH, if set, would win
    r = CliRunner().invoke(APP, [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"}, terminal_width=80,
                           color=False, prog_name="goinfer")
    assert r.exit_code == 0, r.output
    return ANSI.sub("", r.output)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "goinfer")
def test_help_fits_80_columns(path, monkeypatch):
    out = _help(path, monkeypatch)
    assert "<bool>" not in out  # a flag takes no value
    assert not CUT_NAME.search(out), CUT_NAME.findall(out)
    assert max(len(line) for line in out.splitlines()) <= 80
    for param in _command(ROOT, path).params:
        if getattr(param, "hidden", False) or param.param_type_name != "option":
            continue
        for name in (*param.opts, *param.secondary_opts):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", out), f"{name} cut or missing:\n{out}"


def test_serve_help_groups_its_options_in_panels(monkeypatch):
    out = _help(("serve",), monkeypatch)
    for panel in ("Model", "Server", "Security", "Limits", "Sessions", "Reasoning", "Embeddings", "Decisions"):
        assert f"╭─ {panel} " in out


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_short_version_flag(flag):
    r = CliRunner().invoke(APP, [flag], color=False)
    assert r.exit_code == 0 and r.output.startswith("goinfer "), r.output
    assert r.output == CliRunner().invoke(APP, ["--version"], color=False).output
