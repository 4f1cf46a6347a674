"""Concurrent embedding requests share forward passes.

A server's handler threads each bring a request's token lists; one worker thread per model runs them. While a
pass runs, the requests that arrive wait in the queue, and the next pass takes all of them together (up to
MAX_PASS_TOKENS), so a burst of small requests costs a few batched passes instead of one pass each. Nothing waits
on purpose: a request that finds the worker idle runs at once. Every request gets exactly the vectors it would get
alone (the model batches inputs by length, unpadded; tests/test_embeddings.py checks batch == alone).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

__all__ = ["EmbeddingQueue", "MAX_PASS_TOKENS"]

MAX_PASS_TOKENS = 65536  # tokens of queued requests taken into one model.embed call


@dataclass
class _Request:
    token_lists: list[list[int]]
    done: threading.Event = field(default_factory=threading.Event)
    vectors: np.ndarray | None = None
    error: BaseException | None = None

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.token_lists)


class EmbeddingQueue:
    def __init__(self, model):
        self.model = model
        self.passes = 0  # model.embed calls made (a burst of requests shares them)
        self._pending: list[_Request] = []
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        with self._cv:
            return len(self._pending)

    def embed(self, token_lists: list[list[int]]) -> np.ndarray:
        """The vectors of token_lists, computed in a pass shared with whatever else is queued."""
        request = _Request(token_lists)
        with self._cv:
            self._pending.append(request)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name=f"goinfer-embed-{self.model.name}",
                                                daemon=True)
                self._worker.start()
            self._cv.notify()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.vectors

    def _take(self) -> list[_Request]:
        with self._cv:
            while not self._pending:
                self._cv.wait()
            taken, tokens = [], 0
            while self._pending and (not taken or tokens + self._pending[0].tokens <= MAX_PASS_TOKENS):
                request = self._pending.pop(0)
                taken.append(request)
                tokens += request.tokens
            return taken

    def _run(self) -> None:
        while True:
            batch = self._take()
            try:
                vectors = self.model.embed([ids for r in batch for ids in r.token_lists])
                self.passes += 1
            except BaseException as e:  # noqa: BLE001 - each request gets the error; the worker goes on
                for r in batch:
                    r.error = e
                    r.done.set()
                continue
            start = 0
            for r in batch:
                r.vectors, start = vectors[start:start + len(r.token_lists)], start + len(r.token_lists)
                r.done.set()
