"""`goinfer chat`: a terminal REPL, or one reply with --prompt for scripts.

Only the model's reply goes to stdout; notices and progress go to stderr.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from commands.errors import fail, user_errors
from commands.options import (BackendOption, DraftMaxOption, LoraOption, ModelOption, NoSelftestOption, QuantOption,
                             ReasoningBudgetOption, SpeculateOption, ThinkingOption, ThreadsOption, backend_choice,
                             in_panel, lora_choice, speculation_choice, thinking_settings)
from commands.ui import FetchProgress, placement_text, say, thought
from engine import load_model, set_threads
from engine.constrain import Grammar, json_schema_grammar
from engine.running.conversation import WarmConversation
from engine.errors import GoinferError
from engine.loading.precompile import announce_running, record_compile_time
from engine.thinking.plan import ThinkingSettings
from engine.generation.speculation import Speculation
from engine.requests.prompts import encode_prompt, message_starts
from engine.requests.request import GenerationRequest, SamplingOptions
from engine.thinking.harmony import EFFORTS
from engine.thinking.template import MODES
from engine.store.paths import goinfer_home

HELP = """Chat with a model in the terminal, or answer one prompt and exit.

Examples:

  goinfer chat                                  # REPL with the default model (smollm2-135m)

  goinfer chat --prompt "What is the capital of France? Answer in one sentence." --temp 0

  echo "Summarize: ..." | goinfer chat --prompt - --max 200

  goinfer chat --model gemma3-270m --system "Answer briefly."

  goinfer chat --prompt "A cat as JSON" --schema cat.schema.json   # the reply is JSON valid under it

  goinfer chat --session notes.kvsession        # resume the conversation saved there (saved after each turn)

The REPL keeps the conversation's KV cache between turns: each turn evaluates only what is new.

A thinking model's reasoning prints dimmed on stderr before its answer (--hide-thinking: a marker instead); only
the answer goes to stdout and into the conversation.

