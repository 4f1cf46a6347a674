"""Embedding throughput, side by side: 1,000 sentences of 10-60 words embedded with the built-in encoder (minilm-l6,
all-MiniLM-L6-v2) by `goinfer serve --embed-model` through HTTP, by llama.cpp (llama-cpp-python, embedding=True,
mean pooling) on the f16 GGUF of the same checkpoint, and by sentence-transformers on CPU torch. The comparators run
in a separate benchmark venv (`--bench-python`: torch, sentence-transformers, llama-cpp-python; never goinfer's
dependencies); each in its own process, taking turns rep by rep; medians of sentences per second.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python tests/bench/bench_embeddings.py \\
        --bench-python /path/to/bench-venv/bin/python [--reps 3] [--threads 2] [--clients 4] [--batch 16] \\
        [--embed-quant f32|q8] [--peers llama.cpp,sentence-transformers]

goinfer's clients send `--batch` sentences per request from `--clients` threads at once (the server batches
concurrent requests into shared passes); the in-process comparators get the whole list in one call with their own
batching (sentence-transformers batch_size 32; llama.cpp one sequence per llama_decode batch slot, n_batch 512).
Prints one JSON line; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the of and to in is was that for on as with by at from his her an have had are were this which be or "
         "its their one all been has more when who will would there new other about after first also many some "
         "time these two may people into only over such years most city river music history school water light "
         "small large early later under world state during between through house group known used part made "
         "found called began near north south east west century government company system family series team "
         "language market village island church station museum garden forest bridge mountain harbour library "
         "engine theory method result energy signal machine model network program research student teacher").split()


def sentences(n: int = 1000, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(10, 60))]
        out.append(" ".join(words).capitalize() + ".")
    return out


_LLAMA = """
import json, sys, time
from llama_cpp import Llama, LLAMA_POOLING_TYPE_MEAN
texts = json.load(open(sys.argv[1])); threads = int(sys.argv[3])
llm = Llama(model_path=sys.argv[2], embedding=True, pooling_type=LLAMA_POOLING_TYPE_MEAN, n_ctx=512, n_batch=512,
            n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
llm.embed(texts[:8])
t = time.perf_counter(); llm.embed(texts); print(json.dumps({"seconds": time.perf_counter() - t}))
"""

_SBERT = """
import json, sys, time
import torch
from sentence_transformers import SentenceTransformer
texts = json.load(open(sys.argv[1])); torch.set_num_threads(int(sys.argv[3]))
model = SentenceTransformer(sys.argv[2], device="cpu")
model.encode(texts[:8])
t = time.perf_counter(); model.encode(texts, batch_size=32); print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def _comparator(python: str, code: str, texts_path: Path, model: str, threads: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([python, "-c", code, str(texts_path), model, str(threads)], capture_output=True, text=True,
                         env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def _goinfer(texts: list[str], threads: int, clients: int, batch: int, quant: str) -> float:
    import httpx

    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "goinfer_cli.app", "serve", "--embed-model", "minilm-l6",
                             "--addr", "127.0.0.1:0", "--threads", str(threads), "--embed-quant", quant],
                            stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"listening on (http://[\d.:]+)", Path(log.name).read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(Path(log.name).read_text())
            time.sleep(0.1)
        url = m.group(1) + "/v1/embeddings"
        with httpx.Client(timeout=600) as c:
            c.post(url, json={"input": texts[:8]}).raise_for_status()  # warm: the compiled GELU loaded
        chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
        work = iter(chunks)
        lock = threading.Lock()

        def client() -> None:
            with httpx.Client(timeout=600) as c:
                while True:
                    with lock:
                        chunk = next(work, None)
                    if chunk is None:
                        return
                    r = c.post(url, json={"input": chunk, "encoding_format": "base64"})
                    r.raise_for_status()

        t = time.perf_counter()
        threads_ = [threading.Thread(target=client) for _ in range(clients)]
        for th in threads_:
            th.start()
        for th in threads_:
            th.join()
        return time.perf_counter() - t
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-python", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--embed-quant", default="f32", help="goinfer's --embed-quant (f32 or q8)")
    ap.add_argument("--peers", default="llama.cpp,sentence-transformers",
                    help="comma-separated: which comparators run beside goinfer")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from engine.store.resolve import resolve_model_ref
    from testdata.make_bert_gguf import write_bert_gguf

    texts = sentences()
    model_dir = resolve_model_ref("minilm-l6")
    work = Path(tempfile.mkdtemp(prefix="goinfer-embed-bench-"))
    texts_path = work / "texts.json"
    texts_path.write_text(json.dumps(texts))
    gguf = write_bert_gguf(model_dir, work / "all-MiniLM-L6-v2.f16.gguf", "f16")
    runs: dict[str, list[float]] = {"goinfer": [], **{p: [] for p in args.peers.split(",") if p}}
    for rep in range(args.reps):
        for name in runs:
            if name == "goinfer":
                seconds = _goinfer(texts, args.threads, args.clients, args.batch, args.embed_quant)
            elif name == "llama.cpp":
                seconds = _comparator(args.bench_python, _LLAMA, texts_path, str(gguf), args.threads)
            else:
                seconds = _comparator(args.bench_python, _SBERT, texts_path, str(model_dir), args.threads)
            runs[name].append(len(texts) / seconds)
            print(f"rep {rep + 1}: {name} {len(texts) / seconds:.1f} sentences/s", file=sys.stderr)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    best_other = max((v for name, v in medians.items() if name != "goinfer"), default=None)
    print(json.dumps({"sentences": len(texts), "threads": args.threads, "clients": args.clients,
                      "batch": args.batch, "per_rep": runs, "median_sentences_per_s": medians,
                      "embed_quant": args.embed_quant,
                      "goinfer_over_faster_peer": best_other and medians["goinfer"] / best_other}))


if __name__ == "__main__":
    main()
