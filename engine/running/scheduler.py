"""Many requests on one model: a FIFO queue, admission up to --max-concurrent sequences, and one thread that
runs them together (engine/running/stepper.py: prompts in chunks between batched decode steps). `goinfer serve` has
one per model; `goinfer batch --parallel N` runs its lines through one.

A caller prepares a request (every refusal it can earn is raised before it queues), submits it as a Job and
reads the job's pieces from `job.events` while the scheduler generates; it stays free to watch its client
meanwhile. A job whose client has gone is cancelled: a waiting one leaves the queue at once, a running one
leaves the batch at the next step, its place taken by the next in line.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable

from engine.errors import Cancelled, GoinferError
from engine.kernels.threads import set_threads
from engine.models.base import PREFILL_CHUNK, Model
from engine.requests.request import Delta, Prepared, Timings
from engine.sessions.pool import SessionPool
from engine.generation.speculation import Speculation
from engine.running.stepper import Stepper

DEFAULT_MAX_CONCURRENT = 4  # sequences decoded together: each weight read once per step serves them all
_EMA = 0.3  # weight of the newest job in the running mean of job durations (for Retry-After)


class QueueFull(Exception):
    def __init__(self, retry_after: int, waiting: int):
        super().__init__(f"{waiting} requests are already waiting")
        self.retry_after = retry_after
        self.waiting = waiting


class ShuttingDown(Exception):
    pass


@dataclass
class Finished:
    """The last item of a job's events: error None when it ran to the end."""

    error: BaseException | None = None


class Job:
    def __init__(self, prep: Prepared, cancel: threading.Event | None = None, request_id: str = "",
                 on_event: Callable[[Job, Delta | Finished], None] | None = None):
        """`on_event(job, item)` (optional) is called on the scheduler's thread with each item as it is queued."""
        self.prep = prep
        self.id = request_id
        self.created = int(time.time())
        self.events: queue.SimpleQueue[Delta | Finished] = queue.SimpleQueue()
        self._cancel = cancel or threading.Event()
        self._on_event = on_event
        self.cancel_reason: str | None = None
        self.generated = 0  # tokens so far, over all choices
        self.submitted = time.monotonic()
        self.started: float | None = None  # when it left the queue (monotonic)
        self.first_token: float | None = None  # when its first generated token came: the prompt was evaluated
        self.prompt_done = 0  # prompt tokens evaluated (or reused) so far: a stream's progress (return_progress)
        self.done = False

    @property
    def slots(self) -> int:
        """The sequences it runs: one per choice."""
        return len(self.prep.choices)

    def put(self, item: Delta | Finished) -> None:
        if isinstance(item, Delta):
            self.generated += item.new_tokens
            if item.new_tokens and self.first_token is None:
                self.first_token = time.monotonic()
        self.events.put(item)
        if self._on_event is not None:
            self._on_event(self, item)

    def timings(self) -> Timings:
        """Where its time went so far (the llama.cpp and Ollama answers report it)."""
        now = time.monotonic()
        started = self.started or now
        first = self.first_token or now
        return Timings(queued_s=started - self.submitted, prompt_s=max(first - started, 0.0),
                       generate_s=max(now - first, 0.0), total_s=now - self.submitted,
                       prompt_tokens=len(self.prep.ids) - self.prep.cached_tokens, generated=self.generated)

    def cancel(self, reason: str) -> None:
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()

    def cancelled(self) -> bool:
        return self._cancel.is_set()


