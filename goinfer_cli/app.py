"""The `goinfer` Typer app: registers the subcommands; each lives in commands/.

`goinfer NAME ...` imports only that command's module (the server's and the batch runner's modules cost ~0.3 s
of a one-shot `goinfer chat` otherwise); `app`, the whole CLI, is built on first use (help, tests, gen_docs).
"""

from __future__ import annotations

import gc
import importlib
import sys

import typer

# command -> (its module, no_args_is_help); a module holds HELP and a function of the command's name ("-" as "_"),
# or (cache) a Typer app of its own
COMMANDS = {"chat": ("commands.chat", False), "batch": ("commands.batch", True), "serve": ("commands.serve", False),
            "pull": ("commands.pull", True), "cache": ("commands.cache", None), "check": ("commands.check", False),
            "decisions-calibrate": ("commands.decisions_calibrate", True)}


def _print_version(asked: bool) -> None:
    if asked:
        from commands.version import goinfer_version

        typer.echo(f"goinfer {goinfer_version()}, Python {sys.version.split()[0]}")
        raise typer.Exit()


def _root(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                       help="Print goinfer's version and exit.")) -> None:
    """goinfer: a local LLM runtime."""


def _flags_take_no_value() -> None:
    """Typer 0.29's Rich help shows a flag's type as its value (`--version <bool>`, `--help <bool>`), though a
    flag takes none (its plain help leaves it out): show nothing there, as click does."""
    from typer.core import TyperOption
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_bare", False):  # an older Typer (nothing to mend), or mended
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag or self.count else shown(self, ctx)

    display_type_rich.flags_bare = True
    TyperOption.display_type_rich = display_type_rich


def build(names=tuple(COMMANDS)) -> typer.Typer:
    """The CLI with these commands (all by default), in COMMANDS' order."""
    _flags_take_no_value()
    cli = typer.Typer(
        name="goinfer",
        help="Run open LLMs locally: chat in the terminal, serve OpenAI/Anthropic-compatible APIs, batch jobs.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    for name in (n for n in COMMANDS if n in names):
        module_name, no_args_is_help = COMMANDS[name]
        module = importlib.import_module(module_name)
        if no_args_is_help is None:
            cli.add_typer(module.app, name=name, help=module.HELP)
        else:
            command = getattr(module, name.replace("-", "_"))
            cli.command(name=name, help=module.HELP, no_args_is_help=no_args_is_help)(command)
    cli.callback()(_root)
    return cli


def __getattr__(name: str):
    if name == "app":  # the whole CLI, built once
        globals()["app"] = build()
        return globals()["app"]
    raise AttributeError(name)


def main() -> None:
    first = sys.argv[1] if len(sys.argv) > 1 else None
    try:
        build((first,) if first in COMMANDS else tuple(COMMANDS))()
    finally:
        # The command is done: what is left is the interpreter's teardown, whose garbage collections walk every
        # object a loaded model made (~0.2 s of a 1.2 s one-shot chat). Frozen objects are not walked; exit
        # handlers and flushes still run.
        gc.freeze()


if __name__ == "__main__":
    main()
