"""Thinking (reasoning) replies: what a chat template does with thinking, read by rendering it (template.py), what
a reply is split by (plan.py: the runner's settings, one reply's plan), the reply split into reasoning and answer
as it streams (stream.py), the budget that leaves room to answer (budget.py), and gpt-oss's Harmony channels
(harmony.py). A request's thinking fields are read by engine/api/thinking_controls.py."""
