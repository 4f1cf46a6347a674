"""Pulling `hf:` references from a Hugging Face hub into the goinfer cache.

    plan_pull(ref)   list the repo (huggingface_hub), pick the files, check access and the architecture;
                     no weight byte moves. Refuses with the reason: gated/private repo, missing shard,
                     unsupported architecture, several quants and none named (AmbiguousModelRef lists them).
    pull(ref)        plan, then download every file into a staging directory (HTTP Range from what an
                     earlier, interrupted run left there), check size and sha256, write the manifest and
                     publish with one atomic rename. Afterwards the reference resolves with no network.

huggingface_hub does the listing and the HEAD requests (HF_ENDPOINT, HF_TOKEN, its error types); the bytes
move through httpx here because huggingface_hub deletes its partial file when a download fails, and a
pull must resume across runs. HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE are read at each call.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import FetchError, ModelNotFound, UnsupportedModel
from engine.files import fsync_dir, locked
from engine.formats.gguf import SPLIT_NAME
from engine.store.hfref import MANIFEST, HFRef, parse_hf_ref, quant_of, read_manifest

__all__ = ["AmbiguousModelRef", "Plan", "PlannedFile", "cached_entry", "hub_offline", "plan_pull", "pull",
           "resolve_hf"]

Progress = Callable[[str, int, "int | None"], None]
CHUNK = 1 << 20
RETRY_DELAYS = (0.5, 2.0)  # in-run retries of a dropped download (each resumes with Range)
HEADER_PROBE = 1 << 16  # first read of a GGUF header; doubled until general.architecture is in it
_SAFETENSORS_EXTRA = ("tokenizer.model", "merges.txt", "vocab.txt", "vocab.json")


class AmbiguousModelRef(ModelNotFound):
    """A repo holds several quants and the reference names none; `choices` are complete references."""

    def __init__(self, message: str, choices: list[str]):
        super().__init__(message)
        self.choices = choices


@dataclass(frozen=True)
class PlannedFile:
    path: str  # inside the repo
    size: int | None
    sha256: str | None  # the hub gives it for LFS files


@dataclass
class Plan:
    ref: HFRef  # with its selector decided
    commit: str  # files are fetched at this commit, so a resume never mixes revisions
    kind: str  # "gguf" or "safetensors"
    entry: str | None  # the file to load (first shard), None for safetensors
    files: list[PlannedFile] = field(default_factory=list)
    architecture: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


# --- environment --------------------------------------------------------------------------------------------


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _token() -> str | None:
    """HF_TOKEN, else the token `hf auth login` stored (huggingface_hub's own lookup)."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    try:
        from huggingface_hub import get_token

        return get_token() or None
    except Exception:
        return None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


# --- resolving ----------------------------------------------------------------------------------------------


def cached_entry(ref: HFRef) -> Path | None:
    """The published file to load for `ref` (first shard for a split set), or None; never the network."""
    candidates = [ref] if ref.selector else _published_selectors(ref)
    for candidate in candidates:
        manifest = read_manifest(candidate.published_dir)
        if manifest is None:
            continue
        if manifest.get("kind") == "safetensors":
            return candidate.published_dir
        entry = candidate.published_dir / manifest["entry"]
        if entry.is_file():
            return entry
    return None


def _published_selectors(ref: HFRef) -> list[HFRef]:
    # hf:OWNER/REPO with no selector resolves offline only when exactly one GGUF pull of it is cached.
    from engine.store.paths import models_dir

    root = models_dir() / "hf" / ref.repo
    found = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            m = read_manifest(d)
            if m and m.get("kind") == "gguf" and m.get("revision", "main") == ref.revision:
                found.append(parse_hf_ref(m["ref"]))
    return found if len(found) == 1 else []


def resolve_hf(ref_text: str, *, progress: Progress | None = None, offline: bool = False) -> Path:
    """The local file a `hf:` reference loads from, pulling it first when it is not cached."""
    ref = parse_hf_ref(ref_text)
    path = cached_entry(ref)
    if path is not None:
        return path
    if offline or hub_offline():
        raise ModelNotFound(f"{ref.name} is not in the cache and offline mode forbids fetching it: "
                            f"run `goinfer pull {ref.name}` while online")
    return pull(ref, progress=progress)


# --- planning -----------------------------------------------------------------------------------------------


def _hub_call(what: str, fn, *args, **kwargs):
    """Run a huggingface_hub call, turning its errors into one-line engine errors."""
    from huggingface_hub import errors as hf_errors

    try:
        return fn(*args, **kwargs)
    except hf_errors.GatedRepoError:
        raise FetchError(f"{what}: gated repo: accept its terms on the hub and set HF_TOKEN to a token with "
                         f"access") from None
    except hf_errors.RevisionNotFoundError:
        raise ModelNotFound(f"{what}: no such revision") from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelNotFound(f"{what}: repository not found (or private: set HF_TOKEN)") from None
    except hf_errors.EntryNotFoundError:
        raise ModelNotFound(f"{what}: file not found in the repository") from None
    except hf_errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        if status in (401, 403):
            raise FetchError(f"{what}: access denied (HTTP {status}): set HF_TOKEN to a token with access") from None
        raise FetchError(f"{what}: hub answered HTTP {status}") from None
    except hf_errors.OfflineModeIsEnabled:
        raise ModelNotFound(f"{what}: offline mode (HF_HUB_OFFLINE) forbids contacting the hub") from None
    except Exception as exc:  # httpx connection errors and the like: still one line
        if type(exc).__module__.startswith(("httpx", "huggingface_hub")):
            raise FetchError(f"{what}: cannot reach {_endpoint()}: {exc or type(exc).__name__}") from None
        raise


def plan_pull(ref: HFRef | str, *, progress: Progress | None = None) -> Plan:
    """Decide what a pull fetches, before any weight byte moves; refuse with the reason."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    ref = parse_hf_ref(ref) if isinstance(ref, str) else ref
    if hub_offline():
        raise ModelNotFound(f"{ref.name}: offline mode (HF_HUB_OFFLINE) forbids contacting the hub")
    endpoint, token = _endpoint(), _token()
    api = HfApi(endpoint=endpoint, token=token or False)
    info = _hub_call(ref.repo, api.model_info, ref.repo, revision=ref.revision, files_metadata=True)
    if getattr(info, "gated", False) and not token:
        raise FetchError(f"{ref.repo}: gated repo ({info.gated}): accept its terms on the hub and set HF_TOKEN")
    # A file name that could escape the staging directory is never planned, whatever the hub lists.
    siblings = {s.rfilename: s for s in (info.siblings or []) if _safe_name(s.rfilename)}
    commit = info.sha or ref.revision

    def planned(name: str) -> PlannedFile:
        s = siblings[name]
        sha = s.lfs.sha256 if s.lfs is not None else None
        return PlannedFile(name, s.size if s.size is not None else (s.lfs.size if s.lfs else None), sha)

    if ref.kind == "safetensors":
        plan = _plan_safetensors(ref, siblings, planned, commit)
    else:
        plan = _plan_gguf(ref, list(siblings), planned, commit)
    # A HEAD per file: a gated or private file is refused here, before any byte of it is read.
    for f in plan.files:
        url = hf_hub_url(ref.repo, f.path, revision=commit, endpoint=endpoint)
        _hub_call(f"{ref.repo}/{f.path}", get_hf_file_metadata, url, token=token or False, endpoint=endpoint)
    if plan.kind == "gguf":
        plan.architecture = _remote_gguf_architecture(ref, plan, endpoint, token)
    else:
        plan.architecture = _remote_config_architecture(ref, plan, endpoint, token)
    _check_architecture(ref, plan.architecture)
    return plan


def _safe_name(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith(("/", "\\")) and ".." not in parts and "" not in parts \
        and "\\" not in name and ":" not in name


def _plan_gguf(ref: HFRef, names: list[str], planned, commit: str) -> Plan:
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if not ggufs:
        raise ModelNotFound(f"{ref.repo} has no .gguf file (for a safetensors checkpoint use hf:{ref.repo}:safetensors)")
    if ref.kind == "file":
        matches = [n for n in ggufs if n == ref.selector or n.lower() == ref.selector.lower()]
        if not matches:
            raise ModelNotFound(f"{ref.repo} has no file {ref.selector!r} (GGUF files: {', '.join(ggufs[:8])})")
        chosen_ref, first = ref, matches[0]
    else:
        groups: dict[str, list[str]] = {}
        for n in ggufs:
            if "mmproj" in Path(n).name.lower():  # vision projectors are not language models
                continue
            groups.setdefault(quant_of(n) or Path(n).name, []).append(n)
        if ref.kind == "quant":
            if ref.selector not in groups:
                raise ModelNotFound(f"{ref.repo} has no {ref.selector} GGUF (quants: {', '.join(sorted(groups))})")
            chosen_ref, members = ref, groups[ref.selector]
        elif len(groups) == 1:
            (quant, members), = groups.items()
            chosen_ref = ref.with_selector(quant if quant_of(members[0]) else members[0])
        else:
            choices = [ref.with_selector(q).name for q in sorted(groups)]
            raise AmbiguousModelRef(f"{ref.repo} holds {len(groups)} quants; name one: {', '.join(choices)}",
                                    choices)
        first = members[0]
        singles = [m for m in members if not SPLIT_NAME.match(Path(m).name)]
        if len(singles) > 1 or (singles and len(members) > len(singles)):
            raise ModelNotFound(f"{ref.repo}: several files carry {ref.selector or 'that quant'} "
                                f"({', '.join(members[:6])}): name the file (hf:{ref.repo}:FILE.gguf)")
    m = SPLIT_NAME.match(Path(first).name)
    files = [first]
    if m is not None:  # every shard of the split set, and refuse a set with one missing
        count, folder = int(m["count"]), str(Path(first).parent)
        prefix = (folder + "/" if folder != "." else "") + m["prefix"]
        files = [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
        missing = [f for f in files if f not in names]
        if missing:
            raise ModelNotFound(f"{ref.repo}: split model {Path(first).name} is missing shard(s) "
                                f"{', '.join(missing)}")
    return Plan(chosen_ref, commit, "gguf", files[0], [planned(f) for f in files])


def _plan_safetensors(ref: HFRef, siblings: dict, planned, commit: str) -> Plan:
    names = sorted(siblings)
    shards = [n for n in names if n.endswith(".safetensors") and "/" not in n]
    if not shards:
        raise ModelNotFound(f"{ref.repo} has no .safetensors checkpoint")
    wanted = shards + [n for n in names if "/" not in n and (n.endswith(".json") or n in _SAFETENSORS_EXTRA)]
    if "config.json" not in names:
        raise ModelNotFound(f"{ref.repo}: a safetensors checkpoint without config.json cannot be used")
    return Plan(ref, commit, "safetensors", None, [planned(n) for n in sorted(set(wanted))])


def _http_client():
    import httpx

    return httpx.Client(follow_redirects=True, trust_env=True, timeout=httpx.Timeout(60.0, connect=20.0))


def _headers(extra: dict | None = None) -> dict:
    from huggingface_hub.utils import build_hf_headers

    token = _token()
    headers = build_hf_headers(token=token or False, library_name="goinfer")
    headers["Accept-Encoding"] = "identity"  # byte ranges must count bytes of the file itself
    headers.update(extra or {})
    return headers


def _file_url(ref: HFRef, commit: str, path: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(ref.repo, path, revision=commit, endpoint=_endpoint())


def _remote_gguf_architecture(ref: HFRef, plan: Plan, endpoint: str, token: str | None) -> str:
    """general.architecture from the first bytes of the entry file (a Range request; weights stay put)."""
    import httpx

    from engine.errors import ModelLoadError
    from engine.formats.gguf import read_header_key

    size = next(f.size for f in plan.files if f.path == plan.entry)
    want = HEADER_PROBE
    with _http_client() as client:
        while True:
            want = min(want, size) if size else want
            data = bytearray()
            try:  # streamed and cut at `want`: a server that ignores Range must not send us the weights
                with client.stream("GET", _file_url(ref, plan.commit, plan.entry),
                                   headers=_headers({"Range": f"bytes=0-{want - 1}"})) as r:
                    if r.status_code not in (200, 206):
                        raise FetchError(f"{ref.repo}/{plan.entry}: reading its header: HTTP {r.status_code}")
                    for chunk in r.iter_bytes():
                        data += chunk
                        if len(data) >= want:
                            break
            except httpx.HTTPError as exc:
                raise FetchError(f"{ref.repo}/{plan.entry}: reading its header failed: {exc}") from None
            data = bytes(data[:want])
            try:
                return str(read_header_key(data, "general.architecture", name=plan.entry) or "")
            except ModelLoadError as exc:
                if "truncated" not in str(exc) or (size and want >= size) or want >= 256 << 20:
                    raise
                want *= 4


def _remote_config_architecture(ref: HFRef, plan: Plan, endpoint: str, token: str | None) -> str:
    import httpx

    try:
        with _http_client() as client:
            r = client.get(_file_url(ref, plan.commit, "config.json"), headers=_headers())
            r.raise_for_status()
            config = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise FetchError(f"{ref.repo}/config.json: {exc}") from None
    from engine.models.registry import HF_MODEL_TYPES

    model_type = str(config.get("model_type", ""))
    return HF_MODEL_TYPES.get(model_type, model_type)


def _check_architecture(ref: HFRef, arch: str | None) -> None:
    from engine.models.registry import FAMILIES

    if arch not in FAMILIES:
        raise UnsupportedModel(f"{ref.name}: architecture {arch or '(none)'!r} is not supported "
                               f"(supported: {', '.join(FAMILIES)}); nothing was downloaded")


# --- pulling ------------------------------------------------------------------------------------------------


def pull(ref: HFRef | str, *, progress: Progress | None = None, plan: Plan | None = None) -> Path:
    """Fetch `ref` into the cache (resuming an interrupted pull); the path `cached_entry` will give."""
    ref = parse_hf_ref(ref) if isinstance(ref, str) else ref
    plan = plan or plan_pull(ref, progress=progress)
    ref = plan.ref
    with locked(ref.lock_path, error=FetchError):  # one pull of a reference at a time
        done = cached_entry(ref)
        if done is not None:
            return done
        staging = ref.staging_dir
        _prepare_staging(staging, plan)
        with _http_client() as client:
            for f in plan.files:
                _download(client, ref, plan, f, staging, progress)
        return _publish(plan, staging)


def _prepare_staging(staging: Path, plan: Plan) -> None:
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


def _download(client, ref: HFRef, plan: Plan, f: PlannedFile, staging: Path, progress: Progress | None) -> None:
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
    headers = _headers({"Range": f"bytes={have}-"} if have else None)
    try:
        with client.stream("GET", _file_url(ref, plan.commit, f.path), headers=headers) as r:
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


def _publish(plan: Plan, staging: Path) -> Path:
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