In the REPL: /retry (a new reply to the last message), /undo (drop the last exchange), /reset, /system TEXT,
/temp T, /seed N, /max N, /think MODE, /quit; /help (or /?) lists them, and each says what it changed. Ctrl-C stops
a reply; Ctrl-D quits. A --session file follows the conversation: rewritten after each reply and /undo, removed by
/reset and /system.
"""

REPL_COMMANDS = (  # what /help and /? list, one line each
    ("/help, /?", "this list"),
    ("/retry", "a new reply to the last message (marked \"(retry)\")"),
    ("/undo", "drop the last exchange (your message and its reply)"),
    ("/reset", "clear the conversation; the system prompt stays"),
    ("/system TEXT", "set the system prompt (no TEXT: remove it); clears the conversation"),
    ("/temp T", "sampling temperature, T >= 0 (0: greedy)"),
    ("/seed N", "sampling seed (no N: a random one each reply)"),
    ("/max N", "the most tokens a reply may have, N >= 1"),
    ("/think MODE", "thinking: " + ", ".join(MODES)),
    ("/effort LEVEL", "gpt-oss reasoning effort: " + ", ".join(EFFORTS)),
    ("/verbose", "timings after each reply, on or off"),
    ("/quit, /exit, /q", "leave (Ctrl-D too; Ctrl-C stops a reply)"),
)
REPL_HINT = "/help lists the commands (Ctrl-C stops a reply, Ctrl-D quits)"


@dataclass
class ChatState:
    """What the REPL carries between turns."""

    system: str | None
    options: SamplingOptions  # the sampling flags (/temp, /seed, /max change them); prepare reads them
    messages: list[dict] = field(default_factory=list)
    grammar: Grammar | None = None  # --schema: replies constrained to it
    warm: WarmConversation | None = None  # the conversation's KV cache, kept between turns
    thinking: ThinkingSettings = ThinkingSettings()  # --thinking / --reasoning-budget, /think
    show_thinking: bool = True
    effort: str | None = None  # --reasoning-effort, /effort: gpt-oss's Reasoning line
    speculation: Speculation | None = None  # --speculate / --draft-max; None: one token a step
    verbose: bool = False  # --verbose, /verbose: each reply's timings on stderr

    def conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def request(self) -> GenerationRequest:
        """The next reply as the request a server would get: the conversation, the sampling flags, the schema and
        the reasoning effort (thinking mode and budget are the runner's: prepare's `thinking`)."""
        return GenerationRequest(messages=tuple(self.conversation()), options=self.options, grammar=self.grammar,
                                 reasoning_effort=self.effort)


# --help panels
MODEL, TALK, SAMPLING, REASONING = "Model", "Conversation", "Sampling", "Reasoning"


def chat(
    model: in_panel(ModelOption, MODEL) = None,
    system: Annotated[Optional[str], typer.Option(help="System prompt.", rich_help_panel=TALK)] = None,
    temp: Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 = greedy.",
                                        rich_help_panel=SAMPLING)] = 0.7,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).",
                                       rich_help_panel=SAMPLING)] = 40,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.", rich_help_panel=SAMPLING)] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens less likely than this fraction of the most "
                                                         "likely one (0 = off).", rich_help_panel=SAMPLING)] = 0.0,
    repeat_penalty: Annotated[float, typer.Option(
        "--repeat-penalty", help="Divide the logits of tokens already in the conversation by this (1 = off).",
        rich_help_panel=SAMPLING)] = 1.0,
    presence_penalty: Annotated[float, typer.Option(
        "--presence-penalty", help="Subtract this from tokens already generated (0 = off).",
        rich_help_panel=SAMPLING)] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(
        "--frequency-penalty", help="Subtract this times each token's count so far (0 = off).",
        rich_help_panel=SAMPLING)] = 0.0,
    seed: Annotated[Optional[int], typer.Option(help="Random seed, for reproducible sampling.",
                                                rich_help_panel=SAMPLING)] = None,
    max_tokens: Annotated[int, typer.Option("--max", help="Most tokens per reply.", rich_help_panel=SAMPLING)] = 512,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Answer this once and exit ('-' reads stdin).",
                                                  rich_help_panel=TALK)] = None,
    quant: in_panel(QuantOption, MODEL) = "auto",
    backend: in_panel(BackendOption, MODEL) = "cpu",
    threads: in_panel(ThreadsOption, MODEL) = None,
    ctx: Annotated[Optional[int], typer.Option(
        "--ctx", help="Context window of the conversation, in tokens (default and cap: the model's own).",
        rich_help_panel=MODEL)] = None,
    no_selftest: in_panel(NoSelftestOption, MODEL) = False,
    schema: Annotated[Optional[Path], typer.Option(
        "--schema", help="A JSON schema file: every reply is JSON valid under it.", rich_help_panel=TALK)] = None,
    session_file: Annotated[Optional[Path], typer.Option(
        "--session", help="Resume the conversation saved in this file (its messages and KV cache); written after "
                          "each turn.", rich_help_panel=TALK)] = None,
    thinking: in_panel(ThinkingOption, REASONING) = "template",
    reasoning_budget: in_panel(ReasoningBudgetOption, REASONING) = "auto",
    speculate: in_panel(SpeculateOption, MODEL) = "ngram",
    draft_max: in_panel(DraftMaxOption, MODEL) = 4,
    lora: in_panel(LoraOption, MODEL) = None,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="After each reply, print its timings on stderr: the prompt's tokens (how many came "
                                "from the warm cache) and time, the reply's tokens and tokens per second.",
        rich_help_panel=TALK)] = False,
    show_thinking: Annotated[bool, typer.Option(
        "--show-thinking/--hide-thinking", help="Print a thinking model's reasoning (dimmed, on stderr) before its "
                                                 "answer, or only a marker.", rich_help_panel=REASONING)] = True,
    reasoning_effort: Annotated[Optional[str], typer.Option(
        "--reasoning-effort", help="gpt-oss: low, medium or high, written on its template's Reasoning line "
                                   "(default: the template's, medium). Other models ignore it.",
        rich_help_panel=REASONING)] = None,
) -> None:
    options = sampling_options(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed,
                               max_tokens=max_tokens)
    if threads is not None and threads < 1:
        raise fail(f"--threads must be >= 1, got {threads}")
    if ctx is not None and ctx < 16:
        raise fail(f"--ctx must be >= 16, got {ctx}")
    if session_file is not None and prompt is not None:
        raise fail("--session resumes a REPL conversation; it does not go with --prompt")
    backend_choice(backend)
    adapters = lora_choice(lora)
    if reasoning_effort is not None and reasoning_effort.lower() not in EFFORTS:
        raise fail(f"--reasoning-effort must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}")
    session = ChatState(system, options, thinking=thinking_settings(thinking, reasoning_budget),
                        show_thinking=show_thinking, effort=reasoning_effort,
                        speculation=speculation_choice(speculate, draft_max), verbose=verbose)
    with user_errors():
        session.grammar = _schema_grammar(schema) if schema is not None else None
    if prompt is not None:  # a script's timeout stops a one-shot as Ctrl-C does: its notices still said
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        _run(session, model, quant, no_selftest, adapters, backend, ctx, threads, session_file, prompt)
    finally:  # a first run's compile that goes on after this returns (or is interrupted) is said, never hidden
        announce_running(lambda line: say(f"goinfer: {line}"))


def sampling_options(*, temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                     presence_penalty: float, frequency_penalty: float, seed: int | None,
                     max_tokens: int) -> SamplingOptions:
    """The sampling flags, checked (a bad one: one line, exit 2), as the request options a server's body states."""
    if temp < 0:
        raise fail(f"--temp must be >= 0, got {temp}")
    if max_tokens < 1:
        raise fail(f"--max must be >= 1, got {max_tokens}")
    if not 0 <= min_p <= 1:
        raise fail(f"--min-p must be in [0, 1], got {min_p}")
    if repeat_penalty <= 0:
        raise fail(f"--repeat-penalty must be > 0, got {repeat_penalty}")
    for flag, value in (("--presence-penalty", presence_penalty), ("--frequency-penalty", frequency_penalty)):
        if not -2 <= value <= 2:
            raise fail(f"{flag} must be in [-2, 2], got {value}")
    return SamplingOptions(max_tokens=max_tokens, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                           repetition_penalty=repeat_penalty, presence_penalty=presence_penalty,
                           frequency_penalty=frequency_penalty)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(session: ChatState, model, quant, no_selftest, adapters, backend, ctx, threads, session_file,
         prompt) -> None:
    """Load the model, then one reply (--prompt) or the REPL."""
    with user_errors():
        set_threads(threads)
        progress = FetchProgress()
        try:
            llm = load_model(model, quant=quant, progress=progress, selftest=not no_selftest, background_compile=True,
                             lora=adapters, backend=backend, context=ctx)
        finally:
            progress.close()
        session.warm = WarmConversation(llm, path=session_file, threads=threads, window=ctx,
                                        warn=lambda line: say(line, lead="warning:", lead_style="yellow"))
        saved = session.warm.load()
        if saved:
            session.system = saved.get("system", session.system)
            session.messages = list(saved.get("messages", []))
            say(f"resumed {len(session.messages)} messages from {session_file}")
        if prompt is not None:
            text = sys.stdin.read() if prompt == "-" else prompt
            if not text.strip():
                raise fail("the prompt is empty")
            session.messages.append({"role": "user", "content": text})
            _reply(session)
            record_compile_time("prompt")  # (when it compiled: the next first run's "compiling" line expects it)
            return
    try:
        _repl(llm, session)
    finally:
        session.warm.wait()  # the last turn's cache evaluated and written


