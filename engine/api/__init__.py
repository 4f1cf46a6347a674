"""Wire formats: pure functions from request JSON to engine requests, and from results to response JSON.

fields.py: the field validators every format shares. openai.py: /v1/chat/completions and /v1/completions
bodies; openai_objects.py: their answers, /v1/models entries, error objects; sse.py: server-sent events (the
OpenAI chunks, and the named-event writer). anthropic.py: /v1/messages; responses.py: /v1/responses.
dialects.py: one Dialect per format, what the server routes a path to.
"""
