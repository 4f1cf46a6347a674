"""The `goinfer` Typer app: registers the subcommands; each lives in commands/."""

from __future__ import annotations

import typer

from commands import batch as batch_cmd
from commands import cache as cache_cmd
from commands import chat as chat_cmd
from commands import check as check_cmd
from commands import pull as pull_cmd
from commands import serve as serve_cmd

app = typer.Typer(
    name="goinfer",
    help="Run open LLMs locally: chat in the terminal, serve OpenAI/Anthropic-compatible APIs, batch jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command(name="chat", help=chat_cmd.HELP, no_args_is_help=False)(chat_cmd.chat)
app.command(name="batch", help=batch_cmd.HELP, no_args_is_help=True)(batch_cmd.batch)
app.command(name="serve", help=serve_cmd.HELP, no_args_is_help=False)(serve_cmd.serve)
app.command(name="pull", help=pull_cmd.HELP, no_args_is_help=True)(pull_cmd.pull)
app.add_typer(cache_cmd.app, name="cache", help=cache_cmd.HELP)
app.command(name="check", help=check_cmd.HELP, no_args_is_help=True)(check_cmd.check)


@app.callback()
def _root() -> None:
    """goinfer: a local LLM runtime."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
