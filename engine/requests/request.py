"""Engine requests: what a client asks for, independent of any wire format, and running one on a model.

Wire layers (engine/api/: openai.py, anthropic.py, responses.py) translate JSON into a
`GenerationRequest`; `execute` runs it and returns a `Completion` they translate back. Serve and batch
both go through here, so a request means the same thing on every route.

    prepare(model, req, window=...) -> Prepared     every refusal a request can earn, before any work
    run(model, prepared) -> iterator of Delta       the pieces a stream sends, choice after choice
    execute(model, req) -> Completion               prepare + run + Collector: the whole answer
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterator

from engine.constrain.confidence import ConfidenceGrammar, field_confidences
from engine.constrain.grammar import Grammar, GrammarProcessor, grammar_processor
from engine.errors import Cancelled, ContextOverflow, RequestError
from engine.generation.generate import Generation, TokenEvent, continue_from, top_logprobs_of
from engine.generation.sampling import ChainSettings, SamplingParams
from engine.models.base import Model
from engine.requests.prompts import encode_prompt, message_starts, prompt_ids, render_request, thinking_plan
from engine.thinking.plan import ThinkingSettings
from engine.generation.speculation import Speculation
from engine.templates.tools import ToolCall, asks_hermes_json, parse_tool_calls, template_supports_tools
from engine.tokenizer import IncrementalDecoder


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling settings as a request states them; None means "not stated", so layers can be merged
    (request body, then a runner's flags, then the API defaults) with `fill`."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    penalty_last_n: int | None = None
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    chain: ChainSettings | None = None  # llama.cpp's other samplers (engine/generation/sampler_chain.py)

    def fill(self, other: SamplingOptions) -> SamplingOptions:
        """These options, with every unset field taken from `other`."""
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(self) if getattr(self, f.name) is None})

    def to_sampling_params(self) -> SamplingParams:
        """The sampler's settings these options come to, the API defaults for what they leave unset: the one way
        a request's sampling settings become the SamplingParams its sequences are built with (the server's, a batch's
        and `goinfer chat`'s alike). Merge the layers first (apply_defaults: the body, then a runner's flags)."""
        stated = self.fill(API_DEFAULTS)
        return SamplingParams(**{name: getattr(stated, name) for name in _SAMPLER_FIELDS})

    @classmethod
    def stating(cls, params: SamplingParams, **more) -> SamplingOptions:
        """Options that state every sampler setting of `params` (and `more`)."""
        return cls(**{name: getattr(params, name) for name in _SAMPLER_FIELDS}, **more)


# The settings a request may state that are the sampler's (engine/generation/sampling.py declares them).
_SAMPLER_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name in {g.name for g in fields(SamplingOptions)})

# What an OpenAI-style API does when a request states nothing: temperature 1 and otherwise the sampler's neutral
# settings (seed None: a random seed), no stop strings, and max_tokens 512, further bounded by what the context
# window leaves after the prompt.
API_DEFAULTS = SamplingOptions.stating(SamplingParams(temperature=1.0), max_tokens=512, stop=())


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a chat (`messages`) or a plain completion (`prompt`), never both."""

    messages: tuple[dict, ...] | None = None  # chat: {"role", "content": str} each, roles system/user/assistant
    prompt: str | tuple[int, ...] | None = None  # completion: text, or token ids used as they are
    options: SamplingOptions = SamplingOptions()
    logprobs: bool = False  # report the log-probability of each generated token
    top_logprobs: int = 0  # ... and the k most likely alternatives at each step
    echo: bool = False  # completion: the prompt is part of the returned text (and of the logprobs)
    n: int = 1  # how many answers (choices) to generate for the one prompt
    stream: bool = False  # a transport matter (SSE); execute ignores it
    include_usage: bool = False  # stream: end with a usage chunk (stream_options.include_usage)
    model: str | None = None  # the model the client named (routing); execute ignores it
    # Structured output: every answer is constrained to this grammar (a JSON schema, tool calls).
    grammar: Grammar | None = field(default=None, hash=False)
    # Tools the model may call ({"name", "description", "parameters"} each); None or () = no tools.
    tools: tuple[dict, ...] | None = field(default=None, hash=False)
    tool_choice: str = "auto"  # "none" | "auto" | "required" | "function" (one named tool: tools holds it)
    parallel_tool_calls: bool = True
    # Thinking (engine/thinking/plan.py): "on" / "off" as the request asks (None: the runner's mode), how the reply
    # is split ("auto", "deepseek", "none", "deepseek-legacy"), the request's own reasoning budget, and more
    # variables for the chat template (chat_template_kwargs).
    thinking: str | None = None
    reasoning_format: str | None = None  # None: the runner's (serve --reasoning-format), else auto
    # goinfer_confidence: per-field confidence of a json_schema answer (engine/constrain/confidence.py)
    confidence: bool = False
    thinking_budget: int | None = None
    template_variables: dict | None = field(default=None, hash=False)
    reasoning_effort: str | None = None  # low / medium / high: a Harmony template's Reasoning line (gpt-oss only)
    ignore_eos: bool = False  # llama.cpp's: the end-of-generation tokens are never sampled (max_tokens ends it)
    keepalive_s: float | None = None  # a stream's keep-alive interval (llama.cpp's sse_ping_interval); None: the
    # server's, inf: none
    timings_per_token: bool = False  # llama.cpp's: every streamed chunk carries the timings so far
    return_progress: bool = False  # llama.cpp's: a stream reports the prompt's evaluation as it goes
    return_tokens: bool = False  # llama.cpp's: /completion's answer carries the generated token ids
    post_sampling_probs: bool = False  # llama.cpp's: logprobs are the drawn-from distribution's (after samplers)

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "completion"

    @property
    def calls_tools(self) -> bool:
        """Whether answers are read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> set[str]:
        return {t["name"] for t in self.tools or ()}

    @property
    def tool_schemas(self) -> dict[str, dict]:
        """Each tool's name to its parameters' JSON schema (what types a call's values in Qwen3.5's XML form)."""
        return {t["name"]: t.get("parameters") or {} for t in self.tools or ()}

    @property
    def constrained(self) -> bool:
        """Grammar-constrained from the first token (a JSON format, a forced tool call): rendered thinking-off."""
        if self.grammar is None:
            return False
        return self.grammar.what != "tool_calls" or self.tool_choice in ("required", "function")


def apply_defaults(req: GenerationRequest, options: SamplingOptions | None = None,
                   system: str | None = None) -> GenerationRequest:
    """Fill what a request leaves unset from a runner's settings: sampling options, and a system prompt
    for a chat that has none. The request's own settings always win."""
    if options is not None:
        req = replace(req, options=req.options.fill(options))
    if system and req.messages is not None and not any(m["role"] == "system" for m in req.messages):
        req = replace(req, messages=({"role": "system", "content": system},) + tuple(req.messages))
    return req


