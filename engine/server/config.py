"""Server settings, checked before any model is loaded: address, auth, TLS, limits; and the served models."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import GoinferError
from engine.models.base import Model
from engine.models.base import PREFILL_CHUNK
from engine.thinking.plan import ThinkingSettings
from engine.requests.request import context_window
from engine.kernels.backend import PROMPT_TILE
from engine.server.cors import parse_origins
from engine.server.guard import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_DEADLINE_S
from engine.server.intake import LOOPBACK_NAMES
from engine.running.scheduler import DEFAULT_MAX_CONCURRENT
from engine.sessions.pool import DEFAULT_SESSIONS
from engine.generation.speculation import Speculation

DEFAULT_ADDR = "127.0.0.1:8080"
DEFAULT_CTX = 4096
DEFAULT_MAX_QUEUE = 8
DEFAULT_KEEPALIVE_S = 15.0
MIN_BODY_CAP = 4 << 20  # 4 MiB
EMBEDDINGS_BODY_CAP = 64 << 20  # 64 MiB
# A prompt token costs at most a few bytes of text; JSON escapes (\uXXXX) and message overhead stay well
# under this. A body bigger than this many bytes per token of the window could never fit it.
BODY_BYTES_PER_TOKEN = 32


class ServerConfigError(GoinferError):
    """The server cannot start with these settings (address, key, TLS files, limits)."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    api_key_file: Path | None = None  # --api-key-file: more keys, one a line (read by check())
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_queue: int = DEFAULT_MAX_QUEUE  # requests that may wait per model behind those running
    max_concurrent: int = DEFAULT_MAX_CONCURRENT  # sequences per model decoded together
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens evaluated between two decode steps
    max_body_bytes: int = 0  # 0: derived from the largest context window (body_cap)
    keepalive_s: float = DEFAULT_KEEPALIVE_S  # SSE comment after this long without an event
    threads: int | None = None  # compute threads per model (None: numba's default)
    kv_sessions: int = DEFAULT_SESSIONS  # warm sessions kept per model for prompt-prefix reuse (0: none)
    session_memory_mib: int | None = None  # their KV memory per model (None: sessions.default_budget_bytes)
    session_dir: Path | None = None  # where warm sessions are written at eviction and shutdown, read at start
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections; beyond, 503 with Retry-After
    read_deadline_s: float = DEFAULT_READ_DEADLINE_S  # for a request's headers and body, from the connection's
    # start or its last answer
    thinking: ThinkingSettings = ThinkingSettings()  # --thinking and --reasoning-budget (engine/thinking/plan.py)
    decisions_template: str = "chat-v1"  # how /v1/systemone shows a question (engine/decisions/prompts.py)
    # per served model, per kind: fitted temperatures (--decisions-calibration; engine/decisions/calibration.py)
    decisions_temperatures: dict = field(default_factory=dict)
    cors_origins: tuple[str, ...] = ()  # --cors-origin: web pages besides this machine's that may read answers
    batch_dir: Path | None = None  # --batch-dir: uploaded files and batches kept (None: a temporary directory)
    ctx: int = DEFAULT_CTX  # --ctx: the window of a model loaded at runtime without its own
    allow_admin: bool = False  # --allow-admin: /admin/models load and unload models at runtime (needs a key)
    unload_drain_s: float = 5.0  # --unload-drain-wait: how long an unload lets running requests finish
    web: bool = True  # the built-in chat page at / (--no-web: off)
    # --speculate / --draft-max: drafts by prompt lookup checked several a step (generation/speculation.py); None: off
    speculation: Speculation | None = field(default_factory=Speculation)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every key a request may carry: --api-key's and --api-key-file's (one a line; blank and # lines skipped)."""
        keys = [self.api_key] if self.api_key else []
        if self.api_key_file is not None:
            text = Path(self.api_key_file).read_text(encoding="utf-8")
            keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        return tuple(keys)

    @property
    def allowed_hosts(self) -> frozenset[str] | None:
        """The Host names a request may carry: loopback names when bound to loopback without a key (intake.
        check_host says why); None (any) otherwise."""
        if not self.loopback or self.api_keys:
            return None
        return LOOPBACK_NAMES | {self.host.lower().strip("[]")}

    def check(self) -> None:
        """Refuse settings that cannot work or are unsafe, before anything heavy happens."""
        if self.api_key is not None and not self.api_key.strip():
            raise ServerConfigError("the API key is empty")
        if self.api_key_file is not None:
            try:
                keys = self.api_keys
            except (OSError, UnicodeDecodeError) as e:
                raise ServerConfigError(f"--api-key-file {self.api_key_file}: cannot read it: "
                                        f"{getattr(e, 'strerror', None) or e}") from None
            if len(keys) == (1 if self.api_key else 0):
                raise ServerConfigError(f"--api-key-file {self.api_key_file}: no key in it (one a line)")
        if self.allow_admin and not self.api_keys:
            raise ServerConfigError("--allow-admin needs an API key (--api-key or --api-key-file): a request that "
                                    "loads a model reads the disk and takes the memory")
        if self.unload_drain_s < 0:
            raise ServerConfigError(f"--unload-drain-wait must be >= 0, got {self.unload_drain_s}")
        if not self.loopback and not self.api_keys:
            raise ServerConfigError(f"--addr {self.host}: a non-loopback address needs an API key "
                                    "(--api-key KEY, GOINFER_API_KEY or --api-key-file); without one any machine "
                                    "that can reach this port could use the server")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ServerConfigError("--tls-cert and --tls-key go together: give both or neither")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise ServerConfigError(f"{flag} {path}: no such file")
        if self.max_queue < 0:
            raise ServerConfigError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_concurrent < 1:
            raise ServerConfigError(f"--max-concurrent must be >= 1, got {self.max_concurrent}")
        if self.prefill_chunk < 1 or self.prefill_chunk % PROMPT_TILE:
            raise ServerConfigError(f"--prefill-chunk must be a positive multiple of {PROMPT_TILE} (a prompt's "
                                    f"chunks end on its tiles, so a reused prefix continues exactly), "
                                    f"got {self.prefill_chunk}")
        if self.max_connections < 1:
            raise ServerConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        if not self.read_deadline_s > 0:
            raise ServerConfigError(f"--read-deadline must be > 0, got {self.read_deadline_s}")
        if self.kv_sessions < 0:
            raise ServerConfigError(f"--kv-sessions must be >= 0, got {self.kv_sessions}")
        if self.session_memory_mib is not None and self.session_memory_mib < 0:
            raise ServerConfigError(f"--session-memory must be >= 0, got {self.session_memory_mib}")
        if self.session_dir is not None and Path(self.session_dir).exists() and not Path(self.session_dir).is_dir():
            raise ServerConfigError(f"--session-dir {self.session_dir}: not a directory")
        if self.batch_dir is not None and Path(self.batch_dir).exists() and not Path(self.batch_dir).is_dir():
            raise ServerConfigError(f"--batch-dir {self.batch_dir}: not a directory")
        if self.max_body_bytes < 0:
            raise ServerConfigError(f"--max-body-bytes must be >= 0, got {self.max_body_bytes}")
        if self.keepalive_s <= 0:
            raise ServerConfigError(f"--sse-keepalive must be > 0, got {self.keepalive_s}")
        if self.threads is not None and self.threads < 1:
            raise ServerConfigError(f"--threads must be >= 1, got {self.threads}")
        try:
            self.cors_origins = parse_origins(self.cors_origins)
        except ValueError as e:
            raise ServerConfigError(str(e)) from None


@dataclass
class ServedModel:
    """A loaded model under the name requests route on."""

    name: str
    model: Model
    window: int  # the context window requests are held to (--ctx, or the model's own maximum if smaller)
    created: int = field(default=0)  # for /v1/models: the model file's modification time

    @classmethod
    def of(cls, name: str, model: Model, ctx: int | None) -> ServedModel:
        try:
            created = int(os.stat(model.path).st_mtime)
        except OSError:
            created = 0
        return cls(name, model, context_window(model, ctx), created)


def body_cap(config: ServerConfig, models: list[ServedModel]) -> int:
    """The request-body limit: --max-body-bytes, or derived from the largest context window (>= 4 MiB)."""
    return body_cap_for(config, max((m.window for m in models), default=0))


def body_cap_for(config: ServerConfig, window: int) -> int:
    """The request-body limit for a largest context window of `window` tokens (before the models have loaded:
    --ctx, which their windows are held to)."""
    if config.max_body_bytes:
        return config.max_body_bytes
    return max(MIN_BODY_CAP, BODY_BYTES_PER_TOKEN * window)


def embeddings_body_cap(config: ServerConfig) -> int:
    """/v1/embeddings' limit: --max-body-bytes, else its own 64 MiB, whatever the decoders' windows (2,048 inputs
    of a few KiB each, a RAG ingestion's batch, are past the 4 MiB a small decoder's window derives)."""
    return config.max_body_bytes or EMBEDDINGS_BODY_CAP


def parse_addr(text: str) -> tuple[str, int]:
    """HOST:PORT, [IPV6]:PORT, or a bare PORT (on 127.0.0.1) -> (host, port)."""
    text = text.strip()
    if text.isdigit():
        host, port = "127.0.0.1", text
    elif text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ServerConfigError(f"--addr {text}: expected [IPV6]:PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ServerConfigError(f"--addr {text}: expected HOST:PORT (e.g. 127.0.0.1:8080)")
        if ":" in host:
            raise ServerConfigError(f"--addr {text}: write an IPv6 address as [ADDR]:PORT")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ServerConfigError(f"--addr {text}: the port must be a number in [0, 65535]")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def parse_model_spec(spec: str) -> tuple[str | None, str]:
    """`--model [NAME=]REF` -> (NAME or None, REF). A path that itself holds '=' is written with a
    directory part (./a=b.gguf), which is never taken for a name."""
    name, sep, ref = spec.partition("=")
    if sep and name and ref and "/" not in name and "\\" not in name:
        return name, ref
    return None, spec


MODEL_OPTIONS = ("ctx", "quant", "backend", "lora", "lora-scale")  # what `--model REF,KEY=VALUE` may set for that model alone


def split_model_options(ref: str | None) -> tuple[str | None, dict[str, str]]:
    """`REF[,ctx=N][,quant=Q][,backend=B][,lora=DIR][,lora-scale=S]` -> (REF, {key: value}): the serve flags of the same names, for this model
    only. Only trailing `,key=value` parts with those keys are options; a path with a comma keeps it. A key given
    twice, or an empty value, is a ServerConfigError."""
    if ref is None:
        return None, {}
    parts, options = ref.split(","), {}
    while len(parts) > 1:
        key, sep, value = parts[-1].partition("=")
        if not sep or key.strip() not in MODEL_OPTIONS:
            break
        key = key.strip()
        if key in options or not value.strip():
            raise ServerConfigError(f"--model {ref}: {key}= is given twice or empty")
        options[key] = value.strip()
        parts.pop()
    return ",".join(parts), options
