"""`goinfer serve`: an HTTP server over one or more local models, speaking the OpenAI and Anthropic APIs.

Routes (the table in engine/server/handler.py; docs/server.md lists them all), among them: GET /health,
GET /v1/models, GET /v1/models/{id}; OpenAI Chat Completions (POST /v1/chat/completions), Completions
(POST /v1/completions) and Responses (POST /v1/responses, GET /v1/responses/{id}); Anthropic Messages
(POST /v1/messages, POST /v1/messages/count_tokens).

The banner, warnings and the request log go to stderr; nothing is written to stdout.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from commands.errors import fail, user_errors
from commands.options import (BackendOption, DraftMaxOption, EmbedQuantOption, NoSelftestOption, QuantOption,
                              ReasoningBudgetOption, ReasoningFormatOption, SpeculateOption, ThinkingOption,
                              backend_choice, in_panel, lora_choice, speculation_choice, thinking_settings)
from commands.ui import FetchProgress, placement_text
from engine import get_threads, load_model, set_threads
from engine.loading.load import QUANT_MODES, check_model_file
from engine.decisions.calibration import calibration_for
from engine.decisions.calibration import read_file as read_calibration
from engine.decisions.prompts import TEMPLATES as DECISION_TEMPLATES
from engine.embeddings import QUANTS as EMBED_QUANTS
from engine.embeddings import load_embedding_model
from engine.server import (DEFAULT_ADDR, DEFAULT_CTX, DEFAULT_KEEPALIVE_S, DEFAULT_MAX_QUEUE, ServedModel, Server,
                           ServerConfig, parse_addr, parse_model_spec, split_model_options)
from engine.running.scheduler import DEFAULT_MAX_CONCURRENT, PREFILL_CHUNK
from engine.server.guard import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_DEADLINE_S
from engine.loading.precompile import record_compile_time, stop_running, warm_prompt_pass
from engine.server.state import session_budget_bytes
from engine.sessions.pool import DEFAULT_SESSIONS
from engine.store import DEFAULT_MODEL, lookup_builtin

HELP = """Serve models over HTTP with OpenAI-, Anthropic- and Ollama-compatible APIs.

Routes: POST /v1/chat/completions, /v1/completions and /v1/responses (OpenAI; GET /v1/responses/{id} returns a stored response), POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages), POST /api/chat, /api/generate and /api/embed, GET /api/tags (Ollama), GET /health, /v1/models and /v1/models/{id}.

Point an OpenAI SDK at http://HOST:PORT/v1, an Anthropic SDK or an Ollama client at http://HOST:PORT. Requests route on their "model" field; --model is repeatable as NAME=REF. Each model decodes up to --max-concurrent sequences together (one step reads each weight once for all of them); a newcomer's prompt is evaluated in --prefill-chunk token chunks between their steps. Up to --max-queue more requests wait (first come, first served); further ones get 429 with Retry-After. A prompt that starts as a recent one did (a chat's next turn, an agent's fixed system prompt) continues from that prompt's warm KV session (--kv-sessions) and evaluates only the rest; usage reports the reused tokens as cached_tokens.

With --api-key (or GOINFER_API_KEY) every route needs "Authorization: Bearer KEY" or "x-api-key: KEY". A non-loopback --addr needs a key.

Examples:

  goinfer serve  # smollm2-135m on http://127.0.0.1:8080

  goinfer serve --model gemma3-270m --ctx 8192

  goinfer serve -m small=smollm2-135m -m gemma=gemma3-270m --max-queue 4

  goinfer serve --max-concurrent 8 --prefill-chunk 256  # more streams

  goinfer serve --session-dir ~/.cache/goinfer/sessions  # survive restarts

  GOINFER_API_KEY=secret goinfer serve --addr 0.0.0.0:8443 --tls-cert cert.pem --tls-key key.pem

  curl http://127.0.0.1:8080/v1/chat/completions -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'

