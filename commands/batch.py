"""`goinfer batch IN.jsonl -o OUT.jsonl`: run an OpenAI Batch file through a local model, resumably.

Data goes only to the output files; progress and notices go to stderr.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from commands.errors import EXIT_INTERRUPTED, EXIT_USAGE, fail, user_errors
from commands.options import (BackendOption, DraftMaxOption, EmbedQuantOption, LoraOption, ModelOption,
                              NoSelftestOption, QuantOption, ReasoningBudgetOption, ReasoningFormatOption, SpeculateOption,
                              ThinkingOption, ThreadsOption, backend_choice, lora_choice, speculation_choice,
                              thinking_settings)
from commands.ui import FetchProgress, duration, err, say
from engine import load_model, set_threads
from engine.embeddings import QUANTS as EMBED_QUANTS
from engine.embeddings import load_embedding_model
from engine.batch import BatchPlan, LineResult, check_input, run_batch
from engine.requests.request import SamplingOptions

EXIT_SOME_FAILED = 1
SHOWN = 20  # problems listed before '... and N more'

HELP = """Run a JSONL file of OpenAI Batch requests through a model; rerun the same command to resume.

Each input line: {"custom_id": "a1", "method": "POST", "url": "/v1/chat/completions", "body": {...}} (or "url": "/v1/completions"). Responses go to OUT.jsonl, failures to OUT.errors.jsonl.

A line's own settings win; the flags fill in what a line leaves unset; otherwise the OpenAI defaults apply (temperature 1, top_p 1, max_tokens 512, a random seed).

Examples:

  goinfer batch requests.jsonl -o results.jsonl

  goinfer batch requests.jsonl -o results.jsonl --temp 0 --max 256   # the same again resumes

  goinfer batch evals.jsonl -o out.jsonl --model gemma3-270m --system "Answer with one word."

  goinfer batch requests.jsonl -o results.jsonl --parallel 4        # 4 lines decoded together

Every line is checked first: if any is not a valid request, nothing runs (exit 2, each bad line named).

