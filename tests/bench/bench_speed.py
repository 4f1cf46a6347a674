#!/usr/bin/env python3
"""Speed benchmark (not a test): goinfer on a GGUF, optionally side by side with llama.cpp.

Measures through the public API, wall clock, medians over --reps runs after one warm-up:
  load_s            engine.load_model (warm numba cache)
  ttft_s            time to the first token of a --prompt-tokens prompt (= prefill)
  prefill_tok_s     prompt tokens / ttft
  decode_tok_s      the next --gen-tokens greedy tokens / their time
  decode_sampled_tok_s  the same, sampled (temperature 0.8, top_p 0.95; goinfer only)
  peak_rss_mb       the process's peak resident memory
  read_gb_s         the machine's read bandwidth (tests/bench/bandwidth.py), before and after our runs
  decode_bandwidth_share  decode tok/s x the weight bytes a token reads (bytes_per_token_mb) / the best read_gb_s
With --llama-python PY (a python that has llama-cpp-python), runs ../shared/bench/llama_cpp_anchor.py on
the same file in the same sitting and prints both and our/their ratios. The two take turns, run by run (ours,
then one anchor run of one warm-up and one measured rep, --reps times): this VM's memory bandwidth drifts by
20-30 % over minutes (other tenants), and both engines' decode is bound by it, so measuring one engine's runs
all before the other's turned that drift into a 1.3x-2.1x spread of the same ratio between sittings.
Medians are taken over each side's runs; "rounds" lists each turn's pair and ratio.

Usage:
  python tests/bench/bench_speed.py MODEL.gguf [--quant auto] [--threads 2] [--prompt-tokens 512]
      [--gen-tokens 128] [--reps 3] [--llama-python /path/to/venv/bin/python]
The benchmark command may unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for itself (docs/benchmarks.md says
when it did); the product, tests and CI never touch them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bandwidth import read_bandwidth

ROOT = Path(__file__).resolve().parents[2]
ANCHOR = ROOT.parent / "shared" / "bench" / "llama_cpp_anchor.py"
FILLER = ("The history of mechanical clocks begins in medieval Europe, where monasteries needed a reliable way "
          "to mark the hours of prayer. Early tower clocks had no faces; they simply rang bells. ")


def measure_goinfer(path: str, quant: str, prompt_tokens: int, gen_tokens: int, reps: int,
                    between=lambda rep: None) -> dict:
    """Our figures; between(rep) runs after each measured greedy run (the other engine's turn)."""
    sys.path.insert(0, str(ROOT))
    import engine

    t0 = time.perf_counter()
    model = engine.load_model(path, quant=quant)
    load_s = time.perf_counter() - t0
    ids = model.tokenizer.encode(FILLER * (prompt_tokens // 10 + 1))[:prompt_tokens]
    _run(engine, model, ids, gen_tokens, temperature=0)  # warms up
    runs, foreign = [], []
    for rep in range(reps):
        busy0 = _foreign_busy()
        runs.append(_run(engine, model, ids, gen_tokens, temperature=0))
        foreign.append(_foreign_busy(busy0))
        between(rep)
    ttft = statistics.median(t for t, _ in runs)
    # Sampled as a chat client asks (llama.cpp's side stays greedy): the draw's cost on top of the step.
    sampled = [_run(engine, model, ids, gen_tokens, temperature=0.8, top_p=0.95, seed=rep)[1] for rep in range(reps)]
    return {
        "engine": "goinfer", "quant": quant, "compute_path": model.backend.path, "load_s": round(load_s, 3),
        "ttft_s": round(ttft, 4), "prefill_tok_s": round(prompt_tokens / ttft, 1),
        "decode_tok_s": round(statistics.median(d for _, d in runs), 1),
        "decode_sampled_tok_s": round(statistics.median(sampled), 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "foreign_cpu_frac": max(foreign),  # of the machine's CPU that others used during our runs (the worst)
        "runs": [{"prefill_tok_s": round(prompt_tokens / t, 1), "decode_tok_s": round(d, 1), "foreign_cpu_frac": f}
                 for (t, d), f in zip(runs, foreign)],
    }


def _run(engine, model, ids, gen_tokens, **sampling) -> tuple[float, float]:
    """(time to the first token, decode tok/s of the next gen_tokens) for one generation."""
    cache = model.new_cache(len(ids) + gen_tokens + 8)
    # logit_bias on EOG ids keeps generation going for exactly gen_tokens + 1 tokens; no log-probabilities
    # (as a server request that asks for none, and as llama.cpp's run computes none)
    bias = {t: -1e9 for t in model.tokenizer.eog_ids}
    start = time.perf_counter()
    first, n = None, 0
    for _ in engine.generate(model, ids, max_tokens=gen_tokens + 1, cache=cache, logit_bias=bias, logprobs=False,
                             **sampling):
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-python", help="a python with llama-cpp-python, to run llama.cpp in the same sitting")
    ap.add_argument("--cold", action="store_true",
                    help="also time load -> first token in fresh processes with an empty and a warm numba cache")
    a = ap.parse_args()
    os.environ["NUMBA_NUM_THREADS"] = str(a.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = str(a.threads)
    theirs: list[dict] = []  # one anchor result per turn

    def llama_turn(rep: int) -> None:
        if a.llama_python:
            theirs.append(_anchor(a.llama_python, a.model, a.threads, a.prompt_tokens, a.gen_tokens))

    bandwidth = [read_bandwidth()[0]]  # the machine's read bandwidth before and after our runs (it drifts)
    ours = measure_goinfer(a.model, a.quant, a.prompt_tokens, a.gen_tokens, a.reps, llama_turn)
    bandwidth.append(read_bandwidth()[0])
    token_bytes = decode_bytes(a.model)
    if a.cold:
        ours["first_token_cold_cache_s"] = _first_token_s(a.model, a.quant, a.threads, cold=True)
        ours["first_token_warm_cache_s"] = _first_token_s(a.model, a.quant, a.threads, cold=False)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {_cpu_name()}, {os.cpu_count()} cores",
              "threads": a.threads, "model": Path(a.model).name, "goinfer": ours,
              "read_gb_s": [round(b, 1) for b in bandwidth], "bytes_per_token_mb": round(token_bytes / 1e6, 1)}
    best_bw = max(bandwidth) * 1e9
    ours["decode_bandwidth_share"] = round(ours["decode_tok_s"] * token_bytes / best_bw, 3)
    if theirs:
        pf = statistics.median(t["prefill_tok_s_median"] for t in theirs)
        dc = statistics.median(t["decode_tok_s_median"] for t in theirs)
        result["llama_cpp"] = {
            "engine": theirs[0]["engine"], "version": theirs[0]["version"], "system_info": theirs[0]["system_info"],
            "prefill_tok_s_median": round(pf, 2), "decode_tok_s_median": round(dc, 2),
            "load_s": statistics.median(t["load_s"] for t in theirs),
            "foreign_cpu_frac": max(t["foreign_cpu_frac"] for t in theirs)}
        result["llama_cpp"]["decode_bandwidth_share"] = round(dc * token_bytes / best_bw, 3)
        result["ratio"] = {"prefill": round(ours["prefill_tok_s"] / pf, 2), "decode": round(ours["decode_tok_s"] / dc, 2)}
        result["rounds"] = [
            {"ours": r, "llama_cpp": {"prefill_tok_s": round(t["prefill_tok_s_median"], 1),
                                      "decode_tok_s": round(t["decode_tok_s_median"], 1),
                                      "foreign_cpu_frac": t["foreign_cpu_frac"]},
             "ratio": {"prefill": round(r["prefill_tok_s"] / t["prefill_tok_s_median"], 2),
                       "decode": round(r["decode_tok_s"] / t["decode_tok_s_median"], 2)}}
            for r, t in zip(ours["runs"], theirs)]
    print(json.dumps(result, indent=2))


def decode_bytes(path: str) -> int:
    """The weight bytes a decode step reads: every tensor of the file but the token embeddings (a row each token),
    which the output head reads whole where it is tied to them (no output.weight)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    embd = sizes.get("token_embd.weight", 0)
    return sum(sizes.values()) - (0 if "output.weight" not in sizes else embd)


def _anchor(python: str, model: str, threads: int, prompt_tokens: int, gen_tokens: int) -> dict:
    """One turn of llama.cpp: ../shared/bench/llama_cpp_anchor.py in its own process (load, one warm-up run, one
    measured run); its figures for the model, with the engine's description."""
    out = subprocess.run([python, str(ANCHOR), "--models", model, "--threads", str(threads), "--prompt-tokens",
                          str(prompt_tokens), "--gen-tokens", str(gen_tokens), "--reps", "1", "--warmup", "1"],
                         capture_output=True, text=True, check=True)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    res = dict(next(iter(run["models"].values())))
    res.update(engine=run["engine"], version=run["llama_cpp_python_version"], system_info=run["system_info"])
    return res


_FIRST_TOKEN = """
import sys, time
t0 = time.perf_counter()
import engine
model = engine.load_model(sys.argv[1], quant=sys.argv[2])
next(iter(engine.generate(model, model.tokenizer.encode("Hello"), max_tokens=2, temperature=0)))
print(time.perf_counter() - t0)
"""


def _first_token_s(path: str, quant: str, threads: int, cold: bool) -> float:
    """Seconds from a fresh interpreter (imports included) to the first generated token; cold: compiling every
    kernel into an empty numba cache (what a first run after install pays), else the cache the last run left."""
    import tempfile

    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as empty:
        if cold:
            env["NUMBA_CACHE_DIR"] = empty
        else:  # run once to be sure the cache holds this model's kernels
            subprocess.run([sys.executable, "-c", _FIRST_TOKEN, path, quant], cwd=ROOT, env=env, check=True,
                           capture_output=True)
        out = subprocess.run([sys.executable, "-c", _FIRST_TOKEN, path, quant], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True)
    return round(float(out.stdout.strip().splitlines()[-1]), 2)


def _foreign_busy(start: tuple[float, float, float] | None = None):
    """(busy jiffies of the whole machine, own CPU seconds, wall) now; with start: the share of the machine's CPU
    that other processes used since start (above ~0.05 the figures are contaminated: rerun on a quiet machine)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(vals[:8]) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")
    r = resource.getrusage(resource.RUSAGE_SELF)
    now = (busy, r.ru_utime + r.ru_stime, time.perf_counter())
    if start is None:
        return now
    wall = now[2] - start[2]
    return round(max(0.0, (now[0] - start[0]) - (now[1] - start[1])) / (wall * os.cpu_count()), 3)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
