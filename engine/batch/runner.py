"""The resumable batch run: input lines -> output records, one fsynced line at a time.

Run by `goinfer batch` (the `/v1/batches` route would run the same). A rerun of the same input and output skips the
custom_ids already in the output, redoes a line a crash cut in half, and retries earlier failures; when
nothing needs the model, the model is never loaded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.api.openai_objects import error_code, response_object
from engine.batch.io import BatchLine, RecordLog, error_record, errors_path, read_input, success_record
from engine.errors import BatchFileError, Cancelled, GoinferError
from engine.requests import GenerationRequest, SamplingOptions, apply_defaults, execute


def run_request(model, req: GenerationRequest, *, model_name: str | None = None,
                should_stop: Callable[[], bool] | None = None,
                on_token: Callable[[int], None] | None = None, window: int | None = None) -> dict:
    """Execute `req` on `model` and return the response object the endpoint it came from answers with."""
    result = execute(model, req, should_stop=should_stop, on_token=on_token, window=window)
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
              on_token: Callable[[int], None] | None = None) -> BatchSummary:
    """Run every line of `input_path` not yet in `output_path`.

    `defaults` fill what a line's body leaves unset (the body wins; the API defaults fill the rest);
    `system` is the system prompt for chats that have none. `load_model()` is called only when some line
    needs the model. `should_stop()` is polled between tokens and lines: True abandons the current line
    (nothing of it is written) and ends the run with `interrupted` set. File-level problems (unreadable
    input, duplicate custom_id, unwritable output) raise BatchFileError before any work."""
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
        model = None
        if any(ln.request is not None for ln in pending):
            model = load_model()
            summary.model_loaded = True
        for line in pending:
            if stopped():
                summary.interrupted = True
                break
            result = _run_line(line, model, out, errs, defaults, system, model_name, stopped, on_token)
            if result is None:
                summary.interrupted = True
                break
            if result.ok:
                summary.succeeded += 1
            else:
                summary.failed += 1
            if on_line is not None:
                on_line(result)
        return summary
    finally:
        out.close()
        errs.close()
        if errs.count == 0:
            _remove(err_path)  # this run had no failures: no stale errors file left behind


def _run_line(line: BatchLine, model, out: RecordLog, errs: RecordLog, defaults, system, model_name,
              stopped, on_token) -> LineResult | None:
    """Run one line and record it; None when it was abandoned (should_stop)."""
    start = time.monotonic()
    if line.error is not None:
        code, message = line.error
    else:
        req = apply_defaults(line.request, defaults, system)
        try:
            body = run_request(model, req, model_name=model_name, should_stop=stopped, on_token=on_token)
        except Cancelled:
            return None
        except GoinferError as e:
            code, message = error_code(e), f"line {line.lineno}: {e}"
        except Exception as e:  # a bug must not cost the rest of a long run; the record names it
            code, message = "internal_error", f"line {line.lineno}: {type(e).__name__}: {e}"
        else:
            out.append(success_record(line.custom_id, body))
            return LineResult(line.custom_id, line.lineno, True, body["usage"]["completion_tokens"],
                              time.monotonic() - start)
    errs.append(error_record(line.custom_id, code, message))
    return LineResult(line.custom_id, line.lineno, False, 0, time.monotonic() - start, message)


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