Exit status: 0 every line done, 1 some lines failed, 2 bad usage or input file, 130 interrupted. See docs/batch.md.
"""


def batch(
    input_file: Annotated[Path, typer.Argument(metavar="IN.jsonl", help="Requests, one JSON object per line.",
                                               show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="OUT.jsonl",
                                         help="Responses (appended; failures go to OUT.errors.jsonl).",
                                         show_default=False)],
    model: ModelOption = None,
    system: Annotated[Optional[str], typer.Option(help="System prompt for chats that have none.")] = None,
    temp: Annotated[Optional[float], typer.Option("--temp", help="Temperature where a line sets none.")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="top_k where a line sets none (0 = off).")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="top_p where a line sets none.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed where a line sets none.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max", help="max_tokens where a line sets none.")] = None,
    quant: QuantOption = "auto",
    backend: BackendOption = "cpu",
    parallel: Annotated[int, typer.Option(
        help="Lines run at once, decoded together (output in the order they end; each answer is the one it gets "
             "alone).")] = 1,
    threads: ThreadsOption = None,
    no_selftest: NoSelftestOption = False,
    thinking: ThinkingOption = "template",
    reasoning_budget: ReasoningBudgetOption = "auto",
    reasoning_format: ReasoningFormatOption = "auto",
    speculate: SpeculateOption = "ngram",
    draft_max: DraftMaxOption = 4,
    lora: LoraOption = None,
    embed_model: Annotated[str, typer.Option(
        "--embed-model", help="The embedding model of /v1/embeddings lines (loaded only when there are some).")]
    = "minilm-l6",
    embed_quant: EmbedQuantOption = "f32",
) -> None:
    if threads is not None and threads < 1:
        raise fail(f"--threads must be >= 1, got {threads}")
    if parallel < 1:
        raise fail(f"--parallel must be >= 1, got {parallel}")
    if embed_quant not in EMBED_QUANTS:
        raise fail(f"--embed-quant must be one of {', '.join(EMBED_QUANTS)}, got {embed_quant!r}")
    backend_choice(backend)  # now, not at the first generation line's lazy load
    if temp is not None and not 0 <= temp <= 2:
        raise fail(f"--temp must be in [0, 2], got {temp}")
    if top_p is not None and not 0 < top_p <= 1:
        raise fail(f"--top-p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 0:
        raise fail(f"--top-k must be >= 0, got {top_k}")
    if max_tokens is not None and max_tokens < 1:
        raise fail(f"--max must be >= 1, got {max_tokens}")
    settings = thinking_settings(thinking, reasoning_budget, reasoning_format)
    speculation = speculation_choice(speculate, draft_max)
    adapters = lora_choice(lora)
    defaults = SamplingOptions(temperature=temp, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
                               seed=None if seed is None else seed % (1 << 64))
    with user_errors():
        _check_lines(input_file)
    view = _ProgressView()
    stop = _StopOnCtrlC()

    def load():
        fetch = FetchProgress()
        try:
            set_threads(threads)
            return load_model(model, quant=quant, progress=fetch, selftest=not no_selftest, backend=backend,
                              lora=adapters)
        finally:
            fetch.close()

    def load_embedder():
        fetch = FetchProgress()
        try:
            return load_embedding_model(embed_model, progress=fetch, quant=embed_quant)
        finally:
            fetch.close()

    with user_errors(), stop:
        try:
            summary = run_batch(input_file, output, load, defaults=defaults, system=system,
                                should_stop=stop.requested, on_plan=view.plan, on_line=view.line,
                                on_token=view.token, parallel=parallel, thinking=settings,
                                load_embedder=load_embedder, speculation=speculation)
        finally:
            view.close()
    view.finish(summary)
    if summary.interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)
    if summary.failed:
        raise typer.Exit(EXIT_SOME_FAILED)


def _check_lines(path: Path) -> None:
    """Refuse the whole file, before anything runs, when any line is not a request the run can take: every bad
    line named (a run that only finds one when its turn comes, and records it as failed, fails it again on
    every rerun)."""
    problems = check_input(path)
    if not problems:
        return
    for lineno, message in problems[:SHOWN]:
        print(f"goinfer: error: {path}:{lineno}: {message}", file=sys.stderr)
    if len(problems) > SHOWN:
        print(f"goinfer: error: ... and {len(problems) - SHOWN} more", file=sys.stderr)
    what = "this line" if len(problems) == 1 else f"these {len(problems)} lines"
    raise fail(f"nothing was run: fix {what} of {path} and run again", EXIT_USAGE)


def _line_list(numbers: list[int]) -> str:
    """'line 7' / 'lines 3, 7, 9' (at most SHOWN of them, then 'and N more')."""
    shown = ", ".join(map(str, numbers[:SHOWN]))
    more = f" and {len(numbers) - SHOWN} more" if len(numbers) > SHOWN else ""
    return f"line{'s' if len(numbers) > 1 else ''} {shown}{more}"


class _StopOnCtrlC:
    """The first Ctrl-C abandons the current line(s) (nothing of them is written) and ends the run; a second
    one quits at once. Either way the output holds only whole lines."""

    def __init__(self):
        self._requested = False
        self._previous = None

    def requested(self) -> bool:
        return self._requested

    def _handle(self, signum, frame) -> None:
        if self._requested:
            raise KeyboardInterrupt
        self._requested = True
        _note("stopping: the lines in flight are abandoned (Ctrl-C again to quit at once)")

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


STILL_RUNNING_S = 60  # off a terminal: a line at least this often while a slow request runs


class _ProgressView:
    """A Rich bar on a terminal (done/total, tokens/s, ETA); one plain line per finished request otherwise, and a
    `still running` line each minute inside a slow one (a log that goes quiet looks like a hang)."""

    def __init__(self):
        self._tty = err.is_terminal
        self._progress: Progress | None = None
        self._task = None
        self._plan: BatchPlan | None = None
        self._finished = 0  # lines finished this run
        self._tokens = 0  # completion tokens of finished lines
        self._line_tokens = 0  # tokens of the line in flight
        self._failed: list[int] = []  # input line numbers of the lines that failed this run
        self._start = self._said = self._ended = time.monotonic()  # _ended: when the last line finished

    def plan(self, plan: BatchPlan) -> None:
        self._plan = plan
        self._start = self._said = time.monotonic()
        if plan.to_run == 0:
            return
        if plan.done:
            _note(f"batch: {plan.total} requests, {plan.done} already in {plan.output}, {plan.to_run} to run")
        else:
            _note(f"batch: {plan.total} requests")

    def _bar(self) -> None:
        if self._tty and self._progress is None and self._plan is not None:
            self._progress = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[tps]}"), TimeElapsedColumn(),
                                      TextColumn("eta {task.fields[eta]}"), console=err)
            self._progress.start()
            self._task = self._progress.add_task("batch", total=self._plan.total, completed=self._plan.done,
                                                 tps="", eta=self._eta())

    def token(self, n: int) -> None:
        self._line_tokens = n
        if self._tty:
            self._bar()
            self._progress.update(self._task, tps=self._rate(), eta=self._eta())
            return
        now = time.monotonic()
        if now - self._said >= STILL_RUNNING_S and self._plan is not None:
            self._said = now
            done = self._plan.done + self._finished
            _note(f"[{done}/{self._plan.total}] still running: {n} tok into the current request, {self._rate()} "
                  f"elapsed {duration(now - self._start)}")

    def _eta(self) -> str:
        """The time left at the pace of the lines finished this run, counting down from the last one's end."""
        if self._plan is None or not self._finished:
            return eta(0, 0, 1)
        left = eta_seconds(self._ended - self._start, self._finished, self._plan.to_run - self._finished)
        return duration(max(0.0, left - (time.monotonic() - self._ended)))

    def _rate(self) -> str:
        seconds = time.monotonic() - self._start
        return f"{(self._tokens + self._line_tokens) / seconds:.1f} tok/s" if seconds > 0 else ""

    def line(self, r: LineResult) -> None:
        self._finished += 1
        self._tokens += r.completion_tokens
        self._line_tokens = 0
        self._ended = time.monotonic()
        if not r.ok:
            self._failed.append(r.lineno)
        done = self._plan.done + self._finished
        if self._tty:
            self._bar()
            self._progress.update(self._task, completed=done, tps=self._rate(), eta=self._eta())
            if not r.ok:
                say(r.error, lead="error", lead_style="red", console=self._progress.console)
            return
        elapsed = time.monotonic() - self._start
        what = f"ok {r.completion_tokens} tok {self._rate()}" if r.ok else f"error: {r.error}"
        left = self._plan.to_run - self._finished
        remaining = f" eta ~{eta(elapsed, self._finished, left)}" if left else ""
        who = r.custom_id if r.custom_id is not None else f"(line {r.lineno})"
        self._said = time.monotonic()
        _note(f"[{done}/{self._plan.total}] {who} {what} elapsed {duration(elapsed)}{remaining}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def finish(self, summary) -> None:
        plan = summary.plan
        if summary.interrupted:
            _note(f"interrupted: {summary.succeeded} done, {summary.failed} failed this run; "
                  "rerun the same command to resume")
        elif plan.to_run == 0:
            _note(f"batch: nothing to do: all {plan.total} requests are already in {plan.output}")
        elif summary.failed:
            # Every line was checked before the run: these failed while running (e.g. a prompt longer than the
            # model's context). A rerun retries exactly them, and most such causes are in the line itself.
            _note(f"batch: {summary.succeeded} done, {summary.failed} failed: input {_line_list(sorted(self._failed))}"
                  f" (why: {plan.errors}). Failed lines are not in {plan.output}: rerunning the same command retries "
                  "only them, and fails them the same way unless their cause is fixed first")
        else:
            _note(f"batch: {summary.succeeded} done; all {plan.total} requests are in {plan.output}")


def _note(text: str) -> None:
    print(f"goinfer: {text}", file=sys.stderr, flush=True)


def eta_seconds(elapsed: float, finished: int, left: int) -> float | None:
    """Seconds left for `left` lines at the pace of the `finished` ones that took `elapsed`; None before any."""
    if left <= 0:
        return 0.0
    return elapsed / finished * left if finished > 0 else None


def eta(elapsed: float, finished: int, left: int) -> str:
    """eta_seconds as the progress line shows it: '-:--:--' until a line has finished."""
    seconds = eta_seconds(elapsed, finished, left)
    return "-:--:--" if seconds is None else duration(seconds)
