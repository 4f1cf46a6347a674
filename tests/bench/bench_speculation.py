"""Speculative decoding by prompt lookup, side by side: goinfer's decode speed with `--speculate ngram` (the default)
and `off`, and llama.cpp's (llama-cpp-python) plain and with its prompt-lookup drafts (LlamaPromptLookupDecoding),
on the same GGUF and the same prompt tokens, greedy, in one sitting; engines take turns prompt by prompt.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python tests/bench/bench_speculation.py MODEL.gguf \\
        --llama-python /path/to/venv-with-llama-cpp-python/bin/python [--reps 3] [--max-tokens 200] [--threads 2]

Decode speed = the reply's tokens after its first / the time from the first to the last (the prompt pass is not
counted: both engines' prompt speed is in docs/benchmarks.md). Prompts: an edit of a code listing (most of the reply
copies the prompt), JSON fields pulled out of a text, a passage summarised with quotes, and a plain chat question
(little to copy: what drafting costs where it rarely guesses right). Prints one JSON line; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LISTING = '''import json
from pathlib import Path


def load_records(path):
    """Read one JSON record per line, skipping blank lines."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    return records


def save_records(path, records):
    """Write the records back, one per line, sorted by their id."""
    with open(path, "w", encoding="utf-8") as handle:
        for record in sorted(records, key=lambda r: r["id"]):
            handle.write(json.dumps(record) + "\\n")
'''
PASSAGE = ("The city council met on Tuesday to discuss the new library. Council member Ana Ruiz said the building "
           "would open in March and hold 120,000 books. The budget of 4.2 million dollars was approved by seven votes "
           "to two. Residents asked for longer opening hours on weekends, and the council agreed to review the hours "
           "after six months. The old library on Mill Street will become a community centre.")
PROMPTS = {
    "code edit": "In this Python module, rename the function load_records to read_records and save_records to "
                 "write_records. Reply with the whole module and nothing else.\n\n" + LISTING,
    "json extract": "Extract from this text a JSON object with the fields speaker, opening_month, books, budget and "
                    "vote, quoting the text's own words.\n\n" + PASSAGE,
    "summary": "Summarise this article in three sentences, quoting the council member's words.\n\n" + PASSAGE,
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}

_LLAMA = """
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
model, prompts, threads, max_tokens, draft = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), \\
    int(sys.argv[4]), int(sys.argv[5])
kw = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=draft)} if draft else {}
llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, **kw)
llm.create_completion(prompts[0][:8], max_tokens=4, temperature=0)
out = []
for ids in prompts:
    llm.reset()
    stamps = []
    for chunk in llm.create_completion(ids, max_tokens=max_tokens, temperature=0, stream=True):
        stamps.append(time.perf_counter())
    out.append({"tokens": len(stamps), "seconds": stamps[-1] - stamps[0]})
print(json.dumps(out))
"""


def _goinfer_runs(model, prompts: list[list[int]], max_tokens: int, speculation) -> list[dict]:
    from engine.generation.generate import generate

    out = []
    for ids in prompts:
        stamps = [time.perf_counter() for _ in generate(model, ids, max_tokens=max_tokens, temperature=0.0,
                                                         logprobs=False, speculation=speculation)]
        out.append({"tokens": len(stamps), "seconds": stamps[-1] - stamps[0]})
    return out


def _llama_runs(python: str, gguf: str, prompts_path: Path, threads: int, max_tokens: int, draft: int) -> list[dict]:
    done = subprocess.run([python, "-c", _LLAMA, gguf, str(prompts_path), str(threads), str(max_tokens), str(draft)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a GGUF file")
    ap.add_argument("--llama-python", help="a python with llama-cpp-python (omit: goinfer alone)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=4, help="goinfer's --draft-max")
    ap.add_argument("--llama-draft", type=int, default=10, help="llama.cpp's num_pred_tokens (its default: 10)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import engine
    from engine.generation.speculation import Speculation

    engine.set_threads(args.threads)
    model = engine.load_model(args.model)
    prompts = [list(model.tokenizer.encode(model.render_chat([{"role": "user", "content": p}])))
               for p in PROMPTS.values()]
    prompts_path = Path(tempfile.mkdtemp(prefix="goinfer-spec-bench-")) / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    _goinfer_runs(model, prompts[:1], 8, Speculation(draft_max=args.draft_max))  # warm: the step compiled
    engines = {"goinfer ngram": lambda: _goinfer_runs(model, prompts, args.max_tokens,
                                                       Speculation(draft_max=args.draft_max)),
               "goinfer off": lambda: _goinfer_runs(model, prompts, args.max_tokens, None)}
    if args.llama_python:
        engines["llama.cpp lookup"] = lambda: _llama_runs(args.llama_python, args.model, prompts_path, args.threads,
                                                          args.max_tokens, args.llama_draft)
        engines["llama.cpp plain"] = lambda: _llama_runs(args.llama_python, args.model, prompts_path, args.threads,
                                                         args.max_tokens, 0)
    rates: dict[str, dict[str, list[float]]] = {e: {p: [] for p in PROMPTS} for e in engines}
    tokens: dict[str, dict[str, int]] = {e: {} for e in engines}
    for rep in range(args.reps):
        for name, run in engines.items():
            for prompt, r in zip(PROMPTS, run()):
                rates[name][prompt].append((r["tokens"] - 1) / r["seconds"])
                tokens[name][prompt] = r["tokens"]
            print(f"rep {rep + 1}: {name} " + ", ".join(f"{p} {v[-1]:.1f}" for p, v in rates[name].items()),
                  file=sys.stderr)
    medians = {e: {p: round(statistics.median(v), 1) for p, v in by.items()} for e, by in rates.items()}
    print(json.dumps({"model": Path(args.model).name, "threads": args.threads, "max_tokens": args.max_tokens,
                      "decode_tok_s_median": medians, "reply_tokens": tokens,
                      "per_rep": {e: {p: [round(x, 1) for x in v] for p, v in by.items()} for e, by in rates.items()}}))


if __name__ == "__main__":
    main()
