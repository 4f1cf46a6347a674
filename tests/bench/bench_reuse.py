#!/usr/bin/env python3
"""Prompt-prefix reuse benchmark (not a test): a chat whose history passes 1,000 tokens, turn after turn, through
real HTTP servers; each turn's time to first token warm (the server keeps the conversation's KV) against the
same messages prefilled cold.

Starts `goinfer serve` on MODEL twice: with warm sessions (the default) and with --kv-sessions 0 (cold); with
--llama-server PATH, llama.cpp's server too (warm: its prompt cache; cold: the same request with
"cache_prompt": false). Each server holds its own conversation (its own replies); a turn is sent warm, then the
same messages cold. The first user message carries a ~900-token document, so from the second turn on the
history is past 1,000 tokens. Replies are greedy, --reply-tokens long. Turns are human-paced: each request goes
to a server that has settled (no request running, no idle-time warming: engine/sessions/warming.py).

--users N: N conversations, turn by turn in turn (user 0's turn 0, user 1's turn 0, ..., user 0's turn 1, ...), the
document in their common system prompt (one agent or web UI, several users): each user's first turn may start
from the others' system prompt, and each later turn from its own history.

Reports per server and turn: ttft_warm_s, ttft_cold_s, ratio (warm / cold), the prompt's tokens and, where the
server reports it, cached_tokens; and the median ratio over the turns after the first.

Usage:
  python tests/bench/bench_reuse.py MODEL.gguf [--turns 6] [--reply-tokens 64] [--threads 2] [--users 1]
      [--llama-server /path/to/llama-server]
The benchmark command may unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for itself (docs/benchmarks.md says when it
did); the product, tests and CI never touch them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.bench.bench_serving import Server, _free_port, raw_post  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = " ".join(
    f"Section {i}: the harbour office opens at {6 + i % 5} in the morning, ships of class {chr(65 + i % 7)} berth at "
    f"pier {i % 9 + 1}, and cargo must be declared {i % 4 + 1} days ahead."
    for i in range(24))
QUESTIONS = ["Summarize the rules in two sentences.", "When does the office open for section 3?",
             "Which pier do class C ships use?", "How far ahead is cargo declared in section 10?",
             "Is there a section about fuel?", "List three piers mentioned.", "What is the latest opening hour?",
             "Thank you. Anything else I should know?"]


def turn(url: str, messages: list[dict], tokens: int, extra: dict | None = None) -> dict:
    """One streamed chat turn over a raw socket: time to the first content, the reply, the usage it reports."""
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    sent = time.perf_counter()
    first, buf, text, usage = None, b"", [], None
    for now, data in raw_post(url, "/v1/chat/completions", body):
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            for c in obj.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first or now
                    text.append(piece)
            usage = obj.get("usage") or usage
    if first is None:
        raise SystemExit(f"{url}: no content in the reply")
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft": first - sent, "text": "".join(text), "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": cached}


def wait_idle(url: str) -> None:
    """Until a goinfer server has no request and no idle-time warming left (a human-paced chat: the next turn
    comes after the server has settled; nor may one server's background work slow another's measurement)."""
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        models = httpx.get(url + "/health", timeout=10).json().get("models")
        if not models or not any(m.get("busy") or m.get("warming") for m in models):
            return
        time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    ap.add_argument("--users", type=int, default=1, help="conversations sharing one system prompt, in turn")
    a = ap.parse_args()
    env = {**os.environ, "NUMBA_NUM_THREADS": str(a.threads), "OPENBLAS_NUM_THREADS": str(a.threads)}
    pairs = []  # (label, warm server url, cold server url or None, cold request extra)
    servers = []

    def goinfer(label: str, *flags: str) -> Server:
        port = _free_port()
        cmd = [sys.executable, "-m", "goinfer_cli.app", "serve", "--model", a.model, "--addr", f"127.0.0.1:{port}",
               "--threads", str(a.threads), "--ctx", "4096", *flags]
        s = Server(label, cmd, port, cwd=ROOT, env=env)
        servers.append(s)
        return s

    try:
        warm, cold = goinfer("goinfer"), goinfer("goinfer cold", "--kv-sessions", "0")
        pairs.append(("goinfer", warm.url, cold.url, {}))
        if a.llama_server:
            port = _free_port()
            s = Server("llama.cpp", [a.llama_server, "-m", a.model, "--port", str(port), "-t", str(a.threads),
                                     "-tb", str(a.threads), "-c", "4096", "--parallel", "1", "--no-webui"],
                       port, env=env)
            servers.append(s)
            pairs.append(("llama.cpp", s.url, s.url, {"cache_prompt": False}))
        for label, w, c, extra in pairs:  # warm-up: compiles, first-request costs
            turn(w, [{"role": "user", "content": "Hello."}], 4)
            turn(c, [{"role": "user", "content": "Hi there."}], 4, extra)
        rows: dict[str, list[dict]] = {label: [] for label, *_ in pairs}
        system = "You answer questions about the harbour rules below." + ("\n\n" + DOCUMENT if a.users > 1 else "")
        history = {(label, u): [{"role": "system", "content": system}] for label, *_ in pairs for u in range(a.users)}
        for t, u, (label, w, c, extra) in ((t, u, pair) for t in range(a.turns) for u in range(a.users)
                                           for pair in pairs):
            msgs = history[label, u]
            q = QUESTIONS[(t + u) % len(QUESTIONS)]
            msgs.append({"role": "user", "content": (DOCUMENT + "\n\n" + q) if t == 0 and a.users == 1 else q})
            wait_idle(w)
            wait_idle(c)
            hot = turn(w, msgs, a.reply_tokens)
            wait_idle(w)
            cool = turn(c, msgs, a.reply_tokens, extra)
            msgs.append({"role": "assistant", "content": hot["text"]})
            row = {"turn": t, "user": u, "prompt_tokens": hot["prompt_tokens"], "cached_tokens": hot["cached_tokens"],
                   "ttft_warm_s": round(hot["ttft"], 3), "ttft_cold_s": round(cool["ttft"], 3),
                   "ratio": round(hot["ttft"] / cool["ttft"], 3), "same_reply": hot["text"] == cool["text"]}
            rows[label].append(row)
            print(f"{label} user {u} turn {t}: {row}", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "threads": a.threads, "model": Path(a.model).name, "turns": a.turns, "reply_tokens": a.reply_tokens,
              "users": a.users}
    for label, r in rows.items():
        later = [x["ratio"] for x in r[1:]]  # all but the very first turn (nothing to start from)
        result[label] = {"median_warm_ratio": round(statistics.median(later), 3) if later else None,
                         "max_warm_ratio": max(later) if later else None, "turns": r}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
