"""Engine requests: what a client asks for, independent of any wire format, and running one on a model.

Wire layers (engine/api/openai.py; later anthropic.py, responses.py) translate JSON into a
`GenerationRequest`; `execute` runs it and returns a `Completion` they translate back. Serve and batch
both go through here, so a request means the same thing on every route.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Sequence

from engine.errors import Cancelled, RequestError
from engine.generate import generate, top_logprobs_of
from engine.models.base import Model
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
    logit_bias: dict[int, float] | None = field(default=None, hash=False)

    def fill(self, other: SamplingOptions) -> SamplingOptions:
        """These options, with every unset field taken from `other`."""
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(self) if getattr(self, f.name) is None})


# What an OpenAI-style API does when a request states nothing (seed stays None: a random seed).
# max_tokens is further bounded by what the context window leaves after the prompt.
API_DEFAULTS = SamplingOptions(max_tokens=512, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, stop=(),
                               presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={})


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a chat (`messages`) or a plain completion (`prompt`), never both."""

    messages: tuple[dict, ...] | None = None  # chat: {"role", "content": str} each, roles system/user/assistant
    prompt: str | tuple[int, ...] | None = None  # completion: text, or token ids used as they are
    options: SamplingOptions = SamplingOptions()
    logprobs: bool = False  # report the log-probability of each generated token
    top_logprobs: int = 0  # ... and the k most likely alternatives at each step
    echo: bool = False  # completion: the prompt is part of the returned text (and of the logprobs)
    stream: bool = False  # a transport matter (SSE); execute ignores it
    model: str | None = None  # the model the client named (routing); execute ignores it

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "completion"


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
class Completion:
    """The result of one request, before any wire format."""

    text: str  # what the user sees (with echo: the prompt text first)
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int  # every generated token, an end-of-generation token included
    logprobs: list[TokenLogprob] | None = None  # echoed prompt tokens, then generated ones (EOG excluded)


def encode_prompt(model: Model, text: str) -> list[int]:
    """Token ids of a rendered prompt. A template that writes the BOS text itself must not get a second
    BOS from the tokenizer."""
    tok = model.tokenizer
    bos_text = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
    starts_with_bos = bool(bos_text) and text.startswith(bos_text)
    return tok.encode(text, add_bos=False if starts_with_bos else None)


def prompt_ids(model: Model, req: GenerationRequest) -> list[int]:
    if req.messages is not None:
        return encode_prompt(model, model.render_chat(list(req.messages), add_generation_prompt=True))
    if isinstance(req.prompt, str):
        return encode_prompt(model, req.prompt)
    ids = [int(t) for t in req.prompt or ()]
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise RequestError(f"prompt: token id {bad[0]} is outside the vocabulary of {model.vocab_size}", "prompt")
    return ids


def execute(model: Model, req: GenerationRequest, *, should_stop: Callable[[], bool] | None = None,
            on_token: Callable[[int], None] | None = None) -> Completion:
    """Run one request to the end. `should_stop` is polled between tokens (True raises Cancelled);
    `on_token(n)` is told how many tokens have been generated so far."""
    opts = req.options.fill(API_DEFAULTS)
    ids = prompt_ids(model, req)
    tok = model.tokenizer
    want_top = req.top_logprobs if req.logprobs else 0
    events = generate(model, ids, max_tokens=opts.max_tokens, temperature=opts.temperature, seed=opts.seed,
                      stop=list(opts.stop), top_k=opts.top_k, top_p=opts.top_p, min_p=opts.min_p,
                      repetition_penalty=opts.repetition_penalty, presence_penalty=opts.presence_penalty,
                      frequency_penalty=opts.frequency_penalty, logit_bias=opts.logit_bias,
                      top_logprobs=want_top)
    head = ""
    if req.echo:
        head = req.prompt if isinstance(req.prompt, str) else tok.decode(ids, skip_special=True)
    logprobs = _prompt_logprobs(model, ids, want_top) if req.logprobs and req.echo else None
    parts: list[str] = []
    generated = []
    finish = "length"
    for n, ev in enumerate(events, 1):
        if should_stop is not None and should_stop():
            raise Cancelled("the request was cancelled")
        parts.append(ev.text)
        generated.append(ev)
        finish = ev.finish_reason or finish
        if on_token is not None:
            on_token(n)
    if req.logprobs:
        logprobs = (logprobs or []) + _generated_logprobs(tok, generated, len(head))
    return Completion(text=head + "".join(parts), finish_reason=finish, prompt_tokens=len(ids),
                      completion_tokens=len(generated), logprobs=logprobs)


def _generated_logprobs(tok, events: Sequence, base: int) -> list[TokenLogprob]:
    # An end-of-generation token adds no text, so it is left out (as the OpenAI API leaves it out).
    decoder = IncrementalDecoder(tok, skip_special=True)
    out, offset = [], base
    for ev in events:
        if ev.finish_reason == "stop" and ev.token in tok.eog_ids:
            break
        top = [(t, tok.piece_bytes(t), lp) for t, lp in (ev.top_logprobs or [])]
        out.append(TokenLogprob(ev.token, tok.piece_bytes(ev.token), ev.logprob, top, offset))
        offset += len(decoder.push(ev.token))
    return out


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
