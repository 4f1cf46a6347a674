"""The byte-moving half of an `hf:` pull (engine/store/hf.py plans it): the hub's HTTP access (endpoint, token,
headers, file URLs), downloading each planned file into a staging directory with HTTP Range from what an earlier,
interrupted run left there, checking its size and sha256, and publishing the verified set with one atomic rename.

The bytes move through httpx because huggingface_hub deletes its partial file when a download fails, and a pull
must resume across runs. HF_ENDPOINT and HF_TOKEN are read at each call.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from engine.errors import FetchError
from engine.files import fsync_dir
from engine.store.hfref import MANIFEST, HFRef, Plan, PlannedFile

__all__ = ["download", "hub_client", "hub_endpoint", "hub_file_url", "hub_headers", "hub_token", "prepare_staging",
           "publish"]

CHUNK = 1 << 20
RETRY_DELAYS = (0.5, 2.0)  # in-run retries of a dropped download (each resumes with Range)
Progress = Callable[[str, int, "int | None"], None]


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_token() -> str | None:
    """HF_TOKEN, else the token `hf auth login` stored (huggingface_hub's own lookup)."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    try:
        from huggingface_hub import get_token

        return get_token() or None
    except Exception:
        return None


def hub_client():
    import httpx

    return httpx.Client(follow_redirects=True, trust_env=True, timeout=httpx.Timeout(60.0, connect=20.0))


def hub_headers(extra: dict | None = None) -> dict:
    from huggingface_hub.utils import build_hf_headers

    token = hub_token()
    headers = build_hf_headers(token=token or False, library_name="goinfer")
    headers["Accept-Encoding"] = "identity"  # byte ranges must count bytes of the file itself
    headers.update(extra or {})
    return headers


def hub_file_url(ref: HFRef, commit: str, path: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(ref.repo, path, revision=commit, endpoint=hub_endpoint())


# --- downloading ---------------------------------------------------------------------------------------------


def prepare_staging(staging: Path, plan: Plan) -> None:
    # A partial from another commit cannot be resumed byte-wise: start over.
    stamp = staging / ".plan.json"
    wanted = {"ref": plan.ref.name, "kind": plan.kind, "commit": plan.commit, "files": [asdict(f) for f in plan.files]}
    try:
        previous = json.loads(stamp.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        previous = None
    if previous != wanted:
        shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(wanted), encoding="utf-8")
    except OSError as exc:
        raise FetchError(f"cannot create a staging directory {staging}: {exc}") from None


def download(client, ref: HFRef, plan: Plan, f: PlannedFile, staging: Path, progress: Progress | None) -> None:
    """Download one file into staging, resuming from what is there; verify size and sha256."""
    dest = staging / f.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    description = f"Downloading {Path(f.path).name}"
    delays = list(RETRY_DELAYS)
    while True:
        try:
            _download_once(client, ref, plan, f, dest, description, progress)
            break
        except _Transient as exc:
            if not delays:
                have = dest.stat().st_size if dest.exists() else 0
                raise FetchError(f"downloading {ref.repo}/{f.path} failed: {exc} ({have} bytes kept; run the "
                                 f"same pull again to resume)") from None
            time.sleep(delays.pop(0))
    size = dest.stat().st_size
    if f.size is not None and size != f.size:
        dest.unlink(missing_ok=True)
        raise FetchError(f"{ref.repo}/{f.path}: got {size} bytes, the hub lists {f.size}")
    if f.sha256:
        digest = _sha256(dest)
        if digest != f.sha256.lower():
            dest.unlink(missing_ok=True)
            raise FetchError(f"{ref.repo}/{f.path}: sha256 mismatch (hub {f.sha256[:16]}..., got {digest[:16]}...)")


def _download_once(client, ref, plan, f: PlannedFile, dest: Path, description: str, progress) -> None:
    import httpx

    have = dest.stat().st_size if dest.exists() else 0
    if f.size is not None and have == f.size:
        if progress:
            progress(description, have, f.size)
        return
    if f.size is not None and have > f.size:
        dest.unlink()
        have = 0
    headers = hub_headers({"Range": f"bytes={have}-"} if have else None)
    try:
        with client.stream("GET", hub_file_url(ref, plan.commit, f.path), headers=headers) as r:
            if r.status_code == 416 and have:  # the server has nothing past what we hold: start over
                dest.unlink()
                raise _Transient("range not satisfiable")
            if r.status_code in (401, 403):
                raise FetchError(f"{ref.repo}/{f.path}: access denied (HTTP {r.status_code}): set HF_TOKEN")
            if r.status_code not in (200, 206):
                message = f"{ref.repo}/{f.path}: HTTP {r.status_code}"
                if r.status_code >= 500 or r.status_code == 429:
                    raise _Transient(message)
                raise FetchError(f"downloading failed: {message}")
            if r.status_code == 200:
                have = 0  # the server ignored the range: take the whole file
            with open(dest, "ab" if have else "wb") as out:
                done = have
                if progress:
                    progress(description, done, f.size)
                for chunk in r.iter_bytes():  # as it arrives: what came before a drop is kept
                    out.write(chunk)
                    done += len(chunk)
                    if progress:
                        progress(description, done, f.size)
                out.flush()
                os.fsync(out.fileno())
    except httpx.HTTPError as exc:
        raise _Transient(str(exc) or type(exc).__name__) from None
    if f.size is not None and dest.stat().st_size < f.size:
        raise _Transient(f"got {dest.stat().st_size} of {f.size} bytes")


def publish(plan: Plan, staging: Path) -> Path:
    ref = plan.ref
    manifest = {"ref": ref.name, "repo": ref.repo, "revision": ref.revision, "commit": plan.commit,
                "kind": plan.kind, "entry": plan.entry, "architecture": plan.architecture,
                "files": [asdict(f) for f in plan.files], "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        (staging / ".plan.json").unlink(missing_ok=True)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        final = ref.published_dir
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():  # a stale, incomplete leftover (published dirs always hold a manifest)
            shutil.rmtree(final)
        os.replace(staging, final)  # one atomic rename: readers see nothing or the whole verified set
    except OSError as exc:
        raise FetchError(f"publishing {ref.name} failed: {exc}") from None
    fsync_dir(final.parent)  # make the rename durable
    return final / plan.entry if plan.entry else final


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _Transient(Exception):
    """A download failure worth retrying (with Range from what arrived)."""
