#!/usr/bin/env python3
"""Soak (a script; tests/test_soak.py runs a short one in CI): many clients for a while against `goinfer serve`,
mixing streamed and whole answers, clients that leave mid-stream, bad bodies and oversize bodies, while the
server's resident memory and thread count are sampled.

Reports (JSON on stdout): requests made, answers by status, p50/p99 latency of the answered generations, the
server's RSS and threads after the warm-up, at the end of the load and after it settled, and failures: any 5xx,
a dropped connection without an answer, the server exiting, threads not back to their baseline once idle.
Exit status 1 when there was a failure.

Usage:
  python tests/bench/soak.py [--model REF] [--clients 16] [--seconds 600] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.bench.bench_serving import Server, _free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BODY_CAP = 1 << 20  # the soak server's --max-body-bytes: an oversize body is cheap to send
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
             "Count from one to five.", "What is 2 + 2?", "Say hello in Spanish."]


def _proc(pid: int) -> tuple[int, int]:
    """(RSS bytes, threads) of a process, from /proc."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.statuses: dict[str, int] = {}
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.requests = 0

    def add(self, kind: str, status, latency: float | None = None, failure: str | None = None) -> None:
        with self.lock:
            self.requests += 1
            key = f"{kind} {status}"
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if latency is not None:
                self.latencies.append(latency)
            if failure:
                self.failures.append(failure)


def _client(url: str, stop: threading.Event, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as c:
        while not stop.is_set():
            kind = rng.choices(["stream", "whole", "leave", "bad", "oversize"], [4, 4, 2, 1, 1])[0]
            msgs = [{"role": "user", "content": rng.choice(QUESTIONS)}]
            body = {"messages": msgs, "max_tokens": rng.randint(4, 32), "temperature": rng.choice([0, 0.8])}
            t0 = time.monotonic()
            try:
                if kind == "whole":
                    r = c.post("/v1/chat/completions", json=body)
                    tally.add(kind, r.status_code, time.monotonic() - t0,
                              f"{kind}: {r.status_code} {r.text[:200]}" if r.status_code >= 500 else None)
                elif kind in ("stream", "leave"):
                    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                        events = 0
                        for line in r.iter_lines():
                            events += line.startswith("data: ")
                            if kind == "leave" and events >= 2:
                                break  # the client leaves mid-stream
                    tally.add(kind, r.status_code, time.monotonic() - t0 if kind == "stream" else None,
                              f"{kind}: {r.status_code}" if r.status_code >= 500 else None)
                elif kind == "bad":
                    raw = rng.choice([b"{not json", b'{"messages": [{"role": {}, "content": "x"}]}', b"[]",
                                      json.dumps({"messages": msgs, "max_tokens": "many"}).encode()])
                    r = c.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
                    tally.add(kind, r.status_code, None,
                              f"{kind}: {r.status_code} for {raw[:60]!r}" if r.status_code >= 500 else None)
                else:
                    r = c.post("/v1/chat/completions", content=b"x" * (BODY_CAP + 1),
                               headers={"Content-Type": "application/json"})
                    tally.add(kind, r.status_code, None, f"{kind}: {r.status_code}" if r.status_code != 413 else None)
            except (httpx.HTTPError, socket.error) as e:
                if kind == "oversize":  # a refused body may reset the connection while it is being sent
                    tally.add(kind, "reset")
                else:
                    tally.add(kind, "dropped", None, f"{kind}: {type(e).__name__}: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    port = _free_port()
    cmd = [sys.executable, "-m", "goinfer_cli.app", "serve", "--model", a.model, "--addr", f"127.0.0.1:{port}",
           "--threads", str(a.threads), "--max-queue", str(a.clients), "--max-body-bytes", str(BODY_CAP),
           "--ctx", "1024"]
    server = Server("soak", cmd, port, cwd=ROOT)
    pid = server.proc.pid
    tally = Tally()
    try:
        httpx.post(server.url + "/v1/chat/completions", timeout=300,  # warm-up: first-request costs
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        time.sleep(1)
        baseline = _proc(pid)
        samples = [(0.0, *baseline)]
        stop = threading.Event()
        clients = [threading.Thread(target=_client, args=(server.url, stop, tally, i), daemon=True)
                   for i in range(a.clients)]
        t0 = time.monotonic()
        for c in clients:
            c.start()
        while time.monotonic() - t0 < a.seconds:
            time.sleep(min(5.0, max(0.1, a.seconds - (time.monotonic() - t0))))
            if server.proc.poll() is not None:
                tally.failures.append(f"the server exited with {server.proc.returncode}")
                break
            samples.append((round(time.monotonic() - t0, 1), *_proc(pid)))
        stop.set()
        for c in clients:
            c.join(300)
        loaded = samples[-1]
        deadline = time.monotonic() + 30  # settle: connections close, handler threads end
        while time.monotonic() < deadline and server.proc.poll() is None and _proc(pid)[1] > baseline[1]:
            time.sleep(0.5)
        settled = _proc(pid) if server.proc.poll() is None else (0, 0)
        if server.proc.poll() is not None:
            tally.failures.append(f"the server exited with {server.proc.returncode}")
        elif settled[1] > baseline[1]:
            tally.failures.append(f"threads {settled[1]} once idle, {baseline[1]} before the load")
    finally:
        server.stop()
    lat = sorted(tally.latencies)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "clients": a.clients, "seconds": a.seconds,
              "model": a.model, "requests": tally.requests, "statuses": dict(sorted(tally.statuses.items())),
              "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
              "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
              "rss_mb": {"after_warmup": round(baseline[0] / 2**20, 1), "end_of_load": round(loaded[1] / 2**20, 1),
                         "settled": round(settled[0] / 2**20, 1), "max": round(max(s[1] for s in samples) / 2**20, 1)},
              "threads": {"after_warmup": baseline[1], "end_of_load": loaded[2], "settled": settled[1],
                          "max": max(s[2] for s in samples)},
              "samples": samples, "failures": tally.failures[:20]}
    print(json.dumps(result, indent=1))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
