"""Thinking (reasoning) replies: what a chat template does with thinking, read by rendering it (template.py),
a reply split into reasoning and answer as it streams, with the budget that leaves room to answer (stream.py),
and gpt-oss's Harmony channels (harmony.py). A request's thinking fields are read by engine/api/
thinking_controls.py."""