@dataclass
class TokenLogprob:
    token: int
    piece: bytes  # what the token renders to (control tokens as their text)
    logprob: float | None  # None for the first prompt token (echo): nothing predicts it
    top: list[tuple[int, bytes, float]]  # the most likely (id, piece, logprob) at this step, best first
    offset: int  # where this token's text starts in the returned text


@dataclass
class Choice:
    """One of a request's n answers."""

    text: str  # what the user sees (with echo: the prompt text first); with tool calls, the text before them
    finish_reason: str  # "stop", "length" or "tool_calls"
    completion_tokens: int  # every generated token, an end-of-generation token included
    logprobs: list[TokenLogprob] | None = None  # echoed prompt tokens, then generated ones (EOG excluded)
    tool_calls: list[ToolCall] | None = None  # the calls the answer makes (requests with tools only)
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    reasoning: str | None = None  # the thinking apart from the answer (None: a reply that is not split)
    reasoning_tokens: int = 0  # of completion_tokens, those inside the thinking block
    tokens: list[int] | None = None  # the generated token ids, in order (an end-of-generation token included)


@dataclass
class Completion:
    """The result of one request, before any wire format."""

    choices: list[Choice]
    prompt_tokens: int  # counted once, however many choices
    cached_tokens: int = 0  # of the prompt tokens, those a warm session held (not evaluated again)
    confidence: list[dict] | None = None  # goinfer_confidence's records (asked for: the request's `confidence`)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    # The first choice, for callers that ask for one (n = 1).
    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.choices[0].logprobs


