"""llama.cpp's native wire format: POST /completion (its body, its answer and stream), the `timings` object its
clients read (also on the OpenAI routes' answers), and what GET /props and GET /slots say.

    timings_object(t, cached)       {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms",
                                     "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_token_ms",
                                     "predicted_per_second"}
    LlamaCppCompletion              the dialect of /completion: its body is a completions body with llama.cpp's
                                    fields (llamacpp_fields.py), `model` optional; the answer
                                    {"index", "content", "tokens", "id_slot", "stop": true, "model",
                                    "tokens_predicted", "tokens_evaluated", "tokens_cached", "stop_type",
                                    "stopping_word", "has_new_line", "truncated", "timings"}, "tokens" the
                                    generated ids with return_tokens, "completion_probabilities" with n_probs;
                                    the stream: one `data:` event per token ({"index", "content", "tokens": [its
                                    id], "stop": false, ...}), the last the whole answer with "content": "",
                                    "tokens": [] and "stop": true; no [DONE] (llama.cpp sends none here).
"""

from __future__ import annotations

from typing import Any, Callable

from engine.api import sse
from engine.api.openai import parse_completion_request
from engine.api.openai_objects import llamacpp_probabilities, new_id
from engine.requests.request import Collector, Completion, Delta, GenerationRequest, Timings

__all__ = ["COMPLETION_URL", "LlamaCppCompletion", "props_object", "slots_object", "timings_object"]

COMPLETION_URL = "/completion"


def timings_object(t: Timings, cached: int = 0) -> dict:
    """llama.cpp's `timings` (milliseconds; its web UI shows tokens/s from them)."""
    def rate(n: int, s: float) -> dict:
        return {"ms": s * 1e3, "per_token_ms": s * 1e3 / n if n else 0.0, "per_second": n / s if s > 0 else 0.0}

    p, g = rate(t.prompt_tokens, t.prompt_s), rate(t.generated, t.generate_s)
    return {"cache_n": cached, "prompt_n": t.prompt_tokens, "prompt_ms": p["ms"],
            "prompt_per_token_ms": p["per_token_ms"], "prompt_per_second": p["per_second"],
            "predicted_n": t.generated, "predicted_ms": g["ms"], "predicted_per_token_ms": g["per_token_ms"],
            "predicted_per_second": g["per_second"]}


def _stop_type(finish_reason: str, stop_sequence: str | None) -> str:
    if finish_reason == "length":
        return "limit"
    return "word" if stop_sequence else "eos"


class LlamaCppCompletion:
    """POST /completion: llama.cpp's own completion route (one answer; its errors in OpenAI's shape, as
    llama-server sends them)."""

    counts_tokens = False
    media_type = "text/event-stream; charset=utf-8"

    def keepalive(self) -> bytes:
        return sse.comment()

    def parse(self, body: Any) -> GenerationRequest:
        if isinstance(body, dict) and body.get("stream") is None:
            body = {**body, "stream": False}
        return parse_completion_request(body)

    def new_id(self, req: GenerationRequest) -> str:
        return new_id(req.kind)

    def answer(self, req, result: Completion, *, job_id, model_name, created, timings=None) -> dict:
        choice = result.choices[0]
        t = timings or Timings(0.0, 0.0, 0.0, 0.0, result.prompt_tokens, result.completion_tokens)
        obj = {"index": 0, "content": choice.text, "tokens": list(choice.tokens or []) if req.return_tokens else [],
               "id_slot": 0, "stop": True, "model": model_name, "tokens_predicted": choice.completion_tokens,
               "tokens_evaluated": result.prompt_tokens, "tokens_cached": result.cached_tokens,
               "stop_type": _stop_type(choice.finish_reason, choice.stop_sequence),
               "stopping_word": choice.stop_sequence or "", "has_new_line": "\n" in choice.text, "truncated": False,
               "timings": timings_object(t, result.cached_tokens)}
        if req.logprobs and choice.logprobs:
            obj["completion_probabilities"] = llamacpp_probabilities(choice.logprobs, req.post_sampling_probs)
        return obj

    def stream(self, req, *, job_id, model_name, created, prompt_tokens, cached_tokens=lambda: 0,
               timings: Callable[[], Timings] | None = None) -> _CompletionStream:
        return _CompletionStream(self, req, model_name, prompt_tokens, cached_tokens, timings)

    def error(self, status: int, body: dict) -> tuple[int, dict]:
        return status, body

    def count(self, n: int) -> dict:
        raise NotImplementedError("this route generates; it does not count tokens")


class _CompletionStream:
    def __init__(self, dialect, req, model: str, prompt_tokens: int, cached: Callable[[], int],
                 timings: Callable[[], Timings] | None):
        self.dialect, self.req, self.model = dialect, req, model
        self.prompt_tokens, self.cached, self.timings = prompt_tokens, cached, timings
        self.generated = 0
        self.last: Delta | None = None

    def start(self) -> bytes:
        return b""

    def piece(self, d: Delta) -> bytes:
        if d.index != 0:
            return b""
        self.generated += d.new_tokens
        self.last = d
        if not d.text and not d.logprobs and not self.req.return_tokens:
            return b""
        obj = {"index": 0, "content": d.text, "tokens": [] if d.token is None else [d.token], "stop": False,
               "id_slot": 0, "tokens_predicted": self.generated, "tokens_evaluated": self.prompt_tokens}
        if d.logprobs:
            obj["completion_probabilities"] = llamacpp_probabilities(d.logprobs, self.req.post_sampling_probs)
        if self.req.timings_per_token and self.timings is not None:
            obj["timings"] = timings_object(self.timings(), self.cached())
        return sse.event(obj)

    def finish(self, out: Collector) -> bytes:
        result = out.result()
        final = self.dialect.answer(self.req, result, job_id="", model_name=self.model, created=0,
                                    timings=self.timings() if self.timings is not None else None)
        final.pop("completion_probabilities", None)  # each token's went with it
        return sse.event({**final, "content": "", "tokens": []})

    def error(self, status: int, body: dict) -> bytes:
        return sse.event(body)


def _params(window: int) -> dict:
    """The generation settings a request that states none gets (the OpenAI defaults goinfer applies)."""
    return {"n_predict": -1, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
            "repeat_penalty": 1.0, "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0, "dynatemp_range": 0.0,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"], "n_ctx": window, "stream": False}


def props_object(name: str, model, window: int, slots: int, version: str) -> dict:
    """GET /props: what llama.cpp's web UI and clients read of the server (one model's)."""
    template = model.template.source if model.template is not None else ""
    tok = model.tokenizer
    token = (lambda i: tok.id_to_token(i) if i is not None else "")  # noqa: E731
    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": window, "speculative": False,
                                            "is_processing": False, "params": _params(window)},
            "total_slots": slots, "model_alias": name, "model_path": str(model.path), "chat_template": template,
            "bos_token": token(tok.bos_id), "eos_token": token(tok.eos_id),
            "modalities": {"vision": False, "audio": False}, "build_info": f"goinfer {version}"}


def slots_object(window: int, slots: int, busy: int) -> list[dict]:
    """GET /slots (read-only): goinfer has no slots to pick, but its scheduler runs `slots` sequences at once;
    the first `busy` show as processing."""
    return [{"id": i, "id_task": -1, "n_ctx": window, "speculative": False, "is_processing": i < busy,
             "params": _params(window)} for i in range(slots)]
