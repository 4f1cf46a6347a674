"""`goinfer serve`'s HTTP transport: routing, auth, body limits, a scheduler per model (running/scheduler.py),
SSE streaming, shutdown.

Standard library only (http.server, threaded; ssl for HTTPS). What requests mean and what responses
hold comes from engine.api (the same code `goinfer batch` runs); this package moves bytes and schedules.

    Server(models, config).start() / .stop()
    ServedModel.of(name, model, ctx)
    ServerConfig(host, port, api_key, tls_cert, tls_key, max_queue, max_concurrent, prefill_chunk, ...)
"""

from engine.server.config import (DEFAULT_ADDR, DEFAULT_CTX, DEFAULT_KEEPALIVE_S, DEFAULT_MAX_QUEUE, ServedModel,
                                  ServerConfig, ServerConfigError, body_cap, is_loopback, parse_addr,
                                  parse_model_spec, split_model_options)
from engine.server.server import Server

__all__ = ["DEFAULT_ADDR", "DEFAULT_CTX", "DEFAULT_KEEPALIVE_S", "DEFAULT_MAX_QUEUE", "ServedModel", "Server",
           "ServerConfig", "ServerConfigError", "body_cap", "is_loopback", "parse_addr", "parse_model_spec",
           "split_model_options"]
