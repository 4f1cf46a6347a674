"""GET /metrics: what /health reports, in Prometheus' text exposition format (version 0.0.4), for a scraper.

Every generation model's figures carry its name as the `model` label. Counters end in `_total`; the rest are
gauges of the moment.
"""

from __future__ import annotations

from engine.server.routes import Route

__all__ = ["CONTENT_TYPE", "ROUTES", "prometheus_text"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# /health's per-model field -> (metric name, kind, help)
_MODEL_METRICS = {
    "completed": ("goinfer_requests_completed_total", "counter", "Requests answered in full."),
    "cancelled": ("goinfer_requests_cancelled_total", "counter", "Requests cancelled (client gone, shutdown)."),
    "failed": ("goinfer_requests_failed_total", "counter", "Requests that failed while running."),
    "rejected": ("goinfer_requests_rejected_total", "counter", "Requests refused with 429 (queue full)."),
    "running_requests": ("goinfer_requests_running", "gauge", "Requests being generated now."),
    "queued": ("goinfer_requests_queued", "gauge", "Requests waiting for a sequence slot."),
    "running_sequences": ("goinfer_sequences_running", "gauge", "Sequences decoded together now."),
    "decode_steps": ("goinfer_decode_steps_total", "counter", "Decode steps run (one token per sequence each)."),
    "decoded_tokens": ("goinfer_decoded_tokens_total", "counter",
                       "Sequences advanced by decode steps (/ decode steps: the mean batch)."),
    "draft_tokens": ("goinfer_draft_tokens_total", "counter", "Draft tokens checked (speculative decoding)."),
    "draft_accepted_tokens": ("goinfer_draft_accepted_tokens_total", "counter",
                              "Draft tokens that were the reply's own (tokens gained over one a step)."),
    "kv_bytes": ("goinfer_kv_cache_bytes", "gauge", "KV-cache memory the running sequences hold."),
    "sessions": ("goinfer_sessions", "gauge", "Warm sessions kept for prompt-prefix reuse."),
    "session_bytes": ("goinfer_session_bytes", "gauge", "KV memory the warm sessions hold."),
    "reuse_hits": ("goinfer_prefix_reuse_hits_total", "counter", "Prompts that started from a warm session."),
    "reused_tokens": ("goinfer_prefix_reused_tokens_total", "counter", "Prompt tokens not evaluated again."),
    "sessions_evicted": ("goinfer_sessions_evicted_total", "counter", "Warm sessions let go for room."),
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(health: dict) -> str:
    lines = ["# HELP goinfer_up 1 while serving, 0 while shutting down.", "# TYPE goinfer_up gauge",
             f"goinfer_up {int(health['status'] == 'ok')}",
             "# HELP goinfer_uptime_seconds Seconds since the server started.", "# TYPE goinfer_uptime_seconds gauge",
             f"goinfer_uptime_seconds {health['uptime_s']}"]
    open_connections = health["limits"].get("open_connections")
    if open_connections is not None:
        lines += ["# HELP goinfer_connections_open Open client connections.",
                  "# TYPE goinfer_connections_open gauge", f"goinfer_connections_open {open_connections}"]
    for field, (name, kind, help_) in _MODEL_METRICS.items():
        samples = [(m["name"], m[field]) for m in health["models"] if isinstance(m.get(field), (int, float))]
        if not samples:
            continue
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{model="{_label(model)}"}} {value}' for model, value in samples]
    return "\n".join(lines) + "\n"


def metrics(ex) -> None:
    ex.send_body(200, prometheus_text(ex.state.health()).encode(), CONTENT_TYPE)


ROUTES = (Route("GET", "/metrics", metrics),)
