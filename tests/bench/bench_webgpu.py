"""A model on WebGPU beside the same model on the CPU: prompt and decode speed, and the host's share of a decode step.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python tests/bench/bench_webgpu.py \\
        [--model smollm2-135m] [--prompt-tokens 64] [--decode-tokens 8] [--reps 3]

In process, taking turns rep by rep: `--backend webgpu` (the best adapter wgpu sees, software ones included) and
the CPU's default path. Per backend: prompt tokens/s (a fresh cache each rep), decode tokens/s (one sequence), and
for WebGPU the milliseconds the host spends encoding and submitting one decode step's recorded plan (what bounds a
fast GPU). Prints one JSON line of medians; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _timed_decode(model, cache, steps: int) -> float:
    t = time.perf_counter()
    token = 7
    for _ in range(steps):
        token = int(model.decode([token], [cache])[0].argmax())
    return steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from engine import load_model
    from engine.kernels.webgpu import program

    models = {name: load_model(args.model, backend=name) for name in ("webgpu", "cpu")}
    gpu = models["webgpu"]
    if gpu.placement["backend"] != "webgpu":
        sys.exit(f"bench_webgpu: the model did not go on WebGPU: {gpu.placement}")
    ids = list(range(100, 100 + args.prompt_tokens))
    host_ms: list[float] = []
    run = program.Plan.run

    def timed_run(plan):  # the host's part of a step: encoding the recorded dispatches and submitting them
        t = time.perf_counter()
        run(plan)
        host_ms.append(1000 * (time.perf_counter() - t))

    figures: dict[str, dict[str, list[float]]] = {n: {"prompt": [], "decode": []} for n in models}
    for rep in range(args.reps):
        for name, model in models.items():
            cache = model.new_cache(args.prompt_tokens + args.decode_tokens + 1)
            t = time.perf_counter()
            model.prefill(ids, cache)
            figures[name]["prompt"].append(args.prompt_tokens / (time.perf_counter() - t))
            program.Plan.run = timed_run if name == "webgpu" else run
            figures[name]["decode"].append(_timed_decode(model, cache, args.decode_tokens))
            program.Plan.run = run
            print(f"rep {rep} {name}: prompt {figures[name]['prompt'][-1]:.1f} tok/s, "
                  f"decode {figures[name]['decode'][-1]:.2f} tok/s", file=sys.stderr, flush=True)
    out = {"model": args.model, "adapter": gpu.placement["adapter"]["adapter"],
           "software_adapter": gpu.placement["adapter"]["software"], "prompt_tokens": args.prompt_tokens,
           "decode_tokens": args.decode_tokens, "reps": args.reps,
           "webgpu_host_ms_per_decode_step": round(statistics.median(host_ms), 2)}
    for name, f in figures.items():
        out[f"{name}_prompt_tok_s"] = round(statistics.median(f["prompt"]), 1)
        out[f"{name}_decode_tok_s"] = round(statistics.median(f["decode"]), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
