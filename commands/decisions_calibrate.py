"""`goinfer decisions-calibrate --model REF LABELLED.jsonl -o calibration.json`: one temperature per decision kind."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from commands.errors import fail, user_errors
from commands.options import ModelOption, NoSelftestOption, ThreadsOption
from commands.ui import FetchProgress, err

HELP = """Fit the decisions route's calibration: one temperature per kind (noul, choice, score) for a model.

LABELLED.jsonl holds one /v1/systemone request per line with its correct answers beside it:

  {"state": "...", "questions": {"mood": {"type": "choice", "criteria": {...}}}, "answers": {"mood": "angry"}}

(noul answers are true/false, choice answers an option's name, score answers the level's integer). Every fifth
item is held out: the temperature is fitted on the rest (the negative log-likelihood, a bounded 1-D search) and
NLL, ECE and top-1 are reported before and after on both parts. Serve the result with
`goinfer serve --model REF --decisions-calibration calibration.json`.

Examples:

  goinfer decisions-calibrate --model smollm2-135m testdata/decisions/sentiment.jsonl -o calibration.json

Exit status: 0 written, 2 bad usage, model or labelled set.
"""


def decisions_calibrate(
    labelled: Annotated[Path, typer.Argument(metavar="LABELLED.jsonl", help="Decisions requests with answers.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write calibration.json.")],
    model: ModelOption = None,
    template: Annotated[str, typer.Option(
        "--decisions-template", help="The template the server will use: chat-v1 or bare-v1.")] = "chat-v1",
    threads: ThreadsOption = None,
    no_selftest: NoSelftestOption = False,
) -> None:
    from engine import load_model, set_threads
    from engine.decisions.calibration import calibrate, read_labelled
    from engine.decisions.prompts import TEMPLATES

    if template not in TEMPLATES:
        raise fail(f"--decisions-template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    if threads is not None and threads < 1:
        raise fail(f"--threads must be >= 1, got {threads}")
    with user_errors():
        items = read_labelled(labelled)  # a bad set is refused before the model loads
        fetch = FetchProgress()
        try:
            set_threads(threads)
            llm = load_model(model, progress=fetch, selftest=not no_selftest)
        finally:
            fetch.close()
        with Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err,
                      transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("scoring", total=len(items))
            result = calibrate(llm, items, template, on_item=lambda done, total: bar.update(task, completed=done))
        try:
            output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise fail(f"{output}: cannot write ({e.strerror})") from None
    _report(result, output)


def _report(result: dict, output: Path) -> None:
    """The figures per kind and part: a table on a terminal, one plain line each otherwise (logs, pipes)."""
    rows = []
    for kind, entry in result["kinds"].items():
        rows.append((kind, entry["temperature"], "fit", entry["items"], entry["before"], entry["after"]))
        if "held_out" in entry:
            h = entry["held_out"]
            rows.append((kind, entry["temperature"], "held-out", h["items"], h["before"], h["after"]))
    if err.is_terminal:
        table = Table(title=f"decisions calibration ({result['template']}, {result['model']['file']})")
        for column in ("kind", "T", "part", "items", "NLL before", "NLL after", "ECE before", "ECE after", "top-1"):
            table.add_column(column)
        for kind, t, part, n, before, after in rows:
            table.add_row(kind, f"{t:.3f}", part, str(n), f"{before['nll']:.4f}", f"{after['nll']:.4f}",
                          f"{before['ece']:.4f}", f"{after['ece']:.4f}", f"{after['top1']:.3f}")
        err.print(table)
    else:
        for kind, t, part, n, before, after in rows:
            print(f"goinfer: {kind} T={t:.3f} {part}: {n} items, NLL {before['nll']:.4f} -> {after['nll']:.4f}, "
                  f"ECE {before['ece']:.4f} -> {after['ece']:.4f}, top-1 {after['top1']:.3f}", file=sys.stderr)
    print(f"goinfer: wrote {output}", file=sys.stderr)
