"""`goinfer decisions-calibrate --model REF LABELLED.jsonl -o calibration.json`: one temperature per decision kind."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from commands.errors import EXIT_INTERRUPTED, fail, user_errors
from commands.options import ModelOption, NoSelftestOption, ThreadsOption
from commands.ui import FetchProgress, duration, err

HELP = """Fit the decisions route's calibration: one temperature per kind (noul, choice, score) for a model.

The kinds are the decisions route's question types: noul a yes/no question, choice one of named options, score
one level of an ordered scale (docs/decisions.md). LABELLED.jsonl holds one /v1/systemone request per line with
its correct answers beside it:

  {"state": "...", "questions": {"mood": {"type": "choice", "criteria": {...}}}, "answers": {"mood": "angry"}}

(noul answers are true/false, choice answers an option's name, score answers the level's integer). Every fifth
item is held out: the temperature is fitted on the rest (the negative log-likelihood, a bounded 1-D search) and
NLL, ECE and top-1 are reported before and after on both parts. Serve the result with
`goinfer serve --model REF --decisions-calibration calibration.json`.

Scoring takes a while (seconds per item on a small model): the time it will take is printed once the first item
is scored, and progress every 10 items or 5 seconds where stderr is not a terminal. Each scored item is kept in
OUTPUT.journal; after Ctrl-C or a kill, rerun the same command (same model, template and set) to resume.

Examples:

  goinfer decisions-calibrate --model smollm2-135m testdata/decisions/reviews.jsonl -o calibration.json

Exit status: 0 written, 2 bad usage, model, labelled set or journal, 130 interrupted (rerun to resume).
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
    from engine.decisions.calibration import Journal, calibrate, journal_header, read_labelled
    from engine.files import write_atomic
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
        journal = Journal(_journal_path(output), journal_header(llm, template, labelled, len(items)))
        resumed = len(journal.scored)
        if resumed:
            print(f"goinfer: resumed {resumed} of {len(items)} items from {journal.path}", file=sys.stderr)
        progress = _Progress(len(items), resumed)
        try:
            with Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          console=err, transient=True, disable=not err.is_terminal) as bar:
                task = bar.add_task("scoring", total=len(items), completed=resumed)

                def on_item(done: int, total: int) -> None:
                    bar.update(task, completed=done)
                    progress(done, bar.console.print if err.is_terminal else None)

                result = calibrate(llm, items, template, on_item=on_item, journal=journal)
        except KeyboardInterrupt:
            journal.close()
            print(f"goinfer: interrupted after {len(journal.scored)}/{len(items)} items; they are kept in "
                  f"{journal.path}: rerun the same command to resume", file=sys.stderr)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        try:
            write_atomic(output, (json.dumps(result, indent=2) + "\n").encode("utf-8"))
        except OSError as e:
            raise fail(f"{output}: cannot write ({e.strerror})") from None
        journal.remove()
    _report(result, output)


def _journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".journal")


class _Progress:
    """The estimate once this run's first two items are scored (their measured seconds per item, times the items
    this run scores), and,
    off a terminal, a plain line every 10 items or 5 seconds and at the end."""

    EVERY_ITEMS, EVERY_SECONDS = 10, 5.0

    def __init__(self, total: int, resumed: int):
        self.total, self.resumed = total, resumed
        self.start = self.last_time = time.monotonic()
        self.last_done = resumed

    def __call__(self, done: int, console_print) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        per_item = elapsed / (done - self.resumed)
        left = per_item * (self.total - done)
        todo = self.total - self.resumed
        if done == self.resumed + min(2, todo):
            line = (f"{todo} items to score, about {duration(per_item * todo)} on this machine "
                    f"({per_item:.1f}s an item so far)")
            if console_print is not None:
                console_print(line)
            else:
                _note(f"goinfer: {line}")
        if console_print is not None:
            return
        due = done - self.last_done >= self.EVERY_ITEMS or now - self.last_time >= self.EVERY_SECONDS
        if done == self.total or due:
            _note(f"goinfer: scored {done}/{self.total} items ({duration(elapsed)}"
                  + (f", about {duration(left)} left)" if done < self.total else ")"))
            self.last_done, self.last_time = done, now


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
