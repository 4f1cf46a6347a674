"""Wire formats: pure functions from request JSON to engine requests, and from results to response JSON.

openai.py: /v1/chat/completions and /v1/completions bodies and objects (used by batch and serve).
"""

from engine.api.openai import (CHAT_URL, COMPLETIONS_URL, chat_completion, error_body, error_code,
                               parse_chat_request, parse_completion_request, parse_request, run_request,
                               text_completion)

__all__ = ["CHAT_URL", "COMPLETIONS_URL", "chat_completion", "error_body", "error_code", "parse_chat_request",
           "parse_completion_request", "parse_request", "run_request", "text_completion"]