@dataclass
class Prepared:
    """A request checked against a model and ready to run: everything a request can get wrong (template,
    prompt over the window, bad token ids, bad sampling values) has been raised by `prepare`, before any
    forward pass, so a server can still answer with an error status instead of a broken stream."""

    request: GenerationRequest
    ids: list[int]  # the prompt's token ids
    window: int  # the context window this request is held to
    head: str  # echo: the prompt text that starts every choice
    choices: list[Generation]  # one not yet started sequence per answer; all share the prompt
    tokenizer: object = None  # the model's (goinfer_confidence reads token pieces after the answer)
    cached_tokens: int = 0  # leading prompt tokens a warm session gave (set when the prompt is evaluated)
    # a chat: where its first user message starts, and a recurrent model's its last (engine/sessions/pool.py)
    marks: tuple[int, ...] = ()

    @property
    def cache_tokens(self) -> int:
        """The most positions a choice's cache holds (the same for every choice)."""
        return self.choices[0].cache_tokens

    def echoed(self, model: Model) -> list[TokenLogprob] | None:
        """echo with logprobs: the prompt's own tokens with their log-probabilities (one more pass over it)."""
        req = self.request
        return _prompt_logprobs(model, self.ids, req.top_logprobs) if req.echo and req.logprobs else None


def context_window(model: Model, limit: int | None = None) -> int:
    """The token limit a request is held to: the model's own maximum, or `limit` if smaller."""
    return model.context_length if limit is None else max(1, min(limit, model.context_length))


def prepare(model: Model, req: GenerationRequest, *, window: int | None = None,
            thinking: ThinkingSettings = ThinkingSettings()) -> Prepared:
    """Check `req` against `model` (at most `window` tokens of context) without running it; `thinking`: the
    runner's thinking mode and reasoning budget, for what the request leaves unsaid."""
    opts = req.options.fill(API_DEFAULTS)
    sampling = opts.to_sampling_params()
    if req.ignore_eos:
        banned = {int(t): float("-inf") for t in model.tokenizer.eog_ids}
        sampling = replace(sampling, logit_bias={**sampling.logit_bias, **banned})
    plan, marks = None, ()
    if req.messages is not None:
        prompt = render_request(model, req, thinking)
        ids = encode_prompt(model, prompt.text)
        plan = thinking_plan(model, req, prompt, thinking)
        marks = message_starts(model, prompt.text, req.messages, ids, last=bool(model.config.state_shapes))
    else:
        ids = prompt_ids(model, req)
    if not ids:
        raise RequestError("prompt: is empty (no tokens)", "prompt")
    window = context_window(model, window)
    if len(ids) >= window:
        raise ContextOverflow(f"the prompt has {len(ids)} tokens; the context window is {window}")
    grammar = req.grammar
    if grammar is not None and grammar.what == "tool_calls" and req.tool_choice == "auto" and \
            template_supports_tools(model.template.source) and not asks_hermes_json(model.template.source):
        grammar = None  # the template prompts for a call format of its own: left free, parsed afterwards
    choices = []
    for i in range(req.n):
        # Choice i samples with seed + i: n choices from one seed differ, and each is reproducible.
        seeded = sampling if sampling.seed is None else replace(sampling, seed=(sampling.seed + i) % (1 << 64))
        kind = ConfidenceGrammar if req.confidence else GrammarProcessor
        procs = [grammar_processor(model.tokenizer, grammar, kind)] if grammar is not None else []
        choices.append(Generation(model, ids, opts.max_tokens, window=window, sampling=seeded, stop=list(opts.stop),
                                  top_logprobs=req.top_logprobs if req.logprobs else 0, logprobs=bool(req.logprobs),
                                  processors=procs, thinking=plan, post_sampling=req.post_sampling_probs))
    head = ""
    if req.echo:
        head = req.prompt if isinstance(req.prompt, str) else model.tokenizer.decode(ids, skip_special=True)
    return Prepared(req, ids, window, head, choices, model.tokenizer, marks=marks)


