"""Wire formats: pure functions from request JSON to engine requests, and from results to response JSON.

openai.py: /v1/chat/completions and /v1/completions bodies and objects (used by batch and serve).
sse.py: the same objects cut into server-sent events for streaming.
"""

from engine.api.openai import (CHAT_URL, COMPLETIONS_URL, chat_completion, error_body, error_code, error_object,
                               error_status, parse_chat_request, parse_completion_request, parse_request,
                               response_object, run_request, text_completion)

__all__ = ["CHAT_URL", "COMPLETIONS_URL", "chat_completion", "error_body", "error_code", "error_object",
           "error_status", "parse_chat_request", "parse_completion_request", "parse_request", "response_object",
           "run_request", "text_completion"]
