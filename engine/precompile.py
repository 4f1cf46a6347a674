"""`python -m engine.precompile MODEL [QUANT]`: compile a model's kernels into numba's on-disk cache.

What a first `goinfer chat` starts in the background (engine/kernels/cpu/step_compile.py says why): load the model
the way the foreground does (no self-test), run a short chat prompt through the prompt pass and one token through
it (the kernels the foreground needs right after its self-test: on a first run the two processes compile side by
side, and whichever is first leaves the kernel in the cache for the other), then one decode step, which compiles
the step (a minute or two) and writes it to the cache. Niced, so the foreground's answer comes first; under the
step-compile lock, so a second one started meanwhile leaves at once. Run by hand (or in a container image's
build, or CI) it compiles everything but the self-test's kernels in the foreground.
"""

from __future__ import annotations

import os
import sys

from engine.kernels.cpu.step_compile import hold_lock
from engine.load import load_model

WARM_MESSAGE = "Hello! Who are you? Answer in one sentence."


def main(argv: list[str]) -> int:
    model_ref, quant = argv[0], argv[1] if len(argv) > 1 else "auto"
    if hasattr(os, "nice"):
        os.nice(10)
    with hold_lock() as mine:
        if not mine:
            return 0
        model = load_model(model_ref, quant, selftest=False)
        ids = model.tokenizer.encode(model.render_chat([{"role": "user", "content": WARM_MESSAGE}]))
        cache = model.new_cache(len(ids) + 2)
        model.prefill(ids, cache)  # the prompt pass
        model.prefill(ids[-1:], cache)  # one token through it: how the foreground decodes until the step is ready
        model.decode(ids[-1:], [cache])  # the step
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
