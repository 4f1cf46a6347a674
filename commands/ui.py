"""Terminal output shared by the commands: one Rich console on stderr (progress, notices), plain
stdout for data. Progress bars appear only on a terminal; NO_COLOR is honoured by Rich itself.

Every notice goes through `say`: text filled in at run time (a user's input, a model's name, an error message)
is never read as Rich markup, where `[/x]` would end the program with a MarkupError.
"""
from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.text import Text

err = Console(stderr=True, highlight=False)


def say(text: str, *, lead: str = "", lead_style: str = "", style: str = "", console: Console | None = None) -> None:
    """One notice on stderr, unwrapped: text exactly as given, after an optional styled lead ("warning:")."""
    line = Text()
    if lead:
        line.append(lead + " ", style=lead_style)
    line.append(str(text), style=style)
    (console or err).print(line, soft_wrap=True)


def thought(text: str) -> None:
    """A piece of a thinking model's reasoning, dimmed on stderr as it streams (stdout keeps only the answer)."""
    err.print(Text(text, style="dim"), end="", soft_wrap=True)


class FetchProgress:
    """A progress callback for engine.store: a Rich bar on a terminal, plain lines otherwise."""

    def __init__(self):
        self._progress: Progress | None = None
        self._tasks: dict[str, int] = {}
        self._last_plain: dict[str, int] = {}

    def __call__(self, description: str, done: int, total: int | None) -> None:
        if not err.is_terminal:
            step = self._last_plain.get(description, -1)
            pct = int(100 * done / total) if total else -1
            if pct // 25 != step // 25 or (total and done >= total and step != 100):
                self._last_plain[description] = pct
                print(f"goinfer: {description}: {done / 1e6:.1f} MB" + (f" / {total / 1e6:.1f} MB" if total else ""),
                      file=sys.stderr)
            return
        if self._progress is None:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=False)
            self._progress.start()
        if description not in self._tasks:
            self._tasks[description] = self._progress.add_task(description, total=total)
        self._progress.update(self._tasks[description], completed=done, total=total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def placement_text(placement: dict) -> str:
    """Where a model runs, for a banner: "backend webgpu (ADAPTER)" or "backend cpu", and why when the backend is
    not the one asked for (auto without a real GPU, a failed self-test), so a silent fallback is never silent."""
    text = f"backend {placement['backend']}"
    adapter = placement.get("adapter") or {}
    if placement["backend"] == "webgpu" and adapter.get("adapter"):
        text += f" ({adapter['adapter']}{', software' if adapter.get('software') else ''})"
    if placement.get("reason"):
        text += f" — {placement['asked']}: {placement['reason']}"
    return text


def duration(seconds: float) -> str:
    """A span as a progress line shows it: 42s, 3m07s, 1h05m (rounded down to the second)."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
