"""Turn engine errors into one line on stderr and an exit code: never a traceback for bad input."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import typer

from engine.errors import GoinferError

EXIT_USAGE = 2  # bad input or usage: missing/invalid model file, bad flag value
EXIT_INTERRUPTED = 130


def fail(message: str, code: int = EXIT_USAGE) -> "typer.Exit":
    print(f"goinfer: error: {message}", file=sys.stderr)
    return typer.Exit(code)


@contextmanager
def user_errors():
    """Map engine errors and Ctrl-C to one stderr line and the documented exit code."""
    try:
        yield
    except GoinferError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        print("goinfer: interrupted", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED) from None
