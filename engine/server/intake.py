"""Taking a request in: the API key, the body's declared or chunked length against the server's limit, and the
errors that refuse a request before any answer byte is sent (HTTPError) or that end it when the client has gone
(ClientGone)."""

from __future__ import annotations

import hmac

from engine.api.openai_objects import error_object


class HTTPError(Exception):
    """An answer other than 200, decided before any response byte was sent."""

    def __init__(self, status: int, body: dict, headers: dict | None = None):
        """body: the error object in the route's format (OpenAI's and Anthropic's nest the message, Ollama's is
        {"error": "..."})."""
        error = body["error"]
        super().__init__(error["message"] if isinstance(error, dict) else error)
        self.status, self.body, self.headers = status, body, headers or {}


class ClientGone(Exception):
    """The client closed its connection mid-request or mid-answer."""


def check_auth(headers, keys: tuple[str, ...] | str | None) -> None:
    """Refuse (401) a request without one of the server's API keys, when it has any."""
    if not keys:
        return
    keys = (keys,) if isinstance(keys, str) else keys
    given = []
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        given.append(auth[7:].strip())
    if headers.get("x-api-key") is not None:
        given.append(headers["x-api-key"].strip())
    wanted = [k.encode() for k in keys]
    # compare_digest, every pair compared: the time taken does not depend on how much of a key a guess got right
    if not any([hmac.compare_digest(g.encode("utf-8", "replace"), w) for g in given for w in wanted]):
        what = "invalid API key" if given else "missing API key"
        raise HTTPError(401, error_object(f"{what}: send Authorization: Bearer KEY or x-api-key: KEY",
                                          "invalid_request_error", None, "invalid_api_key"),
                        {"WWW-Authenticate": 'Bearer realm="goinfer"'})


MAX_TRAILERS = 100  # as http.client bounds header fields
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def check_host(headers, allowed: frozenset[str] | None) -> None:
    """Refuse (403) a request whose Host names another machine, when the server checks (loopback, no key): a web
    page can make a browser POST to 127.0.0.1 under a name it controls (DNS rebinding), and a keyless loopback
    server would serve it. A request without Host (HTTP/1.0 tools) is not a browser's and passes."""
    if allowed is None:
        return
    host = headers.get("Host")
    if host is None:
        return
    host = host.strip().lower()
    name = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 \
        else host
    if name not in allowed:
        raise HTTPError(403, error_object(f"Host {host!r} is not this server's: a loopback server without an API "
                                          "key answers only to localhost names (set --api-key to serve others)",
                                          "invalid_request_error", None, "host_not_allowed"))


def has_body(headers) -> bool:
    return "chunked" in headers.get("Transfer-Encoding", "").lower() or \
        headers.get("Content-Length", "0").strip() not in ("", "0")


def _too_large(size: str, cap: int) -> HTTPError:
    return HTTPError(413, error_object(f"the request body ({size}) is over the limit of {cap} bytes "
                                       "(--max-body-bytes)", "invalid_request_error", None,
                                       "request_too_large"))


def declared_length(headers, cap: int) -> int | None:
    """The Content-Length, refused (413) over cap before a byte of the body is read; None if not given."""
    value = headers.get("Content-Length")
    if value is None:
        return None
    try:
        n = int(value)
        if n < 0:
            raise ValueError
    except ValueError:
        raise HTTPError(400, error_object(f"invalid Content-Length {value!r}", "invalid_request_error", None,
                                          "invalid_request")) from None
    if n > cap:
        raise _too_large(f"{n} bytes", cap)  # decided before a byte of it is read
    return n


def read_body(headers, rfile, cap: int) -> bytes:
    """The whole body (identity or chunked), refused (413) as soon as it passes cap."""
    te = headers.get("Transfer-Encoding", "").lower()
    if te and te != "identity":
        if te.split(",")[-1].strip() != "chunked":
            raise HTTPError(501, error_object(f"Transfer-Encoding {te!r} is not supported (chunked is)",
                                              "invalid_request_error", None, "invalid_request"))
        return _read_chunked(rfile, cap)
    n = declared_length(headers, cap)
    data = rfile.read(n) if n else b""
    if n and len(data) < n:
        raise ClientGone()
    return data


def _read_chunked(rfile, cap: int) -> bytes:
    """A chunked body, counted as it arrives and refused (413) as soon as it passes the limit."""
    parts, total = [], 0
    while True:
        line = rfile.readline(1024)
        if not line:
            raise ClientGone()
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise HTTPError(400, error_object("malformed chunked request body", "invalid_request_error", None,
                                              "invalid_request")) from None
        if size == 0:
            for _ in range(MAX_TRAILERS + 1):  # trailer fields, ignored, but not without end
                if rfile.readline(65537) in (b"\r\n", b"\n", b""):
                    break
            else:
                raise HTTPError(431, error_object(f"more than {MAX_TRAILERS} chunked trailer fields",
                                                  "invalid_request_error", None, "request_header_fields_too_large"))
            break
        total += size
        if total > cap:
            raise _too_large(f"over {cap} bytes, chunked", cap)
        data = rfile.read(size)
        if len(data) < size:
            raise ClientGone()
        parts.append(data)
        rfile.readline(3)  # the CRLF after the chunk
    return b"".join(parts)


ENCODINGS = ("identity", "gzip", "zstd")


def decoded_body(headers, data: bytes, cap: int) -> bytes:
    """The body as sent, undone from its Content-Encoding (gzip, zstd; the TypeSafe SDK sends zstd), with the size
    limit applied to the decompressed bytes too (a small compressed body must not expand past it)."""
    encoding = headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    if encoding == "identity" or not data:
        return data
    if encoding not in ENCODINGS:
        raise HTTPError(415, error_object(f"Content-Encoding {encoding!r} is not supported (use one of "
                                          f"{', '.join(ENCODINGS)})", "invalid_request_error", None,
                                          "unsupported_content_encoding"))
    if encoding == "gzip":
        import zlib

        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        error: type[Exception] = zlib.error
    else:
        try:
            from compression.zstd import ZstdDecompressor, ZstdError  # Python 3.14+
        except ImportError:
            from backports.zstd import ZstdDecompressor, ZstdError
        d, error = ZstdDecompressor(), ZstdError
    try:
        out = d.decompress(data, cap + 1)
    except error as e:
        raise HTTPError(400, error_object(f"the request body is not valid {encoding} data ({e})",
                                          "invalid_request_error", None, "invalid_content_encoding")) from None
    if len(out) > cap:
        raise _too_large(f"over {cap} bytes once {encoding}-decoded", cap)
    if not d.eof:
        raise HTTPError(400, error_object(f"the request body's {encoding} data ends early", "invalid_request_error",
                                          None, "invalid_content_encoding"))
    return out
