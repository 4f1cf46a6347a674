"""The sequences a scheduler has admitted, and the steps that advance them (engine/running/scheduler.py owns the thread,
the queue and the admission; this module the work).

Each `step()` does at most two things: one chunk of the oldest admitted prompt, then one decode step for every
sequence that is generating, all of them in one `Model.decode_runs` call (each weight read once for all; a
sequence that drafts, engine/generation/speculation.py, brings its draft as more rows of its own). A long prompt
thus enters between decode steps, chunk by chunk, and the streams already running keep flowing.

A request's n choices share its prompt: it is evaluated once, then each choice continues from a copy of its
cache. With a session pool (engine/sessions/pool.py), a prompt starts from the warm session that shares most of it
and evaluates only the rest; its cache goes back to the pool when the request ends (and, idle, the scheduler
evaluates the reply into it: engine/sessions/warming.py). A sequence decides its tokens alone (generate.Generation:
sampling, grammar, stop strings, logprobs) from its own logits, and the decode step computes each sequence's
logits the same whatever else is in the batch (kernels/cpu: attention splits per sequence), so a reply does not
depend on who else is being served.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine.kernels import memory
from engine.errors import Cancelled
from engine.generation.generate import Generation, draft_room
from engine.kernels.backend import KVCache
from engine.models.base import PREFILL_CHUNK, Model
from engine.requests.prompts import continuation_ids
from engine.requests.request import ChoiceOutput
from engine.sessions.pool import SessionPool, Taken, pause_points
from engine.generation.speculation import Drafter, Speculation
from engine.sessions.warming import Warming


@dataclass
class Sequence:
    """One choice of an admitted job, generating: its last token is the next decode step's input."""

    job: object  # scheduler.Job
    gen: Generation
    cache: KVCache
    out: ChoiceOutput
    token: int = -1
    drafter: Drafter | None = None  # its guesses at its next tokens (engine/generation/speculation.py), where it drafts


@dataclass
class Prompt:
    """An admitted job whose prompt is being evaluated, chunk by chunk."""

    job: object  # scheduler.Job
    cache: KVCache
    done: int = 0  # prompt tokens evaluated so far (or reused from a warm session)
    snapshots: list[tuple] = field(default_factory=list)  # a recurrent cache's states where it paused, in order
    pauses: list[int] = field(default_factory=list)  # ... and where it will pause (sessions.pause_points)
    reply: list[str] | None = None  # a one-choice job's text so far (what warming continues from)


# Beside other sequences, a sequence drafts only while at least this share of its recent draft tokens were taken.
# A step's extra row costs ~1.1 ms on SmolLM2 (2 cores, AVX2) where a step of 4 sequences gives a token per
# ~1.5 ms: a draft token there pays only if it is taken ~3 times in 4 (alone, a step costs ~3.5 ms a token).
BATCH_DRAFT_RATE = 0.75

# How a job ended: "completed", "cancelled" (its client left, or shutdown) or "failed" (the error it gets).
EndFn = Callable[[object, str, BaseException | None], None]