def _schema_grammar(path: Path) -> Grammar:
    """--schema FILE: the grammar of JSON valid under the schema in FILE (bad input: one line, exit 2)."""
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise fail(f"--schema: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise fail(f"--schema: {path} is not valid JSON: {e}") from None
    return json_schema_grammar(schema, f"--schema {path}")


def _reply(session: ChatState) -> str:
    """Stream one assistant reply to stdout (a thinking model's reasoning dimmed on stderr before it); return the
    answer's text (also when stopped by Ctrl-C). The prompt, thinking mode, Harmony's channels, the schema's grammar
    and the sampling are decided by requests.prepare, as for a server's request."""
    parts: list[str] = []
    shown = False  # the reasoning (or its marker) was printed: the answer starts on a new line
    start, first, tokens = time.perf_counter(), None, 0
    try:
        prep = session.warm.prepare(session.request(), session.thinking)
        for ev in session.warm.reply(prep, speculation=session.speculation):
            tokens += 1
            if first is None:
                first = time.perf_counter()  # the prompt pass and the first token
            if ev.reasoning and not (shown and not session.show_thinking):
                thought(ev.reasoning if session.show_thinking else "(thinking…)")
                shown = True
            if ev.text and shown:
                thought("\n")
                shown = False
            if ev.text:
                parts.append(ev.text)
                sys.stdout.write(ev.text)
                sys.stdout.flush()
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if session.verbose and first is not None:
            say(_timings(session.warm, start, first, time.perf_counter(), tokens), style="dim")
    return "".join(parts)


def _timings(warm: WarmConversation, start: float, first: float, end: float, tokens: int) -> str:
    """One line on a reply's speed, as llama.cpp and Ollama print theirs: the prompt (to the first token) and
    the reply after it."""
    evaluated = warm.prompt_tokens - warm.cached_tokens
    line = (f"prompt {warm.prompt_tokens} tokens ({warm.cached_tokens} reused) in {first - start:.2f} s"
            + (f", {evaluated / (first - start):.1f} tokens/s" if evaluated and first > start else ""))
    if tokens > 1 and end > first:
        line += f" · reply {tokens} tokens in {end - start:.2f} s, {(tokens - 1) / (end - first):.1f} tokens/s"
    else:
        line += f" · reply {tokens} token"
    return line


def _repl(llm, session: ChatState) -> None:
    interactive = sys.stdin.isatty()
    reader = _terminal_reader() if interactive else _pipe_reader()
    if interactive:
        lora = "".join(f" + LoRA {a['adapter']}" for a in llm.adapters)
        say(f"ready{lora} ({placement_text(llm.placement)}). {REPL_HINT}", lead=llm.name, lead_style="bold")
    while True:
        try:
            line = reader()
        except EOFError:
            return
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt clears the line, as in a shell
        if line is None:
            return
        line = line.strip()
        if not line:
            continue
        if line.split(" ")[0] == "/retry":
            if not session.messages or session.messages[-1]["role"] != "assistant":
                say("nothing to retry")
                continue
            retried = session.messages.pop()
            say("(retry)", style="dim")  # the reply that follows replaces the last one
        elif line.startswith("/"):
            if _command(line, session):
                return
            if line.split(" ")[0] in ("/undo", "/reset", "/system"):  # the session file follows the conversation
                if session.messages:
                    _warm_next_turn(llm, session)
                else:
                    session.warm.forget_file()
            continue
        else:
            retried = None
            session.messages.append({"role": "user", "content": line})
        try:
            reply = _reply(session)
        except (KeyboardInterrupt, GoinferError) as e:
            if isinstance(e, KeyboardInterrupt):
                say("(stopped)", style="dim")
            else:
                say(str(e), lead="error:", lead_style="red")
            if retried is None:
                session.messages.pop()
            else:
                session.messages.append(retried)  # the reply it had stays
            continue
        session.messages.append({"role": "assistant", "content": reply})
        _warm_next_turn(llm, session)


def _warm_next_turn(llm, session: ChatState) -> None:
    """While the user reads and types: the conversation as the next prompt will start, into the cache. A recurrent
    model keeps snapshots where /retry (the last prompt's end) and /undo (the last user message) would resume."""
    conversation = session.conversation()
    text = llm.render_chat(conversation, add_generation_prompt=False)
    ids = encode_prompt(llm, text)
    marks = (*message_starts(llm, text, conversation, ids), session.warm.prompt_tokens) \
        if llm.config.state_shapes else ()
    session.warm.absorb(ids, {"system": session.system, "messages": session.messages}, marks)


def _command(line: str, session: ChatState) -> bool:
    """Apply a /command; return True to quit."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    try:
        if name in ("/quit", "/exit", "/q"):
            return True
        if name in ("/help", "/?"):
            width = max(len(usage) for usage, _ in REPL_COMMANDS)
            for usage, what in REPL_COMMANDS:
                say(f"{usage.ljust(width)}  {what}")
        elif name == "/reset":
            session.messages.clear()
            say("conversation cleared; " + (f"system prompt kept: {_shorten(session.system)}" if session.system
                                            else "no system prompt set"))
        elif name == "/undo":
            if not session.messages:
                say("nothing to undo")
            else:
                while session.messages and session.messages.pop()["role"] != "user":
                    pass  # the reply, then the message it answered
                say("removed the last exchange")
        elif name == "/system":
            session.system = arg or None
            session.messages.clear()
            say((f"system prompt: {_shorten(arg)}" if arg else "system prompt removed") + "; conversation cleared")
        elif name == "/temp":
            value = float(arg)
            if value < 0:
                raise ValueError
            session.options = replace(session.options, temperature=value)
            say(f"temperature: {value:g}" + (" (greedy)" if value == 0 else ""))
        elif name == "/seed":
            session.options = replace(session.options, seed=int(arg) if arg else None)
            say(f"seed: {session.options.seed}" if arg else "seed: none (a random one each reply)")
        elif name == "/think":
            if arg not in MODES:
                raise ValueError
            session.thinking = ThinkingSettings(arg, session.thinking.budget)
            say(f"thinking: {arg}")
        elif name == "/effort":
            if arg.lower() not in EFFORTS:
                raise ValueError
            session.effort = arg.lower()
            say(f"reasoning effort: {session.effort}")
        elif name == "/verbose":
            session.verbose = not session.verbose
            say(f"timings after each reply: {'on' if session.verbose else 'off'}")
        elif name == "/max":
            value = int(arg)
            if value < 1:
                raise ValueError
            session.options = replace(session.options, max_tokens=value)
            say(f"max tokens: {value}")
        else:
            say(f"unknown command {name}; /help lists the commands")
    except ValueError:
        say(f"invalid value for {name}: {arg!r}")
    return False


def _shorten(text: str, width: int = 60) -> str:
    """A system prompt as a notice quotes it: one line, at most `width` characters."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[:width - 1] + "…"


def _terminal_reader():
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    history = goinfer_home() / "chat_history"
    history.parent.mkdir(parents=True, exist_ok=True)
    prompt_session = PromptSession(history=FileHistory(str(history)))
    return lambda: prompt_session.prompt(">>> ")


def _pipe_reader():
    def read() -> str | None:
        line = sys.stdin.readline()
        return line if line else None

    return read
