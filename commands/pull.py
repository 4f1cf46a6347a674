"""`goinfer pull REF`: fetch a model into the goinfer cache (plan first, then download, verify, publish)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from commands.errors import EXIT_USAGE, user_errors
from commands.ui import FetchProgress, say

HELP = """Fetch a model into the local cache, so it loads offline afterwards.

REF is a built-in name (smollm2-135m, gemma3-270m) or a Hugging Face reference:

  hf:OWNER/REPO:QUANT        one GGUF of that quant (every shard of a split one)

  hf:OWNER/REPO:FILE.gguf    that file

  hf:OWNER/REPO:safetensors  the whole safetensors checkpoint (config, tokenizer, every shard)

  hf:OWNER/REPO              the repo's only GGUF; with several quants, they are listed

The plan (files, sizes, architecture, access) is checked before any weight byte moves. An interrupted pull resumes where it stopped when run again. HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE are honoured.

Examples:

  goinfer pull smollm2-135m

  goinfer pull hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M

  goinfer pull hf:ggml-org/gemma-3-270m-GGUF --json

Prints the path to load on stdout (a JSON object with --json). Exit status: 0 done, 2 bad reference or refused pull (the reason on stderr).
"""


def pull(
    ref: Annotated[str, typer.Argument(metavar="REF", help="Built-in name or hf:OWNER/REPO[:QUANT|:FILE.gguf|:safetensors].",
                                       show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
) -> None:
    from engine.store import builtin

    progress = FetchProgress()
    try:
        with user_errors():
            model = builtin.lookup(ref)
            if isinstance(model, builtin.BuiltinDirModel):  # a checkpoint directory: its files, their sizes
                path = builtin.ensure_builtin(model, progress=progress)
                result = {"name": model.name, "path": str(path), "files": [f.path for f in model.files],
                          "size": model.size}
            elif model is not None:
                path = builtin.ensure_builtin(model, progress=progress)
                result = {"name": model.name, "path": str(path), "files": [path.name], "size": path.stat().st_size}
            elif ref.strip().lower().startswith("hf:"):
                result = _pull_hf(ref, progress, as_json)
            else:
                from engine.store.resolve import resolve_model_ref

                path = resolve_model_ref(ref, progress=progress)  # a local file: nothing to fetch
                result = {"name": ref, "path": str(path), "files": [path.name], "size": path.stat().st_size}
    finally:
        progress.close()
    if as_json:
        print(json.dumps(result))
    else:
        print(result["path"])
        summary = f"goinfer: {result['name']}: {len(result['files'])} file(s), {result['size'] / 1e6:.1f} MB"
        if isinstance(model, builtin.BuiltinDirModel):  # not a chat model: --model would not load it
            say(f"{summary}: {model.description}")
        else:
            say(f"{summary}; use it with --model {result['name']}")


def _pull_hf(ref: str, progress: FetchProgress, as_json: bool) -> dict:
    from engine.store import hf

    try:
        plan = hf.plan_pull(ref, progress=progress)
    except hf.AmbiguousModelRef as exc:  # the choices are data: stdout; the reason: stderr
        progress.close()
        if as_json:
            print(json.dumps({"error": str(exc), "choices": exc.choices}))
        else:
            for choice in exc.choices:
                print(choice)
        say(f"goinfer: error: {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    say(f"goinfer: {plan.ref.name} ({plan.architecture}): {len(plan.files)} file(s), "
        f"{plan.total_bytes / 1e6:.1f} MB at {plan.commit[:12]}")
    path = hf.pull(plan.ref, progress=progress, plan=plan)
    return {"name": plan.ref.name, "path": str(path), "files": [f.path for f in plan.files],
            "size": plan.total_bytes, "commit": plan.commit, "architecture": plan.architecture}
