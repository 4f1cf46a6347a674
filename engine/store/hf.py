"""Pulling `hf:` references from a Hugging Face hub into the goinfer cache.

    plan_pull(ref)   list the repo (huggingface_hub), pick the files, check access and the architecture;
                     no weight byte moves. Refuses with the reason: gated/private repo, missing shard,
                     unsupported architecture, several quants and none named (AmbiguousModelRef lists them).
    pull(ref)        plan, then download every file into a staging directory (HTTP Range from what an
                     earlier, interrupted run left there), check size and sha256, write the manifest and
                     publish with one atomic rename (engine/store/hf_download.py). Afterwards the reference
                     resolves with no network.

huggingface_hub does the listing and the HEAD requests (HF_ENDPOINT, HF_TOKEN, its error types); the bytes
move through httpx (hf_download.py says why). HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE are read at each call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from engine.errors import FetchError, ModelNotFound, UnsupportedModel
from engine.files import locked
from engine.formats.gguf import SPLIT_NAME
from engine.store.hf_download import (download, hub_client, hub_endpoint, hub_file_url, hub_headers, hub_token,
                                      prepare_staging, publish)
from engine.store.hfref import HFRef, Plan, PlannedFile, match_quant, parse_hf_ref, quant_of, read_manifest

__all__ = ["AmbiguousModelRef", "Plan", "PlannedFile", "cached_entry", "hub_offline", "plan_pull", "pull",
           "resolve_hf"]

Progress = Callable[[str, int, "int | None"], None]
HEADER_PROBE = 1 << 16  # first read of a GGUF header; doubled until general.architecture is in it
_SAFETENSORS_EXTRA = ("tokenizer.model", "merges.txt", "vocab.txt", "vocab.json")


class AmbiguousModelRef(ModelNotFound):
    """A repo holds several quants and the reference names none; `choices` are complete references."""

    def __init__(self, message: str, choices: list[str]):
        super().__init__(message)
        self.choices = choices


# --- environment --------------------------------------------------------------------------------------------


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


# --- resolving ----------------------------------------------------------------------------------------------


def cached_entry(ref: HFRef) -> Path | None:
    """The published file to load for `ref` (first shard for a split set), or None; never the network."""
    candidates = [ref] if ref.selector else _published_selectors(ref)
    if ref.kind == "quant":  # a pull stores a quant under the repo's own name for it (match_quant): UD- or not
        bare = ref.selector.removeprefix("UD-")
        candidates.append(ref.with_selector(bare if bare != ref.selector else "UD-" + bare))
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
            raise FetchError(f"{what}: cannot reach {hub_endpoint()}: {exc or type(exc).__name__}") from None
        raise


def plan_pull(ref: HFRef | str, *, progress: Progress | None = None) -> Plan:
    """Decide what a pull fetches, before any weight byte moves; refuse with the reason."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    ref = parse_hf_ref(ref) if isinstance(ref, str) else ref
    if hub_offline():
        raise ModelNotFound(f"{ref.name}: offline mode (HF_HUB_OFFLINE) forbids contacting the hub")
    endpoint, token = hub_endpoint(), hub_token()
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
            quant = match_quant(ref.selector, groups)
            if quant is None:
                raise ModelNotFound(f"{ref.repo} has no {ref.selector} GGUF (quants: {', '.join(sorted(groups))})")
            chosen_ref, members = ref.with_selector(quant), groups[quant]
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


def _remote_gguf_architecture(ref: HFRef, plan: Plan, endpoint: str, token: str | None) -> str:
    """general.architecture from the first bytes of the entry file (a Range request; weights stay put)."""
    import httpx

    from engine.errors import ModelLoadError
    from engine.formats.gguf import read_header_key

    size = next(f.size for f in plan.files if f.path == plan.entry)
    want = HEADER_PROBE
    with hub_client() as client:
        while True:
            want = min(want, size) if size else want
            data = bytearray()
            try:  # streamed and cut at `want`: a server that ignores Range must not send us the weights
                with client.stream("GET", hub_file_url(ref, plan.commit, plan.entry),
                                   headers=hub_headers({"Range": f"bytes=0-{want - 1}"})) as r:
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
        with hub_client() as client:
            r = client.get(hub_file_url(ref, plan.commit, "config.json"), headers=hub_headers())
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
        prepare_staging(staging, plan)
        with hub_client() as client:
            for f in plan.files:
                download(client, ref, plan, f, staging, progress)
        return publish(plan, staging)


