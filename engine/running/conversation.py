"""One conversation whose KV cache outlives its turns (`goinfer chat`): each turn evaluates what is new.

A turn is a GenerationRequest prepared as the server prepares one (engine/requests/request.py `prepare`: the
template, thinking mode, Harmony, grammar and sampling decided there), run on the conversation's warm cache.
A turn's prompt is the whole conversation rendered by the chat template; it starts as the last one did, so it
continues from the warm session the last turn left (engine/sessions/pool.py, a pool of one) and evaluates the rest.
The reply's own keys and values come from the decode step, whose numbers differ from a prompt pass's, so after
each reply the conversation as the next prompt will start (the reply closed by the template) is evaluated
through the prompt pass in the background, while the user reads and types (`absorb`). The next turn then
evaluates its new message and at most one prompt tile before it, and gets the numbers a cold prefill of the
whole conversation would (sessions/pool.py says why it is exact).

With a path (`goinfer chat --session FILE`) the session and the messages are written there after each turn
(engine/sessions/disk.py) and read back at start.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from engine.errors import ContextOverflow
from engine.generation.generate import TokenEvent, run_generation
from engine.generation.speculation import Speculation
from engine.kernels.threads import set_threads
from engine.models.base import Model
from engine.requests.request import GenerationRequest, Prepared, prepare
from engine.sessions.disk import NotLoadable, load_file, save_file
from engine.sessions.pool import Session, SessionPool, keep_snapshots, pause_points
from engine.thinking.plan import ThinkingSettings


class WarmConversation:
    def __init__(self, model: Model, *, path: Path | None = None, threads: int | None = None,
                 warn: Callable[[str], None] = print, window: int | None = None):
        self.model = model
        # the most tokens the conversation may hold, prompt and reply (`chat --ctx`; the model's own at most)
        self.window = model.context_length if window is None else max(1, min(window, model.context_length))
        self.path = Path(path) if path is not None else None
        self.threads = threads
        self.warn = warn
        self.pool = SessionPool(model, max_sessions=1, budget_bytes=1 << 62)  # one conversation, whatever its size
        self.prompt_tokens = 0  # of the last turn
        self.cached_tokens = 0  # of those, the ones its warm session held
        self._worker: threading.Thread | None = None
        self._writable = True  # False when path held something we could not read: it is left as it was

    def load(self) -> dict | None:
        """The saved conversation's meta (its messages), its session now warm; None (with a warning when the file
        exists but cannot be used) for a new conversation."""
        if self.path is None or not self.path.exists():
            return None
        try:
            session = load_file(self.path, self.model)
        except NotLoadable as e:
            self._writable = False
            self.warn(f"skipped session file {self.path}: {e}; starting a new conversation (the file is kept as it "
                      "is)")
            return None
        self.pool.add(session)
        return session.meta

    def prepare(self, req: GenerationRequest, thinking: ThinkingSettings = ThinkingSettings()) -> Prepared:
        """The next turn (a chat request of one choice) checked against the model and held to the conversation's
        window, as requests.prepare checks a server's; `thinking`: the runner's mode and budget."""
        try:
            return prepare(self.model, req, window=self.window, thinking=thinking)
        except ContextOverflow as e:
            raise ContextOverflow(str(e).replace("the prompt has", "the conversation has", 1)
                                  + " (/reset starts a new one)") from None

    def reply(self, prep: Prepared, speculation: Speculation | None = None) -> Iterator[TokenEvent]:
        """The prepared turn's token events (its first choice), continuing the warm session."""
        self.wait()
        ids, gen = prep.ids, prep.choices[0]
        taken = self.pool.take(ids, gen.cache_tokens)
        cache = taken.cache
        self.prompt_tokens, self.cached_tokens = len(ids), taken.reused
        try:
            yield from run_generation(self.model, gen, cache, speculation=speculation)
        finally:  # stopped or not, what the prompt pass computed stays warm (a recurrent state: its snapshots)
            self.pool.give(cache, ids[: min(len(ids), cache.length)], taken.snapshots)

    def absorb(self, ids: list[int], meta: dict, marks: tuple[int, ...] = ()) -> None:
        """In the background: evaluate ids (the conversation as the next prompt will start) through the prompt
        pass into the warm session, then write it to the session file with meta. marks: positions a later prompt
        may share up to and no further (a recurrent model keeps a snapshot at each)."""
        self.wait()
        self._worker = threading.Thread(target=self._absorb, args=(list(ids), meta, marks), name="goinfer-absorb",
                                        daemon=True)
        self._worker.start()

    def _absorb(self, ids: list[int], meta: dict, marks: tuple[int, ...]) -> None:
        if self.threads:
            set_threads(self.threads)  # numba's thread count is per thread
        taken = self.pool.take(ids, len(ids) + 1)
        cache, done, snapshots = taken.cache, taken.reused, taken.snapshots
        try:
            if cache.state:  # a recurrent model reuses from a snapshot only: the evaluation pauses for them
                for pause in pause_points(len(ids), self.model.backend.prompt_tile, marks, after=done):
                    self.model.prefill(ids[done:pause], cache)
                    done = pause
                    snapshots.append(cache.snapshot())
            if done < len(ids):
                self.model.prefill(ids[done:], cache)
        except Exception as e:  # noqa: BLE001 - the next turn just evaluates more; the conversation goes on
            self.warn(f"could not warm the conversation's cache: {e}")
            return
        session = Session(cache, np.asarray(ids, np.int64), keep_snapshots(snapshots), meta=meta)
        self.pool.add(session)
        if self.path is not None and self._writable:
            try:
                save_file(self.path, session, self.model)
            except OSError as e:
                self.warn(f"could not write {self.path}: {e}")

    def forget_file(self) -> None:
        """The conversation was cleared: its session file goes too (a resume would bring it back)."""
        self.wait()
        if self.path is not None and self._writable:
            self.path.unlink(missing_ok=True)

    def wait(self) -> None:
        """Until the background evaluation (if any) is done."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
