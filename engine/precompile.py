"""`python -m engine.precompile MODEL [QUANT]`: compile a model's kernels into numba's on-disk cache.

What a first `goinfer chat` starts in the background (engine/kernels/cpu/step_compile.py says why), beside its own
self-test: load the model the way the foreground does (no self-test), generate two tokens of a short chat through
the prompt pass (the kernels the foreground needs after its self-test; whichever process compiles a kernel first
leaves it in the cache for the other) and the int8 GEMM of longer prompts where the model uses it, then run one
decode step, which compiles the step (a minute or two) and writes it to the cache. Niced, so the foreground's
answer comes first; under the step-compile lock, so a second one started meanwhile leaves at once. Run by hand (or
in a container image's build, or CI) it compiles all but the self-test's kernels in the foreground.
"""

from __future__ import annotations

import os
import sys

from engine.generate import generate
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
        step, model.backend.step = model.backend.step, None  # the prompt pass at one token, as a first run decodes
        try:
            for _ in generate(model, ids, max_tokens=2, temperature=0):
                pass
        finally:
            model.backend.step = step
        warm = getattr(model.backend.kernels, "warm_prompt_gemm", None)
        if warm is not None:  # the int8 GEMM of longer prompts (the warm-up chat is shorter than a prompt tile)
            warm()
        model.decode(ids[-1:], [model.new_cache(1)])  # the step
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
