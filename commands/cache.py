"""`goinfer cache` (list what is on disk), `goinfer cache rm NAME` and `goinfer cache warm [MODEL]`."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text
from rich.table import Table

from commands.errors import user_errors
from commands.options import QuantOption
from commands.ui import FetchProgress, say

HELP = """List the models in the local cache: name (what to pass to --model), size, complete or not; and the compiled CPU kernels (the entry named kernels).

An incomplete entry is a pull that was interrupted: run the same `goinfer pull` to resume it. The cache lives in $GOINFER_HOME (default ~/.cache/goinfer). `goinfer cache rm kernels` removes the compiled kernels (they compile again on next use); `goinfer cache warm MODEL` compiles a model's ahead.

Examples:

  goinfer cache

  goinfer cache --json

  goinfer cache rm hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M
"""

RM_HELP = """Remove a model (complete or not) from the cache, by the name `goinfer cache` lists.

A hf:OWNER/REPO name without a quant removes every pull of that repo.

Examples:

  goinfer cache rm smollm2-135m

  goinfer cache rm kernels

  goinfer cache rm hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M

  goinfer cache rm kernels
"""

WARM_HELP = """Compile every CPU kernel a model runs into the kernel cache now, its decode step included (a minute or two on 2 cores), so that its first chat or served request finds them compiled: for container images and CI.

Kernels compile once per machine and goinfer version, per tensor type and family: a model compiles what it runs, nothing else.

Examples:

  goinfer cache warm                       # the default model (smollm2-135m)

  goinfer cache warm gemma3-270m
"""

app = typer.Typer(help=HELP, add_completion=False, pretty_exceptions_enable=False)


@app.callback(invoke_without_command=True)
def cache(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array of entries.")] = False,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    from engine.store.cache import list_cache

    entries = list_cache()
    if as_json:
        print(json.dumps([e.to_json() for e in entries]))
        return
    if not entries:
        say("goinfer: the cache is empty (goinfer pull REF fetches a model)")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "SIZE", "STATUS", "PATH"):
        table.add_column(column, no_wrap=column != "PATH", overflow="fold")
    for e in entries:
        # Text cells: a name or path with [brackets] is shown as it is, never read as markup
        table.add_row(Text(e.name), f"{e.size / 1e6:.1f} MB", "complete" if e.complete else "incomplete",
                      Text(str(e.path)))
    # A pipe gets whole lines (no width to fit): scripts grep paths; a terminal folds the PATH column.
    Console(highlight=False, width=None if sys.stdout.isatty() else 1000).print(table)


@app.command(name="rm", help=RM_HELP)
def rm(name: Annotated[str, typer.Argument(metavar="NAME", help="A name as `goinfer cache` lists it.",
                                           show_default=False)]) -> None:
    from engine.store.cache import remove

    with user_errors():
        removed = remove(name)
    for path in removed:
        say(f"goinfer: removed {path}")


@app.command(name="warm", help=WARM_HELP)
def warm(model: Annotated[Optional[str], typer.Argument(
             metavar="[MODEL]", help="A .gguf path, checkpoint directory, built-in name or hf: reference (default: "
                                     "the default model).", show_default=False)] = None,
         quant: QuantOption = "auto") -> None:
    from engine.loading.precompile import compile_ahead, kernel_directory

    start = time.monotonic()
    with user_errors():
        progress = FetchProgress()
        try:
            llm = compile_ahead(model, quant, progress=progress)
        finally:
            progress.close()
    where = kernel_directory() or "numba's cache beside the sources (NUMBA_CACHE_DIR)"
    say(f"goinfer: {llm.name}'s kernels are compiled ({time.monotonic() - start:.0f} s), in {where}")
