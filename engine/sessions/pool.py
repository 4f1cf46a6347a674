"""Warm KV sessions: a prompt that starts as an earlier one did continues from that prompt's KV cache.

A session is a KV cache and the prompt tokens whose keys and values it holds. A new prompt takes the session
that shares the longest prefix with it (`SessionPool.take`), keeps that prefix and evaluates only the rest; when
its request ends, the cache goes back to the pool (`give`) as a session of the new prompt. A prompt that is
another conversation of the session's (it shares no more than its system prompt) gets a copy of the prefix
instead, and the session stays for its own conversation's next turn. The server's
scheduler keeps a pool per model (`--kv-sessions`), `goinfer chat` a pool of one.

What is reused, and why it is exact (a warm reply equals the cold one, bit for bit):
- Only positions the prompt pass computed. A generated token's keys and values come from the decode step,
  whose int8 kernels and attention round differently from a prompt's pass; the next turn's prompt re-evaluates
  the previous reply (it is short next to the history), so a warm turn sees the numbers a cold one sees.
- Cut back to a multiple of the backend's prompt tile (Backend.prompt_tile, 64 on the CPU): a prompt's rows
  get the same numbers however it is cut into chunks only when the cuts fall on tile boundaries (kernels/
  backend.py PROMPT_TILE). `cached_tokens` reports exactly what was reused: the cut, not the shared prefix.
- At least one prompt token is evaluated: its logits start the reply.
- Sliding-window layers keep every position (the cache is not a ring), so any prefix of them is whole.
- A recurrent layer (gated DeltaNet, LFM2's convolutions) holds its whole prefix in a fixed-size state that
  cannot be truncated. Such a session is reusable only at its snapshots: the state copied where the prompt's
  evaluation paused at a tile boundary (`pause_points`): its last whole tile (the next turn continues there),
  before its first and its last user message (another conversation with the same system prompt, an edited or
  regenerated last message), and where it left the pool's closest session (a prefix two prompts shared is
  likely shared again). At most MAX_SNAPSHOTS a session; a prompt that shares less than the first is cold.

Memory: at most `max_sessions` sessions and `budget_bytes` of KV; the least recently used leaves first (written
to the session store, when there is one: engine/sessions/disk.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from engine.kernels.backend import KVCache

DEFAULT_SESSIONS = 8
DEFAULT_BUDGET_MIB = 2048  # at most; a quarter of the memory available at start where that is less


def default_budget_bytes(available_bytes: int | None) -> int:
    """The KV memory warm sessions may hold by default: 2 GiB, or a quarter of what was available if less."""
    cap = DEFAULT_BUDGET_MIB << 20
    return cap if available_bytes is None else min(cap, available_bytes // 4)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


# A recurrent session keeps at most this many snapshots (each a copy of the whole state: for a Qwen3.5-9B about
# 72 MiB): its first (a shared system prompt) and the latest ones.
MAX_SNAPSHOTS = 4


def snapshot_point(n_prompt: int, tile: int) -> int:
    """Where a recurrent model's prompt evaluation pauses last to copy its state for a later reuse: the last tile
    boundary that leaves at least one token to evaluate (0: none)."""
    return (n_prompt - 1) // tile * tile


def pause_points(n_prompt: int, tile: int, marks: Sequence[int] = (), after: int = 0) -> list[int]:
    """Where a recurrent prompt's evaluation pauses for snapshots, past `after` (what was reused): each mark (a
    position a later prompt may share up to) cut back to its tile, and the last whole tile (snapshot_point)."""
    last = snapshot_point(n_prompt, tile)
    points = {min(int(m), last) // tile * tile for m in marks} | {last}
    return sorted(p for p in points if p > after)


def keep_snapshots(snapshots: list[tuple]) -> list[tuple]:
    """A session's snapshots in position order, at most MAX_SNAPSHOTS: the first and the latest."""
    snapshots = sorted(snapshots, key=lambda s: s[0])
    return snapshots if len(snapshots) <= MAX_SNAPSHOTS else snapshots[:1] + snapshots[1 - MAX_SNAPSHOTS:]


