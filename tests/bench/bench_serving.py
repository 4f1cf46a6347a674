#!/usr/bin/env python3
"""Serving benchmark (not a test): streaming clients through real HTTP servers, one client alone and N at once.

Starts `goinfer serve` on MODEL (and, with --baseline-root DIR, the goinfer checked out in DIR on the same file;
with --llama-server PATH, llama.cpp's server with --parallel N), then, --reps times, server after server: one
client alone, then N clients at once, each streaming a /v1/completions of --tokens tokens (greedy, end-of-text
banned by logit_bias so every reply has exactly that length; distinct prompts). Reports per server, medians over
the reps:
  single_tok_s      one client's decode rate: (tokens - 1) / (last token - first token)
  aggregate_tok_s   N clients: all their tokens after each one's first / (last token of any - first token of any)
  scaling           aggregate_tok_s / single_tok_s
  burst_s           N clients: request sent -> last byte of the last reply (prompts included)

Usage:
  python tests/bench/bench_serving.py MODEL.gguf [--clients 4] [--tokens 128] [--reps 3] [--threads 2]
      [--baseline-root /path/to/older/checkout] [--llama-server /path/to/llama-server] [--speculate-off-too]
The benchmark command may unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for itself (docs/benchmarks.md says when it
did); the product, tests and CI never touch them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
TOPICS = ["a lighthouse keeper", "the first clockmakers", "a city under the sea", "a dragon who feared fire",
          "an old violin", "the last train home", "a garden on the moon", "a lost library"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, label: str, cmd: list[str], port: int, cwd: Path | None = None, env: dict | None = None):
        self.label, self.url = label, f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/bench_serving_{label.replace(' ', '_')}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{label} exited: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{label} did not start: see {self.log.name}")

    def quiet(self, timeout: float = 300) -> None:
        """Wait until a goinfer server has nothing running and nothing warming (its idle-time work would take the
        CPU from the server being measured: on a 2-core machine that skews any side-by-side run)."""
        deadline, calm = time.monotonic() + timeout, 0
        while time.monotonic() < deadline and calm < 2:
            models = httpx.get(self.url + "/health", timeout=10).json().get("models")
            if models is None:  # not goinfer (llama.cpp's /health)
                return
            calm = calm + 1 if not any(m.get("busy") or m.get("warming") for m in models) else 0
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def stream(url: str, prompt: str, tokens: int, banned: list[int]) -> dict:
    """One streamed completion over a raw socket (HTTP/1.0: the body ends when the server closes), timing each
    event as its bytes arrive. No JSON parsing or HTTP library on this side: on a 2-core machine a client's own
    per-token work would take CPU from the server it measures."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100 for t in banned}}
    sent = time.perf_counter()
    times: list[float] = []
    tail = b""
    for now, data in raw_post(url, "/v1/completions", body):
        both = tail + data  # an event's marker may straddle two reads
        times += [now] * both.count(b"data: {")
        tail = both[-6:]
    return {"sent": sent, "times": times, "end": time.perf_counter()}


def raw_post(url: str, path: str, body: dict):
    """POST a JSON body over a raw socket (HTTP/1.0: the answer ends when the server closes); yields (time, bytes)
    as they arrive. A status other than 200 ends the benchmark."""
    payload = json.dumps(body).encode()
    host, port = url.split("//")[1].split(":")
    head = (f"POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    first = True
    with socket.create_connection((host, int(port)), timeout=900) as sock:
        sock.sendall(head + payload)
        while True:
            data = sock.recv(65536)
            if not data:
                return
            if first and b" 200 " not in data.split(b"\r\n", 1)[0]:
                raise SystemExit(f"{url}: {data[:300]!r}")
            first = False
            yield time.perf_counter(), data


def burst(url: str, n: int, tokens: int, banned: list[int], rep: int) -> list[dict]:
    out: list = [None] * n
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        out[i] = stream(url, f"Tell me a story about {TOPICS[(i + rep) % len(TOPICS)]}.", tokens, banned)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def single_rate(r: dict) -> float:
    t = r["times"]
    return (len(t) - 1) / (t[-1] - t[0])


def aggregate_rate(rs: list[dict]) -> float:
    first = min(r["times"][0] for r in rs)
    last = max(r["times"][-1] for r in rs)
    return sum(len(r["times"]) - 1 for r in rs) / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--baseline-root", help="an older goinfer checkout to serve the same file beside this one")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (run with --parallel CLIENTS)")
    ap.add_argument("--speculate-off-too", action="store_true",
                    help="also serve this checkout with --speculate off (speculative decoding's gain, side by side)")
    ap.add_argument("--banned", default="0,2", help="token ids kept from ending a reply (SmolLM2's end tokens)")
    a = ap.parse_args()
    banned = [int(t) for t in a.banned.split(",") if t]
    env = {**os.environ, "NUMBA_NUM_THREADS": str(a.threads), "OPENBLAS_NUM_THREADS": str(a.threads)}
    servers = []
    ours = [("goinfer", ROOT)] + ([("goinfer --speculate off", ROOT)] if a.speculate_off_too else [])
    for label, root in ours + ([("goinfer baseline", Path(a.baseline_root))] if a.baseline_root else []):
        port = _free_port()
        cmd = [sys.executable, "-m", "goinfer_cli.app", "serve", "--model", a.model, "--addr", f"127.0.0.1:{port}",
               "--threads", str(a.threads), "--max-queue", str(2 * a.clients)]
        if label != "goinfer baseline":
            cmd += ["--max-concurrent", str(a.clients)] + (["--speculate", "off"] if "off" in label else [])
        servers.append(Server(label, cmd, port, cwd=root, env=env))
    if a.llama_server:
        port = _free_port()
        servers.append(Server("llama.cpp", [a.llama_server, "-m", a.model, "--port", str(port), "-t", str(a.threads),
                                            "-tb", str(a.threads), "--parallel", str(a.clients),
                                            "-c", str(a.clients * 1024), "--no-webui"], port, env=env))
    rows: dict[str, dict[str, list]] = {s.label: {"single": [], "aggregate": [], "burst_s": []} for s in servers}
    try:
        for s in servers:  # warm-up: compiles, caches, first-request costs
            burst(s.url, a.clients, 16, banned, 0)
        for rep in range(a.reps):
            for s in servers:
                for other in servers:
                    other.quiet()
                one = stream(s.url, f"Tell me a story about {TOPICS[rep % len(TOPICS)]}.", a.tokens, banned)
                for other in servers:
                    other.quiet()
                many = burst(s.url, a.clients, a.tokens, banned, rep)
                rows[s.label]["single"].append(single_rate(one))
                rows[s.label]["aggregate"].append(aggregate_rate(many))
                rows[s.label]["burst_s"].append(max(r["end"] for r in many) - min(r["sent"] for r in many))
                print(f"rep {rep} {s.label}: single {rows[s.label]['single'][-1]:.1f} tok/s, {a.clients} clients "
                      f"{rows[s.label]['aggregate'][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "threads": a.threads, "model": Path(a.model).name, "clients": a.clients, "tokens": a.tokens}
    for label, r in rows.items():
        single, agg = statistics.median(r["single"]), statistics.median(r["aggregate"])
        result[label] = {"single_tok_s": round(single, 1), "aggregate_tok_s": round(agg, 1),
                         "scaling": round(agg / single, 2), "burst_s": round(statistics.median(r["burst_s"]), 2),
                         "runs": {k: [round(v, 1) for v in vs] for k, vs in r.items()}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