@dataclass(frozen=True)
class Timings:
    """A job's time: waiting in the queue, evaluating its prompt (prompt_tokens: those evaluated, a warm session's
    cached prefix left out), generating (`generated` tokens over all choices); total_s from submission."""

    queued_s: float
    prompt_s: float
    generate_s: float
    total_s: float
    prompt_tokens: int
    generated: int


@dataclass
class Delta:
    """A piece of one choice, as it is generated: what a stream sends, and what a full answer is built from."""

    index: int  # which choice
    text: str
    logprobs: list[TokenLogprob] | None  # the tokens this piece reports (None unless logprobs were asked for)
    finish_reason: str | None  # set on the choice's last piece
    new_tokens: int  # generated tokens in this piece: 1, or 0 for the echoed prompt
    stop_sequence: str | None = None  # on the last piece: the stop string that ended the choice, if one did
    reasoning: str = ""  # thinking text in this piece (a split reply); `text` is the answer's
    thinking: bool = False  # its token was a reasoning token
    token: int | None = None  # the generated token (None: the echoed prompt)


class ChoiceOutput:
    """One choice's pieces from its token events: the echoed prompt first (echo), then a Delta per token, with
    each reported token's offset in the returned text."""

    def __init__(self, model: Model, prep: Prepared, index: int):
        self._tok = model.tokenizer
        self._req = prep.request
        self._head = prep.head
        self._index = index
        self._decoder = IncrementalDecoder(model.tokenizer, skip_special=True)
        self._offset = len(prep.head)

    def echo(self, echoed: list[TokenLogprob] | None) -> Delta:
        return Delta(self._index, self._head, list(echoed) if self._req.logprobs else None, None, 0)

    def piece(self, ev: TokenEvent) -> Delta:
        lps, tok = None, self._tok
        if self._req.logprobs:
            lps = []
            # An end-of-generation token adds no text, so it is left out (as the OpenAI API leaves it out).
            if not (ev.finish_reason == "stop" and ev.token in tok.eog_ids):
                top = [(t, tok.piece_bytes(t), lp) for t, lp in (ev.top_logprobs or [])]
                lps.append(TokenLogprob(ev.token, tok.piece_bytes(ev.token), ev.logprob, top, self._offset))
                self._offset += len(self._decoder.push(ev.token))
        return Delta(self._index, ev.text, lps, ev.finish_reason, 1, ev.stop_sequence, ev.reasoning, ev.thinking,
                     ev.token)


def run(model: Model, prep: Prepared, *, should_stop: Callable[[], bool] | None = None,
        speculation: Speculation | None = None) -> Iterator[Delta]:
    """Run a prepared request here, one sequence at a time: the prompt once, then the choices one after
    another, each as its pieces (echo first). `should_stop` is polled between prompt chunks and tokens; True
    raises Cancelled. `speculation`: drafts checked several a step (engine/generation/speculation.py; the same tokens).
    (engine/running/scheduler.py runs requests side by side; each choice comes out the same.)"""
    def on_chunk(done: int) -> None:
        if should_stop is not None and should_stop():
            raise Cancelled(f"the request was cancelled during the prompt ({done} of {len(prep.ids)} tokens)")

    echoed = prep.echoed(model) if prep.request.echo else None
    prompt = model.new_cache(prep.cache_tokens)
    first = model.prefill(prep.ids, prompt, on_chunk=on_chunk)[0]
    last = len(prep.choices) - 1
    for index, gen in enumerate(prep.choices):
        out = ChoiceOutput(model, prep, index)
        if prep.request.echo:
            yield out.echo(echoed)
        cache = prompt if index == last else prompt.fork()  # the last choice takes the prompt's own cache
        for ev in continue_from(model, gen, cache, first, speculation):
            if should_stop is not None and should_stop():
                raise Cancelled("the request was cancelled")
            yield out.piece(ev)