@dataclass
class Session:
    cache: KVCache
    tokens: np.ndarray  # int64: the prompt tokens whose prompt-pass keys and values the cache holds, from 0
    # recurrent models: KVCache.snapshot()s at tile boundaries, in position order (the cache is at the last)
    snapshots: list[tuple] = field(default_factory=list)
    used: float = 0.0  # time.monotonic() of its last use
    meta: dict = field(default_factory=dict)  # what its owner keeps with it on disk (goinfer chat: the messages)

    def common(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of prompt this session holds, short of its last (whose logits start a reply)."""
        return min(shared_prefix(self.tokens, prompt), len(prompt) - 1)

    def reusable(self, prompt: Sequence[int], tile: int, common: int | None = None) -> int:
        """How many leading positions of prompt this session can give it (a multiple of tile); common: what
        self.common(prompt) says, when known."""
        n = self.common(prompt) if common is None else common
        if self.cache.state:  # only from a snapshot
            return max((at for at, _ in self.snapshots if at <= n), default=0)
        return n // tile * tile

    def nbytes(self) -> int:
        return self.cache.nbytes() + sum(a.nbytes for _, state in self.snapshots for a in state.values())


@dataclass
class Taken:
    """What SessionPool.take gives a prompt: a cache holding its first `reused` positions, the snapshots it can
    still be brought back to (recurrent models: those at or before `reused`), and how far the prompt ran along
    the closest session in the pool (where a recurrent prompt may pause for a snapshot: pause_points)."""

    cache: KVCache
    reused: int
    snapshots: list[tuple] = field(default_factory=list)
    shared: int = 0


class SessionPool:
    """The warm sessions of one model. Thread-safe: the scheduler's thread takes and gives, /health reads."""

    def __init__(self, model, *, max_sessions: int = DEFAULT_SESSIONS, budget_bytes: int | None = None,
                 on_evict: Callable[[Session], None] | None = None):
        self.model = model
        self.tile = model.backend.prompt_tile
        self.max_sessions = max_sessions
        self.budget_bytes = default_budget_bytes(None) if budget_bytes is None else budget_bytes
        self._on_evict = on_evict  # e.g. write it to the session store
        self._sessions: list[Session] = []
        self._lock = threading.Lock()
        self.hits = 0  # prompts that reused a session
        self.reused_tokens = 0  # positions they did not evaluate
        self.evicted = 0

    # ------------------------------------------------------------------ use

    def take(self, prompt: Sequence[int], max_tokens: int, *, count: bool = True, marks: Sequence[int] = ()
             ) -> Taken:
        """A cache for a prompt that will hold at most max_tokens positions, holding as many of the prompt's
        leading positions as a session can give (0: a new cache). The session it came from leaves the pool,
        unless it is another conversation's (the prompt shares no more than up to its first user message, the
        first of `marks`) or a recurrent one given up to an earlier snapshot than its last: then the prompt gets
        a copy of the prefix, and the session stays for its own next turn. count=False: not a request's
        (idle-time warming), left out of the reuse figures."""
        with self._lock:
            best, reuse, closest, shared = None, 0, 0, 0
            for s in self._sessions:
                common = s.common(prompt)
                n = s.reusable(prompt, self.tile, common)
                # of two that give as much, the closer one (the other may be another conversation's)
                if n and (n, common) > (reuse, closest):
                    best, reuse, closest = s, n, common
                shared = max(shared, common)
            if best is None:
                return Taken(self.model.new_cache(max_tokens), 0, shared=shared)
            self.hits += count
            self.reused_tokens += reuse if count else 0
            snapshots = [s for s in best.snapshots if s[0] <= reuse]
            if best.cache.state:
                stays = len(snapshots) < len(best.snapshots)
            else:
                stays = bool(marks) and reuse <= marks[0] and len(best.tokens) > reuse + self.tile
            if stays:
                best.used = time.monotonic()
                cache = best.cache.fork(reuse)
                if cache.state:
                    cache.restore(snapshots[-1])
            else:
                self._sessions.remove(best)
                cache = best.cache
                if cache.state:
                    cache.restore(snapshots[-1])
                else:
                    cache.truncate(reuse)
        cache.max_tokens = max(max_tokens, reuse + 1)
        return Taken(cache, reuse, snapshots, shared)

    def give(self, cache: KVCache, tokens: Sequence[int], snapshots: Sequence[tuple] = ()) -> None:
        """A cache whose first len(tokens) positions hold those prompt tokens (prompt pass), back as a session.
        Nothing to keep (no whole tile, or a recurrent cache without a snapshot): it is let go."""
        tokens = np.asarray(tokens, np.int64)
        if len(tokens) < self.tile + 1 or (cache.state and not snapshots) or self.max_sessions < 1:
            return
        self.add(Session(cache, tokens, keep_snapshots(list(snapshots)), time.monotonic()))

    def add(self, session: Session) -> None:
        """Keep a session (also one restored from disk); evict the least recently used past the limits."""
        evicted = []
        with self._lock:
            # A session whose tokens the new one starts with gives nothing the new one cannot.
            self._sessions = [s for s in self._sessions
                              if shared_prefix(s.tokens, session.tokens) < len(s.tokens) or s.cache.state]
            self._sessions.append(session)
            self._sessions.sort(key=lambda s: s.used)
            while self._sessions and (len(self._sessions) > self.max_sessions or self._bytes() > self.budget_bytes):
                evicted.append(self._sessions.pop(0))
            self.evicted += len(evicted)
        for s in evicted:
            if self._on_evict is not None:
                self._on_evict(s)

    def drain(self) -> list[Session]:
        """Every session, oldest first; the pool is left empty (shutdown: they go to the session store)."""
        with self._lock:
            out, self._sessions = self._sessions, []
        return out

    # ------------------------------------------------------------------ report

    def _bytes(self) -> int:
        return sum(s.nbytes() for s in self._sessions)

    def stats(self) -> dict:
        with self._lock:
            return {"sessions": len(self._sessions), "session_bytes": self._bytes(),
                    "max_sessions": self.max_sessions, "session_budget_bytes": self.budget_bytes,
                    "reuse_hits": self.hits, "reused_tokens": self.reused_tokens, "sessions_evicted": self.evicted}
