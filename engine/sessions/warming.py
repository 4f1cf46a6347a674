"""Idle-time warming of a model's warm sessions (engine/sessions/pool.py).

A reply's keys and values come from the decode step, whose numbers differ from a prompt pass's, so a session
keeps only its prompt and the next turn evaluates the previous reply again. While the model has nothing else to
do, the conversation as the next turn's prompt will start (the messages and the reply, closed by the chat
template; for a plain completion, the prompt and the reply) is evaluated through the prompt pass into the session,
chunk by chunk between the scheduler's turns. The next turn then evaluates only its new message (and at most one
prompt tile before it). Any request that arrives stops the warming (after the step under way, WARM_CHUNK positions
at most): what it computed so far goes back to the pool
and the rest is dropped (the new request may be that next turn; a stale warming would shorten its session).
Not for recurrent models (their sessions reuse from snapshots only).
"""

from __future__ import annotations

from collections import deque

from engine.models.base import Model
from engine.sessions.pool import SessionPool


# Positions per warming step: a request that arrives meanwhile waits for at most one step (short on SmolLM2 at
# 2 cores: docs/benchmarks.md, "Measurements behind the code", warming chunk). A multiple of the prompt tile, as
# every prompt chunk must be.
WARM_CHUNK = 128


class Warming:
    def __init__(self, model: Model, sessions: SessionPool, chunk: int):
        self.model, self.sessions = model, sessions
        self.chunk = min(chunk, WARM_CHUNK)
        self.pending: deque[list[int]] = deque(maxlen=max(1, sessions.max_sessions))
        self._current = None  # [ids, cache, done] of the warming under way
        self.warmed_tokens = 0  # positions evaluated in idle time

    @property
    def busy(self) -> bool:
        return bool(self.pending) or self._current is not None

    def add(self, ids: list[int] | None) -> None:
        if ids and not self.model.config.state_shapes:  # a recurrent model's sessions are not warmed
            self.pending.append(list(ids))

    def stop(self) -> None:
        """A request arrived: keep what was computed, forget the rest."""
        self.pending.clear()
        if self._current is not None:
            ids, cache, done = self._current
            self._current = None
            self.sessions.give(cache, ids[:done])

    def step(self) -> None:
        """One chunk of the oldest warming."""
        if self._current is None:
            ids = self.pending.popleft()
            taken = self.sessions.take(ids, len(ids) + 1, count=False)
            self._current = [ids, taken.cache, taken.reused]
        ids, cache, done = self._current
        end = min(len(ids), done + self.chunk)
        try:
            try:
                self.model.prefill_part(ids[done:end], cache, end - done)  # no logits wanted
            finally:
                self.model.backend.end_prompt()
        except Exception:  # noqa: BLE001 - warming is an optimization: its cache is dropped, nothing else
            self._current = None
            return
        self.warmed_tokens += end - done
        self._current[2] = end
        if end == len(ids):
            self._current = None
            self.sessions.give(cache, ids)