Ctrl-C (or SIGTERM) stops the server: requests in flight are cancelled. See docs/server.md.
"""


MODEL, SERVER, SECURITY, LIMITS, SESSIONS = "Model", "Server", "Security", "Limits", "Sessions"
REASONING, EMBEDDINGS, DECISIONS = "Reasoning", "Embeddings", "Decisions"


def serve(
    model: Annotated[Optional[List[str]], typer.Option(
        "--model", "-m", metavar="[NAME=]REF[,K=V]", rich_help_panel=MODEL,
        help="A .gguf path, checkpoint directory, built-in name or hf:OWNER/REPO:QUANT, served as NAME if given; "
             "after commas its own ctx=N, quant=Q, backend=B, lora=DIR (a PEFT adapter merged at load), "
             "lora-scale=S. Repeatable.")] = None,
    ctx: Annotated[int, typer.Option(
        rich_help_panel=MODEL, help="Context window per request, in tokens (capped at the model's own; past a "
                                    "Phi-3 model's original window, its long RoPE factors).")] = DEFAULT_CTX,
    quant: in_panel(QuantOption, MODEL) = "auto",
    backend: in_panel(BackendOption, MODEL) = "cpu",  # for every --model (embedding models stay on the CPU)
    threads: Annotated[Optional[int], typer.Option(
        rich_help_panel=MODEL, help="Compute threads per model (default: all cores).")] = None,
    no_selftest: in_panel(NoSelftestOption, MODEL) = False,
    speculate: in_panel(SpeculateOption, MODEL) = "ngram",
    draft_max: in_panel(DraftMaxOption, MODEL) = 4,
    addr: Annotated[str, typer.Option(
        rich_help_panel=SERVER, help="HOST:PORT to listen on (port 0: any free port).")] = DEFAULT_ADDR,
    web: Annotated[bool, typer.Option(
        "--web/--no-web", rich_help_panel=SERVER,
        help="Serve the built-in chat page at / (static; it asks for the API key).")] = True,
    sse_keepalive: Annotated[float, typer.Option(
        "--sse-keepalive", rich_help_panel=SERVER,
        help="Seconds of silence after which a stream gets a keep-alive comment.")] = DEFAULT_KEEPALIVE_S,
    batch_dir: Annotated[Optional[Path], typer.Option(
        "--batch-dir", rich_help_panel=SERVER,
        help="Keep uploaded files and /v1/batches here, and resume unfinished batches at start (default: a "
             "temporary directory, removed at shutdown).")] = None,
    allow_admin: Annotated[bool, typer.Option(
        "--allow-admin", rich_help_panel=SERVER,
        help="Serve /admin/models: load and unload models while running (needs an API key).")] = False,
    unload_drain_wait: Annotated[float, typer.Option(
        "--unload-drain-wait", metavar="SECONDS", rich_help_panel=SERVER,
        help="How long an admin unload lets running requests finish before cancelling them.")] = 5.0,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="GOINFER_API_KEY", show_envvar=True, rich_help_panel=SECURITY,
        help="Require this key on every route (Bearer or x-api-key).")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(
        "--api-key-file", rich_help_panel=SECURITY,
        help="A file of API keys, one a line (each accepted, beside --api-key).")] = None,
    tls_cert: Annotated[Optional[Path], typer.Option(
        "--tls-cert", rich_help_panel=SECURITY, help="PEM certificate: serve HTTPS.")] = None,
    tls_key: Annotated[Optional[Path], typer.Option(
        "--tls-key", rich_help_panel=SECURITY, help="PEM private key for --tls-cert.")] = None,
    cors_origin: Annotated[Optional[List[str]], typer.Option(
        "--cors-origin", metavar="ORIGIN", rich_help_panel=SECURITY,
        help="A web page origin (http://host:port) whose scripts may read the answers, besides this machine's "
             "(localhost, 127.0.0.1, [::1]); * for any; repeatable.")] = None,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", rich_help_panel=LIMITS, help="Requests that may wait per model.")] = DEFAULT_MAX_QUEUE,
    max_concurrent: Annotated[int, typer.Option(
        "--max-concurrent", rich_help_panel=LIMITS,
        help="Sequences per model decoded together (a request with n choices takes n).")] = DEFAULT_MAX_CONCURRENT,
    prefill_chunk: Annotated[int, typer.Option(
        "--prefill-chunk", rich_help_panel=LIMITS,
        help="Prompt tokens evaluated between two decode steps of the running sequences.")] = PREFILL_CHUNK,
    max_body_bytes: Annotated[int, typer.Option(
        "--max-body-bytes", rich_help_panel=LIMITS,
        help="Request-body limit; 0 derives it from the context window (at least 4 MiB).")] = 0,
    max_connections: Annotated[int, typer.Option(
        "--max-connections", rich_help_panel=LIMITS,
        help="Open connections at most; beyond, new ones get 503 with Retry-After.")] = DEFAULT_MAX_CONNECTIONS,
    read_deadline: Annotated[float, typer.Option(
        "--read-deadline", rich_help_panel=LIMITS,
        help="Seconds a client has to send a request's headers and body (from connecting, or from its last "
             "answer); a slower one is cut off.")] = DEFAULT_READ_DEADLINE_S,
    kv_sessions: Annotated[int, typer.Option(
        "--kv-sessions", rich_help_panel=SESSIONS,
        help="Warm sessions kept per model: a prompt that starts as a kept one did evaluates only the rest "
             "(0: none).")] = DEFAULT_SESSIONS,
    session_memory: Annotated[Optional[int], typer.Option(
        "--session-memory", metavar="MIB", rich_help_panel=SESSIONS,
        help="KV memory the warm sessions of a model may hold (default: 2048, or a quarter of the available "
             "memory if less).")] = None,
    session_dir: Annotated[Optional[Path], typer.Option(
        "--session-dir", rich_help_panel=SESSIONS,
        help="Write warm sessions here (on eviction and at shutdown) and restore them at start.")] = None,
    thinking: in_panel(ThinkingOption, REASONING) = "template",
    reasoning_budget: in_panel(ReasoningBudgetOption, REASONING) = "auto",
    reasoning_format: in_panel(ReasoningFormatOption, REASONING) = "auto",
    embed_model: Annotated[Optional[List[str]], typer.Option(
        "--embed-model", metavar="[NAME=]REF", rich_help_panel=EMBEDDINGS,
        help="An embedding model for /v1/embeddings (minilm-l6, or a sentence-transformers directory), optionally "
             "served as NAME; repeatable. Without --model, only embeddings are served.")] = None,
    embed_quant: in_panel(EmbedQuantOption, EMBEDDINGS) = "f32",
    decisions_template: Annotated[str, typer.Option(
        "--decisions-template", rich_help_panel=DECISIONS,
        help="How POST /v1/systemone shows a question to the model: chat-v1 (its chat template; instruct models) "
             "or bare-v1 (plain text; base models).")] = "chat-v1",
    decisions_calibration: Annotated[Optional[Path], typer.Option(
        "--decisions-calibration", metavar="FILE", rich_help_panel=DECISIONS,
        help="A calibration.json from `goinfer decisions-calibrate`: its temperatures calibrate /v1/systemone on the "
             "model it was fitted for (refused for another model or template).")] = None,
) -> None:
    started = time.monotonic()
    if ctx < 16:
        raise fail(f"--ctx must be >= 16, got {ctx}")
    if embed_quant not in EMBED_QUANTS:
        raise fail(f"--embed-quant must be one of {', '.join(EMBED_QUANTS)}, got {embed_quant!r}")
    backend_choice(backend)
    if decisions_template not in DECISION_TEMPLATES:
        raise fail(f"--decisions-template must be one of {', '.join(DECISION_TEMPLATES)}, got {decisions_template!r}")
    settings = thinking_settings(thinking, reasoning_budget, reasoning_format)
    speculation = speculation_choice(speculate, draft_max)
    specs = [parse_model_spec(s) for s in model] if model else [] if embed_model else [(None, None)]
    # each model's own ctx / quant / backend, checked before any model is loaded
    specs = [(name, *_model_options(ref, ctx, quant, backend)) for name, ref in specs]
    embed_specs = [parse_model_spec(s) for s in embed_model or ()]
    with user_errors():
        host, port = parse_addr(addr)
        config = ServerConfig(host=host, port=port, api_key=api_key or None, api_key_file=api_key_file,
                              tls_cert=tls_cert, tls_key=tls_key,
                              max_queue=max_queue, max_concurrent=max_concurrent, prefill_chunk=prefill_chunk,
                              max_body_bytes=max_body_bytes, keepalive_s=sse_keepalive, threads=threads,
                              kv_sessions=kv_sessions, session_memory_mib=session_memory, session_dir=session_dir,
                              max_connections=max_connections, read_deadline_s=read_deadline, thinking=settings,
                              decisions_template=decisions_template, cors_origins=tuple(cors_origin or ()),
                              batch_dir=batch_dir, ctx=ctx, allow_admin=allow_admin,
                              unload_drain_s=unload_drain_wait, web=web, speculation=speculation)
        config.check()  # before any model is loaded: a bad address or missing key costs nothing
        set_threads(threads)  # BLAS and this thread; each model's scheduler thread sets numba's count for itself
        names = [name or _default_name(ref) for name, ref, _ in specs]
        dupes = sorted({n for n in names if n is not None and names.count(n) > 1})
        if dupes:
            raise fail(f"--model: the name {dupes[0]!r} is given twice (give each model its own NAME=)")
        for _, ref, _ in specs:  # what can be told before listening: a bad file or calibration, in one line
            check_model_file(ref)
        if decisions_calibration is not None:
            read_calibration(decisions_calibration, decisions_template)
        server = Server([], config, loading=True)  # listening now: /health says "loading" until the models are in
    _banner_limits(server, config)
    loader = _Loader(server, specs, names, embed_specs, embed_quant, not no_selftest, decisions_calibration,
                     decisions_template, config, started)
    _run_until_signal(server, loader)


class _Loader(threading.Thread):
    """Loads the served models while the server already listens (engine/server/loading.py): each one's kernels
    compiled or loaded and its prompt pass run once before it is served, its decode step compiled by a process
    tied to this one where it is not cached yet (requests decode through the prompt pass meanwhile)."""

    def __init__(self, server: Server, specs, names, embed_specs, embed_quant: str, selftest: bool,
                 calibration: Path | None, template: str, config: ServerConfig, started: float):
        super().__init__(name="goinfer-load", daemon=True)  # daemon: a signal mid-compile must not wait for it
        self.server, self.specs, self.names, self.embed_specs = server, specs, names, embed_specs
        self.embed_quant, self.selftest, self.calibration, self.template = embed_quant, selftest, calibration, template
        self.config, self.started = config, started
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            set_threads(self.config.threads)  # numba's thread count is per thread: --threads for the load too
            self._load()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which exits with it
            self.error = e
            self.server.finish_loading(str(e) or type(e).__name__)
        finally:
            self.done.set()

    def _load(self) -> None:
        served = []
        for (name, ref, own), default in zip(self.specs, self.names):
            llm = _load(ref, own["quant"], self.selftest, own["ctx"], own["backend"], own["lora"])
            if own["lora"] and name is None:  # the adapted model is not the base: not under the base's name
                default = f"{default or llm.name}+{Path(own['lora'][0][0]).name}"
            warm_prompt_pass(llm)  # its prompt kernels now, not in the first request
            served.append(ServedModel.of(default or llm.name, llm, own["ctx"]))
        embedders = [_load_embedder(ref, name, self.embed_quant) for name, ref in self.embed_specs]
        names = [s.name for s in served] + [e.name for e in embedders]
        if len(set(names)) < len(names):
            raise fail("--model/--embed-model: two models get the same name; name them: NAME=REF")
        temperatures = None
        if self.calibration is not None:
            temperatures = calibration_for(self.calibration, {s.name: s.model for s in served}, self.template)
        for s in served:
            self.server.add_model(s)
        for e in embedders:
            self.server.add_embedder(e)
        if temperatures is not None:
            name, fitted = temperatures
            self.server.calibrate_decisions(name, fitted)
            _note(f"decisions on {name}: calibrated ({', '.join(f'{k} T={t:.3f}' for k, t in fitted.items())})")
        _banner_models(served, self.config)
        for e in embedders:
            _note(f"embedding model {e.name}: {e.path.name} ({e.dimension} dimensions, {e.pooling} pooling"
                  f"{', normalised' if e.normalize else ''}), context {e.context}")
        record_compile_time("prompt")  # (when it compiled: the next first start's "compiling" line expects it)
        self.server.finish_loading()
        _note(f"ready: answering requests ({time.monotonic() - self.started:.1f} s after start)")


def _model_options(ref: str | None, ctx: int, quant: str, backend: str) -> tuple[str | None, dict]:
    """A --model's REF and its own ctx / quant / backend (`REF,ctx=N,quant=Q,backend=B`), else the flags'."""
    with user_errors():
        ref, options = split_model_options(ref)
    own = {"ctx": ctx, "quant": quant, "backend": backend, "lora": ()}
    if "ctx" in options:
        if not options["ctx"].isdigit() or int(options["ctx"]) < 16:
            raise fail(f"--model {ref}: ctx must be a whole number >= 16, got {options['ctx']!r}")
        own["ctx"] = int(options["ctx"])
    if "quant" in options:
        if options["quant"] not in QUANT_MODES:
            raise fail(f"--model {ref}: quant must be one of {', '.join(QUANT_MODES)}, got {options['quant']!r}")
        own["quant"] = options["quant"]
    if "backend" in options:
        own["backend"] = backend_choice(options["backend"])
    if "lora-scale" in options and "lora" not in options:
        raise fail(f"--model {ref}: lora-scale= goes with lora=DIR")
    if "lora" in options:
        own["lora"] = tuple(lora_choice([options["lora"] + ",scale=" + options.get("lora-scale", "1")]))
    return ref, own


def _default_name(ref: str | None) -> str | None:
    """A built-in model is served under its built-in name; a file under its file name (known once loaded)."""
    if ref is None:
        return DEFAULT_MODEL
    builtin = lookup_builtin(ref) if not ref.endswith(".gguf") else None
    return builtin.name if builtin is not None else None


def _load_embedder(ref: str, name: str | None, quant: str):
    """An embedding model, served as NAME, else under its built-in name, else its directory's or file's name."""
    progress = FetchProgress()
    try:
        return load_embedding_model(ref, name=name, progress=progress, quant=quant)
    finally:
        progress.close()


def _load(ref: str | None, quant: str, selftest: bool = True, ctx: int | None = None, backend: str = "cpu",
          lora=()):
    progress = FetchProgress()
    try:  # ctx past a model's default window switches one with long-context RoPE factors to them (Phi-3)
        return load_model(ref, quant=quant, progress=progress, selftest=selftest, context=ctx, backend=backend,
                          lora=lora, background_compile="tied")
    finally:
        progress.close()


def _note(text: str) -> None:
    print(f"goinfer serve: {text}", file=sys.stderr, flush=True)


def _banner_models(served: list[ServedModel], config: ServerConfig) -> None:
    for s in served:
        m = s.model
        weights = _weight_type(m)
        limit = f"context {s.window}" + (f" of {m.context_length}" if s.window < m.context_length else "")
        lora = "".join(f" + LoRA {a['adapter']} (scale {a['scale']:g})" for a in m.adapters)
        _note(f"model {s.name}: {Path(m.path).name}{lora} ({m.config.arch}, {weights}), quant {m.quant} "
              f"({m.backend.describe()}), {limit}, {_threads(config)} threads, "
              f"{placement_text(m.placement)}")  # last: a fallback's reason may hold commas
    if not served:
        return  # embeddings only: no generation, no warm sessions
    if config.kv_sessions > 0:
        budget = session_budget_bytes(config)
        kept = f", written to {config.session_dir}" if config.session_dir else ""
        _note(f"prompt-prefix reuse: up to {config.kv_sessions} warm sessions per model in {_size(budget)} of "
              f"KV{kept}")
    else:
        _note("prompt-prefix reuse: off (--kv-sessions 0)")
    spec = config.speculation
    _note(f"speculative decoding: prompt lookup, drafts of up to {spec.draft_max} tokens (the same replies; "
          "--speculate off to decode one token a step)" if spec else "speculative decoding: off")


def _banner_limits(server: Server, config: ServerConfig) -> None:
    _note(f"limits: request body {_size(server.body_cap)}, {config.max_concurrent} sequences at once and "
          f"queue {config.max_queue} per model, prompt chunks of {config.prefill_chunk}, "
          f"{config.max_connections} connections, {config.read_deadline_s:g} s to send a request, "
          f"SSE keep-alive after {config.keepalive_s:g} s of silence")
    if config.api_keys:
        _note("auth: API key required on every route (Authorization: Bearer KEY or x-api-key: KEY)")
    else:
        _note("warning: no API key set: any program on this machine (a web page in a browser included) "
              "can use this server; set --api-key or GOINFER_API_KEY")
    if not config.loopback and not config.tls:
        _note("warning: serving a non-loopback address without TLS: the key and every prompt travel in clear "
              "text; use --tls-cert/--tls-key or a TLS proxy")


def _weight_type(m) -> str:
    try:
        return m.weights.tensor("blk.0.attn_q").ggml_type.name
    except Exception:  # a family without that tensor name: the banner just says less
        return "weights"


def _threads(config: ServerConfig) -> int:
    return get_threads()


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


def _run_until_signal(server: Server, loader: _Loader) -> None:
    """Listen at once, load the models meanwhile (/health: 503 "loading", then 200), serve until SIGINT or
    SIGTERM; then stop cleanly (exit 0), mid-load too. A second signal quits at once. A model that fails to load
    ends the command with its one-line error."""
    stop = threading.Event()
    received: list[str] = []

    def handle(signum, frame) -> None:
        if stop.is_set():
            _note("second signal: quitting at once")
            os._exit(130)
        received.append(signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        _note(f"listening on {server.url} (OpenAI base URL {server.url}/v1); loading the models (/health answers "
              "503 until they can answer); Ctrl-C stops")
        loader.start()
        while not stop.wait(0.2):
            if loader.error is not None:
                break
        if loader.error is not None and not stop.is_set():
            server.stop("the models could not be loaded")
            stop_running()
            with user_errors():
                raise loader.error
        _note(f"{received[0]}: shutting down")
        in_flight = server.stop()
        stop_running()  # a decode step still compiling for this server ends with it
        _note(f"stopped ({in_flight} requests in flight were cancelled)" if in_flight else "stopped")
        if not loader.done.is_set():  # mid-load (a compile holds that thread): leave without waiting for it
            sys.stderr.flush()
            os._exit(0)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
