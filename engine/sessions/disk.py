"""Warm sessions on disk (`goinfer serve --session-dir`, `goinfer chat --session FILE`).

One file per session: a zip (numpy's .npz, each member CRC-checked on read) of a JSON header, the prompt tokens,
the keys and values of their positions and a recurrent model's snapshots (the last as `state.NAME`, earlier ones
as `state@POSITION.NAME`, listed in the header's `snapshots`: a reader of the one-snapshot files reads the last). The
header names the model by its
file's identity and the numbers' provenance (`identity`: the file's size and a hash of its first MiB, the
backend configuration, the CPU code tier, goinfer's version, the prompt tile): a session from another model, or
from kernels that would compute other numbers, is not this model's, and reusing it could give a wrong answer.
A file that is corrupt, truncated or foreign is skipped with one warning line, never loaded in part.

Files are written whole to a temporary name and renamed (a crash leaves the old file or none, never half).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np

from engine.sessions.pool import Session

FORMAT = "goinfer-kv-session"
VERSION = 1
SUFFIX = ".kvsession"


@lru_cache(maxsize=None)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    p = Path(path)
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for q in files:
        h.update(f"{q.name}:{q.stat().st_size}\n".encode())
        with open(q, "rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()


def identity(model) -> dict:
    """What must match for a stored session to be this model's, computed the way this process computes."""
    st = Path(model.path).stat()
    try:
        version = metadata.version("goinfer")
    except metadata.PackageNotFoundError:
        version = "unknown"
    be = model.backend
    return {"model": Path(model.path).name, "size": st.st_size,
            "digest": _file_digest(str(model.path), st.st_size, st.st_mtime_ns),
            "backend": f"{be.name}-{be.path}", "tier": be.code_tier, "goinfer": version, "tile": be.prompt_tile,
            "stepped_down": sorted(int(t) for t in be.stepped_down),
            **({"adapters": model.adapters} if getattr(model, "adapters", None) else {})}


def key_of(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def save(path: Path, session: Session, ident: dict) -> None:
    """Write a session (its prompt positions only) to path, atomically."""
    cache, n, snaps = session.cache, len(session.tokens), session.snapshots
    if snaps:
        n = snaps[-1][0]  # a recurrent model's keys and values past its last snapshot are not reusable
    layers = range(cache.n_layer)
    header = {"format": FORMAT, "version": VERSION, "identity": ident, "tokens": len(session.tokens),
              "positions": n, "kv_dtype": cache.dtype,
              "shape": [cache.n_layer, cache.n_head_kv, cache.head_dim], "snapshot": bool(snaps),
              "snapshots": [at for at, _ in snaps[:-1]], "meta": session.meta}
    arrays = {"header": np.frombuffer(json.dumps(header).encode(), np.uint8), "tokens": session.tokens,
              "keys": np.stack([cache.keys(i, n) for i in layers]) if n else np.zeros(0, np.float32),
              "values": np.stack([cache.values(i, n) for i in layers]) if n else np.zeros(0, np.float32)}
    for at, state in snaps:
        arrays.update({f"state{'' if at == n else f'@{at}'}.{k}": v for k, v in state.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class NotLoadable(Exception):
    """Why a session file cannot be used (its warning line)."""


def load(path: Path, model, ident: dict) -> Session:
    """A session from path for this model; NotLoadable (with the reason) for anything else."""
    try:
        if not zipfile.is_zipfile(path):
            raise NotLoadable("not a goinfer session file (empty, truncated or another format)")
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}  # reads every member whole: a CRC mismatch raises here
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise NotLoadable(f"unreadable ({type(e).__name__}: {str(e)[:120]})") from None
    try:
        header = json.loads(bytes(data["header"]).decode())
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise NotLoadable("not a goinfer session file of this version")
        if header.get("identity") != ident:
            raise NotLoadable(f"made by another model or build ({header.get('identity', {}).get('model')})")
        return _rebuild(model, header, data)
    except NotLoadable:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise NotLoadable(f"inconsistent ({type(e).__name__}: {e})") from None


def _rebuild(model, header: dict, data: dict) -> Session:
    tokens = np.asarray(data["tokens"], np.int64)
    n = int(header["positions"])
    cache = model.new_cache(max(n + 1, len(tokens) + 1))
    L, H, D = cache.n_layer, cache.n_head_kv, cache.head_dim
    if header["shape"] != [L, H, D] or header["kv_dtype"] != cache.dtype or len(tokens) != header["tokens"] \
            or not 0 <= n <= len(tokens) or (tokens < 0).any() or (tokens >= model.vocab_size).any():
        raise NotLoadable("its cache does not fit this model")
    keys, values = data["keys"], data["values"]
    if n and (keys.shape != (L, n, H, D) or values.shape != (L, n, H, D) or keys.dtype != np.float32
              or values.dtype != np.float32 or not (np.isfinite(keys).all() and np.isfinite(values).all())):
        raise NotLoadable("its keys or values do not fit this model")
    if n:
        cache.reserve(n)
        for layer in range(L):
            cache.write(layer, keys[layer], values[layer])  # stored rounded as they were: writing them is exact
        cache.advance(n)
    snapshots = []
    if header["snapshot"]:
        earlier = [int(at) for at in header.get("snapshots", [])]
        if sorted(set(earlier)) != earlier or not all(0 < at < n for at in earlier):
            raise NotLoadable("its snapshots' positions do not fit its cache")
        for at in earlier + [n]:
            snapshots.append((at, _state(cache, data, "state." if at == n else f"state@{at}.")))
        cache.restore(snapshots[-1])
    elif cache.state:
        raise NotLoadable("a recurrent model's session without its state")
    else:
        tokens = tokens[:n]
    return Session(cache, tokens, snapshots, meta=dict(header.get("meta") or {}))


def _state(cache, data: dict, prefix: str) -> dict:
    """A snapshot's recurrent state as stored under prefix, checked against the cache's."""
    state = {}
    for name, a in cache.state.items():
        got = data.get(prefix + name)
        if got is None or got.shape != a.shape or got.dtype != a.dtype:
            raise NotLoadable(f"its recurrent state {name} does not fit this model")
        state[name] = got.copy()
    return state


class SessionDir:
    """A directory of one or more models' sessions: each model reads and writes only its own files."""

    def __init__(self, root: Path, model, warn: Callable[[str], None]):
        self.root, self.model, self.warn = Path(root), model, warn
        self.ident = identity(model)
        self.prefix = f"{key_of(self.ident)}-"

    def save(self, session: Session) -> None:
        name = self.prefix + hashlib.sha256(session.tokens.tobytes()).hexdigest()[:16] + SUFFIX
        try:
            save(self.root / name, session, self.ident)
        except OSError as e:
            self.warn(f"could not write session {name} to {self.root}: {e}")

    def load_all(self) -> list[Session]:
        """This model's sessions, newest first; each file is removed once read (the pool owns the session now
        and writes it again when it leaves)."""
        if not self.root.is_dir():
            return []
        files = sorted(self.root.glob(self.prefix + "*" + SUFFIX), key=lambda p: p.stat().st_mtime, reverse=True)
        out = []
        for path in files:
            try:
                session = load(path, self.model, self.ident)
            except NotLoadable as e:
                self.warn(f"skipped session file {path}: {e}")
                continue
            out.append(session)
            path.unlink(missing_ok=True)
        return out


def load_file(path: Path, model) -> Session:
    """`goinfer chat --session FILE`: the session saved there (NotLoadable says why not)."""
    return load(Path(path), model, identity(model))


def save_file(path: Path, session: Session, model) -> None:
    save(Path(path), session, identity(model))
