"""One worker thread per served model: a bounded FIFO of jobs, run one at a time.

An HTTP handler prepares a request (every refusal it can earn is raised before it queues), submits it
as a Job and reads the job's pieces from `job.events` while the worker generates; the handler is free
to send keep-alives and watch its socket meanwhile. A job whose client has gone is cancelled: a waiting
one leaves the queue at once, a running one stops at the next prompt chunk or token.
(The concurrency issue replaces this with batched decoding; the Job interface is meant to survive it.)
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
from engine.kernels.cpu.threads import set_threads
from engine.requests import Delta, Prepared, run
from engine.server.config import ServedModel

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
    def __init__(self, prep: Prepared, cancel: threading.Event, request_id: str):
        self.prep = prep
        self.id = request_id
        self.created = int(time.time())
        self.events: queue.SimpleQueue[Delta | Finished] = queue.SimpleQueue()
        self._cancel = cancel  # the same event `prepare` was told to poll during the prompt
        self.cancel_reason: str | None = None
        self.generated = 0  # tokens so far, over all choices
        self.done = False

    def cancel(self, reason: str) -> None:
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()

    def cancelled(self) -> bool:
        return self._cancel.is_set()


class ModelWorker:
    def __init__(self, served: ServedModel, max_queue: int, *, threads: int | None = None,
                 log: Callable[[str], None] = print):
        self.served = served
        self.max_queue = max_queue
        self._threads = threads
        self._log = log
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.completed = self.cancelled = self.failed = self.rejected = 0
        self._mean_s: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"goinfer-model-{served.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ handler side

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull (max_queue already waiting behind a running one)."""
        with self._cv:
            if self._closed:
                raise ShuttingDown()
            if self.running is not None and len(self._waiting) >= self.max_queue or \
                    len(self._waiting) > self.max_queue:
                self.rejected += 1
                raise QueueFull(self._retry_after(), len(self._waiting))
            self._waiting.append(job)
            self._cv.notify()

    def withdraw(self, job: Job, reason: str) -> None:
        """The job's client is gone: forget it if it still waits, stop it if it runs."""
        job.cancel(reason)
        with self._cv:
            if job in self._waiting:
                self._waiting.remove(job)
                self.cancelled += 1
                self._log(f"{self.served.name}: {job.id} left the queue before it started ({reason})")

    def health(self) -> dict:
        with self._cv:
            return {"name": self.served.name, "busy": self.running is not None,
                    "running_tokens": self.running.generated if self.running else 0,
                    "queued": len(self._waiting), "max_queue": self.max_queue, "completed": self.completed,
                    "cancelled": self.cancelled, "failed": self.failed, "rejected": self.rejected}

    def _retry_after(self) -> int:
        # The queue moves by one when the running job ends: about one mean job duration.
        return max(1, min(3600, math.ceil(self._mean_s if self._mean_s is not None else 5.0)))

    def close(self, reason: str, wait_s: float = 5.0) -> None:
        """Cancel everything (queued and running) and stop the worker thread."""
        with self._cv:
            self._closed = True
            for job in self._waiting:
                job.cancel(reason)
                job.events.put(Finished(Cancelled(reason)))
            self._waiting.clear()
            if self.running is not None:
                self.running.cancel(reason)
            self._cv.notify_all()
        self._thread.join(wait_s)

    # ------------------------------------------------------------------ worker side

    def _loop(self) -> None:
        if self._threads:
            _set_compute_threads(self._threads)  # numba's thread count is per calling thread
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                if job.cancelled():  # its client left between the queue and here
                    self.cancelled += 1
                    job.events.put(Finished(Cancelled(job.cancel_reason or "cancelled")))
                    continue
                self.running = job
            start = time.monotonic()
            outcome = self._run(job)
            seconds = time.monotonic() - start
            with self._cv:
                self.running = None
                self._mean_s = seconds if self._mean_s is None else (1 - _EMA) * self._mean_s + _EMA * seconds
                if outcome == "completed":
                    self.completed += 1
                elif outcome == "cancelled":
                    self.cancelled += 1
                else:
                    self.failed += 1

    def _run(self, job: Job) -> str:
        try:
            for d in run(self.served.model, job.prep, should_stop=job.cancelled):
                job.generated += d.new_tokens
                job.events.put(d)
        except Cancelled as e:
            self._log(f"{self.served.name}: {job.id} stopped after {job.generated} tokens "
                      f"({job.cancel_reason or e})")
            job.events.put(Finished(Cancelled(job.cancel_reason or str(e))))
            return "cancelled"
        except GoinferError as e:
            self._log(f"{self.served.name}: {job.id} failed: {e}")
            job.events.put(Finished(e))
            return "failed"
        except Exception as e:  # a bug: the client gets a 500, the log the traceback
            self._log(f"{self.served.name}: {job.id} failed:\n{traceback.format_exc().rstrip()}")
            job.events.put(Finished(e))
            return "failed"
        finally:
            job.done = True
        job.events.put(Finished())
        return "completed"


def _set_compute_threads(n: int) -> None:
    set_threads(n)  # numba's count is per calling thread, so the worker sets it for itself (BLAS too)