class Scheduler:
    def __init__(self, model: Model, name: str, *, max_queue: int, max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                 prefill_chunk: int = PREFILL_CHUNK, threads: int | None = None,
                 sessions: SessionPool | None = None, warm_replies: bool = True,
                 speculation: Speculation | None = None, log: Callable[[str], None] = print):
        """sessions: the model's warm sessions (prompt-prefix reuse); None evaluates every prompt whole.
        warm_replies: evaluate a finished chat's reply into its session while idle (engine/sessions/warming.py).
        speculation: draft tokens by prompt lookup, checked several a step (generation/speculation.py); None: off."""
        self.name = name
        self.placement = model.placement  # where the model runs and why (engine/loading/placement.py), for /health
        self.sessions = sessions
        self.max_queue = max_queue
        self.max_concurrent = max_concurrent
        self._threads = threads
        self._log = log
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._stepper = Stepper(model, prefill_chunk=prefill_chunk, on_end=self._ended, sessions=sessions,
                                warm_replies=warm_replies, speculation=speculation)
        self._slots = 0  # sequences of the admitted jobs (guarded by _cv; the stepper's own state is not)
        self._admitted: list[Job] = []
        self._kv_bytes = 0
        self.completed = self.cancelled = self.failed = self.rejected = 0
        self._mean_s: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"goinfer-model-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers' side

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull (max_queue already waiting beyond the free sequence slots)."""
        with self._cv:
            self._refuse_if_full()
            self._waiting.append(job)
            self._cv.notify()

    def check_room(self) -> None:
        """Raise QueueFull (or ShuttingDown) now if a job submitted now would be refused: a server asks before a
        request's tokenising and grammar work, which a refused request should not cost. submit checks again."""
        with self._cv:
            self._refuse_if_full()

    def _refuse_if_full(self) -> None:
        if self._closed:
            raise ShuttingDown()
        free = max(0, self.max_concurrent - self._slots)
        if len(self._waiting) >= self.max_queue + free:
            self.rejected += 1
            raise QueueFull(self._retry_after(), len(self._waiting))

    def withdraw(self, job: Job, reason: str) -> None:
        """The job's client is gone: forget it if it still waits, stop it if it runs."""
        job.cancel(reason)
        with self._cv:
            if job in self._waiting:
                self._waiting.remove(job)
                self.cancelled += 1
                self._log(f"{self.name}: {job.id} left the queue before it started ({reason})")
            self._cv.notify()  # a running job leaves at the next step; an idle loop need not wait for it

    def health(self) -> dict:
        pool = self.sessions.stats() if self.sessions is not None else {}
        with self._cv:
            running = list(self._admitted)
            return {**pool, "name": self.name, "placement": self.placement, "busy": bool(running),
                    "running_requests": len(running), "running_sequences": self._slots,
                    "max_concurrent": self.max_concurrent, "running_tokens": sum(j.generated for j in running),
                    "queued": len(self._waiting),
                    "max_queue": self.max_queue, "kv_bytes": self._kv_bytes,
                    "decode_steps": self._stepper.decode_steps, "decoded_tokens": self._stepper.decoded_tokens,
                    **({"draft_tokens": self._stepper.drafted_tokens,
                        "draft_accepted_tokens": self._stepper.accepted_tokens}
                       if self._stepper.speculation is not None else {}),
                    **({"warming": self._stepper.has_background, "warmed_tokens": self._stepper.warming.warmed_tokens}
                       if self._stepper.warming is not None else {}),
                    "completed": self.completed,
                    "cancelled": self.cancelled, "failed": self.failed, "rejected": self.rejected}

    def _retry_after(self) -> int:
        # A place frees when a running job ends: about a mean job duration shared among those running.
        mean = self._mean_s if self._mean_s is not None else 5.0
        return max(1, min(3600, math.ceil(mean / max(1, len(self._admitted)))))

    def close(self, reason: str, wait_s: float = 5.0) -> None:
        """Cancel everything (queued and running) and stop the thread."""
        with self._cv:
            self._closed = True
            for job in self._waiting:
                job.cancel(reason)
                job.put(Finished(Cancelled(reason)))
                job.done = True
            self._waiting.clear()
            for job in self._admitted:
                job.cancel(reason)
            self._cv.notify_all()
        self._thread.join(wait_s)

    # ------------------------------------------------------------------ the scheduler's thread

    def _loop(self) -> None:
        if self._threads:
            set_threads(self._threads)  # numba's thread count is per calling thread (BLAS's too)
        stepper = self._stepper
        while True:
            with self._cv:
                while not self._closed and stepper.idle and not stepper.has_background and not self._waiting:
                    self._cv.wait()
                if self._closed and stepper.idle:
                    if stepper.warming is not None:
                        stepper.warming.stop()  # its session back to the pool (--session-dir writes it)
                    return
                self._admit()
            try:
                stepper.step()
            except Exception:  # noqa: BLE001 - the stepper catches per job; this would be a bug in it
                self._log(f"{self.name}: scheduler step failed:\n{traceback.format_exc().rstrip()}")
                stepper.cancel_all("internal error")
            kv = stepper.kv_bytes()
            with self._cv:
                self._kv_bytes = kv

    def _admit(self) -> None:
        """FIFO: jobs enter while their sequences fit (a job wider than the limit runs when nothing else does)."""
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled():  # its client left between the queue and here
                self._waiting.popleft()
                self.cancelled += 1
                job.put(Finished(Cancelled(job.cancel_reason or "cancelled")))
                job.done = True
                continue
            if self._slots and self._slots + job.slots > self.max_concurrent:
                return
            self._waiting.popleft()
            self._slots += job.slots
            self._admitted.append(job)
            job.started = time.monotonic()
            self._stepper.admit(job)

    def _ended(self, job: Job, outcome: str, error: BaseException | None) -> None:
        """The stepper is done with job (on this thread)."""
        if outcome == "cancelled":
            self._log(f"{self.name}: {job.id} stopped after {job.generated} tokens ({job.cancel_reason or error})")
        elif outcome == "failed":
            if isinstance(error, GoinferError):
                self._log(f"{self.name}: {job.id} failed: {error}")
            else:  # a bug: the client gets a 500, the log the traceback
                trace = "".join(traceback.format_exception(error)).rstrip()
                self._log(f"{self.name}: {job.id} failed:\n{trace}")
        job.done = True
        job.put(Finished(error))
        seconds = time.monotonic() - (job.started or time.monotonic())
        with self._cv:
            self._slots -= job.slots
            self._admitted.remove(job)
            self._mean_s = seconds if self._mean_s is None else (1 - _EMA) * self._mean_s + _EMA * seconds
            if outcome == "completed":
                self.completed += 1
            elif outcome == "cancelled":
                self.cancelled += 1
            else:
                self.failed += 1
