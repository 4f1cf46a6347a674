"""Options that several commands share, each defined once so their flags and help cannot drift apart.

Use one as a parameter's type and give the default at the parameter: `quant: QuantOption = "auto"`.
Options whose meaning differs between commands (serve's repeatable --model NAME=REF, its per-model
--threads, the sampling flags that batch only fills in where a line sets none) stay in their command.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

__all__ = ["ModelOption", "NoSelftestOption", "QuantOption", "ThreadsOption"]

ModelOption = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="A .gguf path, a safetensors checkpoint directory, a built-in name or "
                          "hf:OWNER/REPO[:QUANT|:safetensors].")]

QuantOption = Annotated[str, typer.Option(help="Compute path: auto or f32.")]

ThreadsOption = Annotated[Optional[int], typer.Option(
    help="CPU threads for the kernels and BLAS (default: all cores).")]

NoSelftestOption = Annotated[bool, typer.Option("--no-selftest", help="Skip the kernel self-test at model load.")]
