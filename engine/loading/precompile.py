"""Compiling a model's kernels ahead of its use, into the kernel cache (engine/kernels/kernel_cache.py).

- `compile_ahead(model)`: everything a model runs, in this process (`goinfer cache warm`, container image builds,
  CI): load it with its kernel self-test, generate two tokens of a short chat through the prompt pass, the int8
  GEMM of longer prompts where the model uses it, then one decode step, which compiles the step (a minute or two
  on 2 cores).
- `python -m engine.loading.precompile MODEL QUANT [--tied PID]`: the background compile a first run starts
  (engine/kernels/cpu/step_compile.py says why): the same without the self-test (the foreground runs that),
  niced so the foreground's answer comes first, under the step-compile lock (a second one started meanwhile
  leaves at once), ended by SIGALRM after step_compile.COMPILE_LIMIT_S whatever happens. With --tied it also ends
  as soon as process PID does (a server's compile never outlives the server).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from engine.generation.generate import generate
from engine.kernels.kernel_cache import active_directory as kernel_directory
from engine.kernels.kernel_cache import record_compile_time
from engine.kernels.cpu.step_compile import COMPILE_LIMIT_S, announce_running, hold_lock, stop_running
from engine.loading.load import load_model

# the commands' view of compiling
__all__ = ["announce_running", "compile_ahead", "kernel_directory", "main", "record_compile_time", "stop_running",
           "warm_prompt_pass"]

WARM_MESSAGE = "Hello! Who are you? Answer in one sentence."


def compile_ahead(model_ref, quant: str = "auto", *, selftest: bool = True, progress=None):
    """Compile every kernel `model_ref` runs (its self-test's too, unless selftest=False) into the cache;
    returns the model."""
    model = load_model(model_ref, quant, selftest=selftest, progress=progress)
    ids = warm_prompt_pass(model)
    warm = getattr(getattr(model.backend, "kernels", None), "warm_prompt_gemm", None)
    if warm is not None:  # the int8 GEMM of longer prompts (the warm-up chat is shorter than a prompt tile)
        warm()
    model.decode(ids[-1:], [model.new_cache(1)])  # the step
    return model


def warm_prompt_pass(model) -> list[int]:
    """Two tokens of a short chat through the prompt pass (its kernels compiled or loaded now, not in the first
    request), as a model decodes while its step compiles elsewhere; returns the chat's ids."""
    ids = model.tokenizer.encode(model.render_chat([{"role": "user", "content": WARM_MESSAGE}]))
    backend = model.backend
    has_step = hasattr(backend, "step")  # (a device backend has none to take away: its own decode runs)
    step = getattr(backend, "step", None)
    if has_step:
        backend.step = None
    try:
        for _ in generate(model, ids, max_tokens=2, temperature=0):
            pass
    finally:
        if has_step:
            backend.step = step
    return ids


def _watch_parent(parent: int) -> None:
    """End this process as soon as `parent` has gone (its pid no longer our parent's)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str]) -> int:
    args = list(argv)
    tied = None
    if "--tied" in args:
        at = args.index("--tied")
        tied = int(args[at + 1])
        del args[at : at + 2]
    model_ref, quant = args[0], args[1] if len(args) > 1 else "auto"
    if tied is not None:
        threading.Thread(target=_watch_parent, args=(tied,), daemon=True).start()
    if hasattr(os, "nice"):
        os.nice(10)
    with hold_lock() as mine:
        if not mine:
            return 0
        compile_ahead(model_ref, quant, selftest=False)
    record_compile_time("step", from_empty=False)  # what the next first run's announcement will expect
    return 0


if __name__ == "__main__":
    if hasattr(signal, "SIGALRM"):  # (only as its own process: an alarm set in a caller's would end that one)
        signal.alarm(COMPILE_LIMIT_S)  # default action: the process ends, mid-compile if it must
    sys.exit(main(sys.argv[1:]))