class Stepper:
    def __init__(self, model: Model, *, prefill_chunk: int = PREFILL_CHUNK, on_end: EndFn,
                 sessions: SessionPool | None = None, warm_replies: bool = True,
                 speculation: Speculation | None = None):
        self.model = model
        self.speculation = speculation  # drafts checked several tokens a step (generation/speculation.py), or None
        self.prefill_chunk = prefill_chunk
        self._on_end = on_end
        self.sessions = sessions
        self.warming = Warming(model, sessions, prefill_chunk) if sessions is not None and warm_replies else None
        self._homes: dict[int, Prompt] = {}  # id(job) -> its prompt (whose cache goes back to the pool)
        self.prompts: deque[Prompt] = deque()
        self.running: list[Sequence] = []
        self._live: dict[int, int] = {}  # id(job) -> its choices not yet finished, for every job admitted
        self.decode_steps = 0  # batched decode steps so far
        self.decoded_tokens = 0  # sequences they advanced: / decode_steps = the mean batch
        self.drafted_tokens = self.accepted_tokens = 0  # draft tokens checked, and those that were the reply's

    # ------------------------------------------------------------------ state

    @property
    def idle(self) -> bool:
        return not self._live

    @property
    def has_background(self) -> bool:
        """Idle-time work is waiting (engine/sessions/warming.py)."""
        return self.warming is not None and self.warming.busy

    def kv_bytes(self) -> int:
        return sum(s.cache.nbytes() for s in self.running) + sum(p.cache.nbytes() for p in self.prompts)

    # ------------------------------------------------------------------ work

    def admit(self, job) -> None:
        prep = job.prep
        self._live[id(job)] = len(prep.choices)
        if self.warming is not None:
            self.warming.stop()  # first, so that a warming under way puts its session back for this prompt
        if self.sessions is not None:
            taken = self.sessions.take(prep.ids, prep.cache_tokens, marks=prep.marks)
        else:
            taken = Taken(self.model.new_cache(prep.cache_tokens), 0)
        cache, reused = taken.cache, taken.reused
        prep.cached_tokens = reused
        self._homes[id(job)] = p = Prompt(job, cache, reused, reply=[] if len(prep.choices) == 1 else None)
        job.prompt_done = reused
        if cache.state and self.sessions is not None:  # snapshots for a later prompt that shares a prefix
            p.snapshots = taken.snapshots
            p.pauses = pause_points(len(prep.ids), self.model.backend.prompt_tile, (*prep.marks, taken.shared),
                                    after=reused)
        self.prompts.append(p)

    def step(self) -> None:
        """One prompt chunk (the oldest prompt's), then one decode step for everything generating; with nothing
        to do, one chunk of idle-time warming."""
        if self.idle and self.has_background:
            self.warming.step()
            return
        self._drop_cancelled()
        if self.prompts:
            self._prompt_chunk(self.prompts[0])
        if self.running:
            self._decode()
        if not self.running:
            self.model.backend.end_sequences()

    def cancel_all(self, reason: str) -> None:
        for job in [p.job for p in self.prompts] + [s.job for s in self.running]:
            job.cancel(reason)
        self._drop_cancelled()

    def _prompt_chunk(self, p: Prompt) -> None:
        job, ids, model, cache = p.job, p.job.prep.ids, self.model, p.cache
        # A recurrent cache pauses where its state is copied for a later reuse (sessions.pause_points).
        pause = next((at for at in p.pauses if at > p.done), 0)
        try:
            if p.done == 0 and len(ids) <= self.prefill_chunk and not pause:  # whole, as `requests.run` does
                logits = model.prefill(ids, cache)
                p.done = len(ids)
                job.prompt_done = p.done
            else:
                end = min(len(ids), p.done + self.prefill_chunk)
                if p.done < pause < end:
                    end = pause
                n = end - p.done
                try:
                    logits = model.prefill_part(ids[p.done : end], cache, n - 1 if end == len(ids) else n)
                finally:
                    model.backend.end_prompt()
                p.done = job.prompt_done = end  # (job.prompt_done: what a stream's progress events report)
                if p.done == pause:
                    p.snapshots.append(cache.snapshot())
            if p.done == len(ids):
                self.prompts.popleft()
                self._start_choices(job, cache, logits[0])
        except Exception as e:  # noqa: BLE001 - the job fails, the others go on
            self._end(job, e)
        finally:
            memory.trim()  # the prompt's freed activations back to the OS

    def _start_choices(self, job, cache: KVCache, logits: np.ndarray) -> None:
        prep = job.prep
        echoed = prep.echoed(self.model)
        last = len(prep.choices) - 1
        for index, gen in enumerate(prep.choices):
            out = ChoiceOutput(self.model, prep, index)
            if prep.request.echo:
                job.put(out.echo(echoed))
            seq = Sequence(job, gen, cache if index == last else cache.fork(), out)
            if self.speculation is not None and self.model.runs_on(seq.cache):
                seq.drafter = self.speculation.drafter(prep.ids)
            if self._emit(seq, logits):
                self.running.append(seq)
            if id(job) not in self._live:
                return  # failed, or its last choice ended at its first token

    def _decode(self) -> None:
        batch = self.running
        runs = [[s.token] + self._draft(s, len(batch)) for s in batch]
        try:
            rows = self.model.decode_runs(runs, [s.cache for s in batch])
        except Exception as e:  # noqa: BLE001 - a failed step fails every job in it
            for s in batch:
                self._end(s.job, e)
            return
        self.decode_steps += 1
        self.decoded_tokens += len(batch)
        keep = [s for s, run, r in zip(batch, runs, rows) if id(s.job) in self._live and self._emit_run(s, run, r)]
        self.running = [s for s in keep if id(s.job) in self._live]  # a job failed by a later sequence leaves

    def _draft(self, seq: Sequence, batch: int) -> list[int]:
        """seq's draft for this step. Beside other sequences a draft row costs more than alone (the step already
        reads each weight for several rows: a row's own compute is what it adds), so there only a sequence whose
        recent drafts were mostly taken drafts (BATCH_DRAFT_RATE; measured: docs/benchmarks.md)."""
        if seq.drafter is None or (batch > 1 and seq.drafter.rate < BATCH_DRAFT_RATE):
            return []
        return seq.drafter.draft(draft_room(seq.gen, seq.cache))

    def _emit_run(self, seq: Sequence, run: list[int], rows: np.ndarray) -> bool:
        """seq's tokens from its run's rows, in order, until it decides other than its draft (run[1:]) or ends;
        the rows after that one are dropped from its cache. True while seq goes on."""
        for j in range(len(run)):
            going = self._emit(seq, rows[j])
            if not going or j + 1 == len(run) or seq.token != run[j + 1]:
                break
        if len(run) > 1:
            seq.cache.truncate(seq.cache.length - len(run) + j + 1)
            seq.drafter.verified(len(run) - 1, j)
            self.drafted_tokens += len(run) - 1
            self.accepted_tokens += j
        return going

    def _emit(self, seq: Sequence, logits: np.ndarray) -> bool:
        """Decide seq's next token from its logits and hand the job its piece; True while seq goes on."""
        job = seq.job
        try:
            ev = seq.gen.next(logits)
            piece = seq.out.piece(ev)
            job.put(piece)
            home = self._homes.get(id(job))
            if home is not None and home.reply is not None:
                home.reply.append(piece.text)
        except Exception as e:  # noqa: BLE001 - e.g. a grammar with no way on: this job fails, the others go on
            self._end(job, e)
            return False
        seq.token = ev.token
        if seq.drafter is not None:
            seq.drafter.push(ev.token)
        if not seq.gen.finished:
            return True
        self._live[id(job)] -= 1
        if self._live[id(job)] == 0:
            self._end(job, None)
        return False

    def _drop_cancelled(self) -> None:
        for job in [p.job for p in self.prompts] + [s.job for s in self.running]:
            if job.cancelled():
                self._end(job, Cancelled(job.cancel_reason or "cancelled"))

    def _end(self, job, error: BaseException | None) -> None:
        """The job is over: its sequences leave, their caches go, the scheduler is told (once)."""
        if self._live.pop(id(job), None) is None:
            return
        self.running = [s for s in self.running if s.job is not job]
        self.prompts = deque(p for p in self.prompts if p.job is not job)
        outcome = "completed" if error is None else "cancelled" if isinstance(error, Cancelled) else "failed"
        home = self._homes.pop(id(job))
        if self.sessions is not None and outcome != "failed":  # a failure may have left the cache half written
            # What its prompt pass computed goes back as a warm session, before the job's end is told: a client's
            # next turn, sent the moment it hears, finds it.
            self.sessions.give(home.cache, job.prep.ids[: home.done], home.snapshots)
            if outcome == "completed" and home.reply is not None and self.warming is not None:
                self.warming.add(continuation_ids(self.model, job.prep.request, "".join(home.reply)))
        self._on_end(job, outcome, error)
