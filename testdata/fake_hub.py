"""A fake Hugging Face hub on 127.0.0.1: the routes huggingface_hub and goinfer's pull call.

    GET  /api/models/OWNER/REPO[/revision/REV][?blobs=true]   repo info with siblings (size, lfs.sha256)
    HEAD /OWNER/REPO/resolve/REV/PATH                         file metadata headers (X-Repo-Commit, ETag, ...)
    GET  /OWNER/REPO/resolve/REV/PATH                         the bytes, honouring `Range: bytes=N-[M]`

Switches: a repo may be gated (403 + X-Error-Code: GatedRepo on files, `gated` in its info) or private
(401 + RepoNotFound everywhere); `drop[path] = n` makes the next n downloads of that file stop halfway
and close the connection. `requests` records (method, path, Range header) for assertions.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    private: bool = False
    lfs: set[str] = field(default_factory=set)  # files listed with lfs info (sha256); default: .gguf/.safetensors


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.drop: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._serve(self, head=True)

            def do_GET(self):
                hub._serve(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, files: dict[str, bytes], **kwargs) -> FakeRepo:
        self.repos[repo] = FakeRepo(dict(files), **kwargs)
        return self.repos[repo]

    def file_requests(self, method: str = "GET") -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == method and "/resolve/" in r[1]]

    # --- routing ------------------------------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = self.repos.get("/".join(parts[2:4]))
            if repo is None or repo.private:
                return self._error(h, 401, "RepoNotFound", head)
            return self._info(h, "/".join(parts[2:4]), repo, head)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.repos.get("/".join(parts[:2]))
            if repo is None or repo.private:
                return self._error(h, 401, "RepoNotFound", head)
            if repo.gated:
                return self._error(h, 403, "GatedRepo", head)
            name = "/".join(parts[4:])
            if name not in repo.files:
                return self._error(h, 404, "EntryNotFound", head)
            return self._file(h, repo, name, head)
        self._error(h, 404, None, head)

    def _error(self, h, status: int, code: str | None, head: bool) -> None:
        body = json.dumps({"error": code or "not found"}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _is_lfs(self, repo: FakeRepo, name: str) -> bool:
        return name in repo.lfs or name.endswith((".gguf", ".safetensors"))

    def _info(self, h, repo_id: str, repo: FakeRepo, head: bool) -> None:
        siblings = []
        for name, data in sorted(repo.files.items()):
            entry = {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
            if self._is_lfs(repo, name):
                entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(entry)
        info = {"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                "gated": "manual" if repo.gated else False, "disabled": False, "siblings": siblings, "tags": []}
        body = json.dumps(info).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _file(self, h, repo: FakeRepo, name: str, head: bool) -> None:
        data = repo.files[name]
        start, end = 0, len(data) - 1
        rng = h.headers.get("Range")
        status = 200
        if rng and rng.startswith("bytes=") and not head:
            first, _, last = rng[6:].partition("-")
            start = int(first or 0)
            end = min(int(last), len(data) - 1) if last else len(data) - 1
            if start >= len(data):
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{len(data)}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            status = 206
        body = data[start:end + 1]
        etag = hashlib.sha256(data).hexdigest() if self._is_lfs(repo, name) else hashlib.sha1(data).hexdigest()
        h.send_response(status)
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("Accept-Ranges", "bytes")
        if self._is_lfs(repo, name):
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        downloading = not rng or rng.endswith("-")  # a header probe (bytes=0-N) is never dropped
        if downloading and self.drop.get(name, 0) > 0 and len(body) > 1:
            self.drop[name] -= 1
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(body)
