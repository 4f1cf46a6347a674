"""The resumable batch run: input lines -> output records, one fsynced line at a time.

Run by `goinfer batch`, and by `goinfer serve`'s `/v1/batches` (engine/server/batches.py) on its schedulers. A
rerun of the same input and output skips the custom_ids already in the output, redoes a line a crash cut in half,
and retries earlier failures; when nothing needs the model, the model is never loaded.
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.api.anthropic import MESSAGES_URL, message_object
from engine.api.decisions import decision_object
from engine.api.embeddings import embeddings_object, token_lists
from engine.decisions.scoring import score_request
from engine.api.openai_objects import error_code, response_object
from engine.batch.io import BatchLine, RecordLog, error_record, errors_path, read_input, success_record
from engine.errors import BatchFileError, Cancelled, GoinferError
from engine.kernels.threads import get_threads
from engine.thinking.plan import ThinkingSettings
from engine.requests.request import Collector, GenerationRequest, SamplingOptions, apply_defaults, execute, prepare
from engine.running.scheduler import Finished, Job, QueueFull, Scheduler
from engine.sessions.pool import SessionPool
from engine.generation.speculation import Speculation


def run_request(model, req: GenerationRequest, *, model_name: str | None = None,
                should_stop: Callable[[], bool] | None = None,
                on_token: Callable[[int], None] | None = None, window: int | None = None,
                thinking: ThinkingSettings = ThinkingSettings(), speculation: Speculation | None = None) -> dict:
    """Execute `req` on `model` and return the response object the endpoint it came from answers with."""
    result = execute(model, req, should_stop=should_stop, on_token=on_token, window=window, thinking=thinking,
                     speculation=speculation)
    return response_object(req, result, model_name=model_name or model.name)


@dataclass
class BatchPlan:
    """What a run will do, known before the model is loaded."""

    total: int  # request lines in the input
    done: int  # already in the output (skipped)
    to_run: int  # lines this run processes (malformed ones included: they are recorded as failures)
    output: Path
    errors: Path


@dataclass
class LineResult:
    """One finished line, for progress reports."""

    custom_id: str | None
    lineno: int
    ok: bool
    completion_tokens: int
    seconds: float
    error: str | None = None  # the error record's message


@dataclass
class BatchSummary:
    plan: BatchPlan
    succeeded: int = 0
    failed: int = 0
    interrupted: bool = False
    model_loaded: bool = False


def run_batch(input_path: str | Path, output_path: str | Path, load_model: Callable[[], object], *,
              defaults: SamplingOptions | None = None, system: str | None = None, model_name: str | None = None,
              should_stop: Callable[[], bool] | None = None,
              on_plan: Callable[[BatchPlan], None] | None = None,
              on_line: Callable[[LineResult], None] | None = None,
              on_token: Callable[[int], None] | None = None, parallel: int = 1,
              thinking: ThinkingSettings = ThinkingSettings(),
              load_embedder: Callable[[], object] | None = None,
              scheduler: Scheduler | None = None, speculation: Speculation | None = None) -> BatchSummary:
    """Run every line of `input_path` not yet in `output_path`; with `parallel` > 1, that many lines at once
    through a scheduler (decoded together; each line's answer is the one it gets alone), recorded as they end.

    `defaults` fill what a line's body leaves unset (the body wins; the API defaults fill the rest);
    `system` is the system prompt for chats that have none; `thinking` the mode and reasoning budget for lines
    that set none (a line's chat_template_kwargs / reasoning_effort / thinking_token_budget win). `load_model()`
    is called only when some line needs the model, `load_embedder()` only when some /v1/embeddings line does
    (those lines run first, one after another: an encoder's pass is short; /v1/systemone lines next, on the model). `should_stop()` is polled between tokens and lines: True
    abandons the current line (nothing of it is written) and ends the run with `interrupted` set. File-level
    problems (unreadable input, duplicate custom_id, unwritable output) raise BatchFileError before any work.
    `scheduler`: the model's running scheduler (a server's), to take the lines beside its other work; without
    one, a run of `parallel` > 1 makes its own. `speculation`: drafts checked several tokens a step
    (engine/generation/speculation.py; the same answers, sooner)."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    input_path, output_path = Path(input_path), Path(output_path)
    lines = read_input(input_path)
    if output_path.exists() and _same_file(input_path, output_path):
        raise BatchFileError(f"{output_path}: the output file must not be the input file")
    err_path = errors_path(output_path)
    out = RecordLog(output_path)
    try:
        errs = RecordLog(err_path, fresh=True)
    except BaseException:
        out.close()
        raise
    stopped = should_stop or (lambda: False)
    try:
        pending = [ln for ln in lines if ln.custom_id is None or ln.custom_id not in out.custom_ids]
        plan = BatchPlan(total=len(lines), done=len(lines) - len(pending), to_run=len(pending),
                         output=output_path, errors=err_path)
        summary = BatchSummary(plan)
        if on_plan is not None:
            on_plan(plan)
        embedding = [ln for ln in pending if ln.embeds]
        deciding = [ln for ln in pending if ln.decides]
        pending = [ln for ln in pending if not (ln.embeds or ln.decides)]
        model = embedder = None
        if deciding or any(ln.request is not None for ln in pending):
            model = load_model()
            summary.model_loaded = True
        if embedding and load_embedder is not None:
            embedder = load_embedder()
        ctx = _Run(model, out, errs, defaults, system, model_name, stopped, on_token, on_line, summary, thinking,
                   embedder, speculation)
        for line in embedding + deciding:
            if stopped() or not ctx.record(_embed_line(line, ctx) if line.embeds else _decide_line(line, ctx)):
                summary.interrupted = True
                return summary
        if (parallel > 1 or scheduler is not None) and model is not None:
            _run_parallel(pending, ctx, parallel, scheduler)
        else:
            for line in pending:
                if stopped() or not ctx.record(_run_line(line, ctx)):
                    summary.interrupted = True
                    break
        return summary
    finally:
        out.close()
        errs.close()
        if errs.count == 0:
            _remove(err_path)  # this run had no failures: no stale errors file left behind


@dataclass
class _Run:
    """What every line of a run shares."""

    model: object
    out: RecordLog
    errs: RecordLog
    defaults: SamplingOptions | None
    system: str | None
    model_name: str | None
    stopped: Callable[[], bool]
    on_token: Callable[[int], None] | None
    on_line: Callable[[LineResult], None] | None
    summary: BatchSummary
    thinking: ThinkingSettings = ThinkingSettings()
    embedder: object = None  # the embedding model of /v1/embeddings lines (engine/embeddings)
    speculation: Speculation | None = None  # engine/generation/speculation.py

    def request(self, line: BatchLine) -> GenerationRequest:
        return apply_defaults(line.request, self.defaults, self.system)

    def body(self, line: BatchLine, req: GenerationRequest, result) -> dict:
        """The answer a line's endpoint gives: an Anthropic message (/v1/messages), else OpenAI's object."""
        name = self.model_name or self.model.name
        if line.url == MESSAGES_URL:
            return message_object(result, model_name=name)
        return response_object(req, result, model_name=name)

    def answered(self, line: BatchLine, body: dict, start: float) -> LineResult:
        self.out.append(success_record(line.custom_id, body))
        used = body["usage"]
        tokens = used.get("completion_tokens", used.get("output_tokens", 0))
        return LineResult(line.custom_id, line.lineno, True, tokens, time.monotonic() - start)

    def failed(self, line: BatchLine, code: str, message: str, start: float) -> LineResult:
        message = f"line {line.lineno}: {message}"
        self.errs.append(error_record(line.custom_id, code, message))
        return LineResult(line.custom_id, line.lineno, False, 0, time.monotonic() - start, message)

    def malformed(self, line: BatchLine, start: float) -> LineResult:
        """The record of a line that could not be read as a request (its error already names the line)."""
        code, message = line.error
        return self.failed(line, code, message.removeprefix(f"line {line.lineno}: "), start)

    def refused(self, line: BatchLine, e: Exception, start: float) -> LineResult:
        """The record of a line whose request raised e (a bug must not cost the rest of a long run either)."""
        if isinstance(e, GoinferError):
            return self.failed(line, error_code(e), str(e), start)
        return self.failed(line, "internal_error", f"{type(e).__name__}: {e}", start)

    def record(self, result: LineResult | None) -> bool:
        """Count a finished line; False for an abandoned one (should_stop)."""
        if result is None:
            return False
        if result.ok:
            self.summary.succeeded += 1
        else:
            self.summary.failed += 1
        if self.on_line is not None:
            self.on_line(result)
        return True


def _run_line(line: BatchLine, ctx: _Run) -> LineResult | None:
    """Run one line here and record it; None when it was abandoned (should_stop)."""
    start = time.monotonic()
    if line.error is not None:
        return ctx.malformed(line, start)
    req = ctx.request(line)
    try:
        result = execute(ctx.model, req, should_stop=ctx.stopped, on_token=ctx.on_token, thinking=ctx.thinking,
                         speculation=ctx.speculation)
        body = ctx.body(line, req, result)
    except Cancelled:
        return None
    except Exception as e:  # noqa: BLE001 - recorded as the line's failure
        return ctx.refused(line, e, start)
    return ctx.answered(line, body, start)


def _embed_line(line: BatchLine, ctx: _Run) -> LineResult:
    """Run one /v1/embeddings line on the run's embedding model and record it."""
    start = time.monotonic()
    if ctx.embedder is None:
        return ctx.failed(line, "model_not_found", "a /v1/embeddings line needs an embedding model "
                                                   "(goinfer batch --embed-model)", start)
    try:
        lists = token_lists(ctx.embedder, line.request)
        body = embeddings_object(ctx.embedder, line.request, ctx.embedder.embed(lists), sum(map(len, lists)))
    except Exception as e:  # noqa: BLE001 - recorded as the line's failure
        return ctx.refused(line, e, start)
    return ctx.answered(line, body, start)


def _decide_line(line: BatchLine, ctx: _Run) -> LineResult:
    """Run one /v1/systemone line on the run's model (label scoring, chat-v1) and record it."""
    start = time.monotonic()
    try:
        scored = score_request(ctx.model, line.request, "chat-v1")
        body = decision_object(line.request, scored.probabilities, model_name=ctx.model_name or ctx.model.name,
                               input_tokens=scored.input_tokens, template="chat-v1", calibrated={})
    except Exception as e:  # noqa: BLE001 - recorded as the line's failure
        return ctx.refused(line, e, start)
    return ctx.answered(line, body, start)


def _run_parallel(pending: list[BatchLine], ctx: _Run, parallel: int, shared: Scheduler | None = None) -> None:
    """Up to `parallel` lines in flight on a scheduler (`shared`, or one of the run's own); each recorded when it
    ends (so in the order they end). A shared scheduler whose queue is full takes the next line a little later."""
    model = ctx.model
    ended: queue.SimpleQueue[Job] = queue.SimpleQueue()
    # Warm sessions: lines that share a system prompt evaluate it once (the lines are not conversations: no
    # idle-time warming of their replies).
    sched = shared or Scheduler(model, ctx.model_name or model.name, max_queue=parallel, max_concurrent=parallel,
                                threads=get_threads(),  # numba's count is per thread: the scheduler's is the caller's
                                sessions=SessionPool(model), warm_replies=False, speculation=ctx.speculation,
                                log=lambda line: None)  # failures reach the errors file, not the log
    flying: dict[Job, tuple[BatchLine, GenerationRequest, float]] = {}
    lines = iter(pending)
    held = None  # a line the shared scheduler had no room for yet
    try:
        while True:
            while len(flying) < parallel and not ctx.stopped():
                line, held = held or next(lines, None), None
                if line is None:
                    break
                if not _launch(line, ctx, sched, flying, ended):
                    held = line
                    break
            if not flying:
                if held is not None and not ctx.stopped():
                    time.sleep(0.25)
                    continue
                break
            if ctx.stopped():
                ctx.summary.interrupted = True  # what is in flight is abandoned: nothing of it is written
                break
            try:
                job = ended.get(timeout=0.25)
            except queue.Empty:
                if ctx.on_token is not None:
                    ctx.on_token(sum(j.generated for j in flying))
                continue
            line, req, start = flying.pop(job)
            ctx.record(_finished(job, line, req, start, ctx))
    finally:
        for job in flying:  # abandoned (should_stop): nothing of them is written
            sched.withdraw(job, "the batch run stopped")
        if sched is not shared:
            sched.close("the batch run ended")


def _launch(line: BatchLine, ctx: _Run, sched: Scheduler, flying: dict, ended: queue.SimpleQueue) -> bool:
    """Submit one line, or record it at once when it cannot run (malformed, or refused by prepare); False when
    the scheduler's queue is full (nothing done: the line is for later)."""
    start = time.monotonic()
    if line.error is not None:
        ctx.record(ctx.malformed(line, start))
        return True
    req = ctx.request(line)
    try:
        prep = prepare(ctx.model, req, thinking=ctx.thinking)
    except Exception as e:  # noqa: BLE001 - recorded as the line's failure
        ctx.record(ctx.refused(line, e, start))
        return True
    job = Job(prep, request_id=line.custom_id or f"line {line.lineno}",
              on_event=lambda j, item: ended.put(j) if isinstance(item, Finished) else None)
    try:
        sched.submit(job)
    except QueueFull:
        return False
    flying[job] = (line, req, start)
    return True


def _finished(job: Job, line: BatchLine, req: GenerationRequest, start: float, ctx: _Run) -> LineResult:
    collect = Collector(job.prep)
    while True:
        item = job.events.get()
        if isinstance(item, Finished):
            break
        collect.add(item)
    if item.error is not None:
        if isinstance(item.error, Cancelled) and ctx.stopped():
            return None  # abandoned with the run: nothing of it is written
        return ctx.refused(line, item.error, start)
    return ctx.answered(line, ctx.body(line, req, collect.result()), start)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