class Collector:
    """Builds the Completion from a run's pieces (the same pieces a stream sends)."""

    def __init__(self, prep: Prepared):
        self._prep = prep
        self._request = prep.request
        self._prompt_tokens = len(prep.ids)
        n = len(prep.choices)
        self._parts: list[list[str]] = [[] for _ in range(n)]
        self._finish = ["length"] * n
        self._tokens = [0] * n
        self._logprobs = [[] if prep.request.logprobs else None for _ in range(n)]
        self._stops: list[str | None] = [None] * n
        self._reasoning: list[list[str] | None] = [[] if g.splits else None for g in prep.choices]
        self._thought = [0] * n
        self._ids: list[list[int]] = [[] for _ in range(n)]
        self.generated = 0  # tokens over all choices

    def add(self, d: Delta) -> None:
        self._parts[d.index].append(d.text)
        self._tokens[d.index] += d.new_tokens
        self.generated += d.new_tokens
        if d.finish_reason:
            self._finish[d.index] = d.finish_reason
            self._stops[d.index] = d.stop_sequence
        if d.logprobs:
            self._logprobs[d.index].extend(d.logprobs)
        if d.reasoning:
            self._reasoning[d.index].append(d.reasoning)
        self._thought[d.index] += d.thinking
        if d.token is not None:
            self._ids[d.index].append(d.token)

    def result(self) -> Completion:
        choices = [Choice("".join(p), f, n, lp, stop_sequence=st, reasoning=None if r is None else "".join(r),
                          reasoning_tokens=t, tokens=ids) for p, f, n, lp, st, r, t, ids in
                   zip(self._parts, self._finish, self._tokens, self._logprobs, self._stops, self._reasoning,
                       self._thought, self._ids)]
        if self._request.calls_tools:
            for c in choices:
                text, calls = parse_tool_calls(c.text, self._request.tool_schemas)
                if calls:
                    c.text, c.tool_calls = text, calls
                    if c.finish_reason == "stop":
                        c.finish_reason = "tool_calls"
        return Completion(choices, self._prompt_tokens, self.cached_tokens, self.confidence())

    def confidence(self) -> list[dict] | None:
        """goinfer_confidence's records of the (one) answer, when the request asked for them."""
        if not self._request.confidence:
            return None
        recorder = next(p for p in self._prep.choices[0].processors if isinstance(p, ConfidenceGrammar))
        return field_confidences(recorder, self._request.grammar.schema, self._prep.tokenizer)

    @property
    def cached_tokens(self) -> int:
        return self._prep.cached_tokens

    @property
    def reasoning_tokens(self) -> int:
        """Of the tokens generated so far, those inside a thinking block (over all choices)."""
        return sum(self._thought)


def execute(model: Model, req: GenerationRequest, *, should_stop: Callable[[], bool] | None = None,
            on_token: Callable[[int], None] | None = None, window: int | None = None,
            thinking: ThinkingSettings = ThinkingSettings(), speculation: Speculation | None = None) -> Completion:
    """Run one request to the end. `should_stop` is polled between tokens (True raises Cancelled);
    `on_token(n)` is told how many tokens have been generated so far (over all choices)."""
    prep = prepare(model, req, window=window, thinking=thinking)
    out = Collector(prep)
    for d in run(model, prep, should_stop=should_stop, speculation=speculation):
        out.add(d)
        if d.new_tokens and on_token is not None:
            on_token(out.generated)
    return out.result()


def _prompt_logprobs(model: Model, ids: list[int], k: int) -> list[TokenLogprob]:
    """Log-probabilities of the prompt's own tokens (echo): one forward pass over the prompt."""
    tok = model.tokenizer
    rows = model.logprobs(ids, 0) if len(ids) > 1 else None  # (len(ids), vocab); row j predicts ids[j + 1]
    decoder = IncrementalDecoder(tok, skip_special=True)
    out, offset = [], 0
    for j, t in enumerate(ids):
        if j == 0:
            lp, top = None, []
        else:
            row = rows[j - 1]
            lp = float(row[t])
            top = [(i, tok.piece_bytes(i), v) for i, v in top_logprobs_of(row, k)] if k else []
        out.append(TokenLogprob(t, tok.piece_bytes(t), lp, top, offset))
        offset += len(decoder.push(t))
    return out
