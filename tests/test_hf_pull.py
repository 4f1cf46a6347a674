"""`hf:` references, `goinfer pull` and `goinfer cache` against a fake Hugging Face hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from engine.errors import FetchError, ModelLoadError, ModelNotFound, UnsupportedModel
from engine.formats.gguf import GGUFFile, GGUFShards, open_gguf
from engine.store import hf, hf_download
from engine.store.resolve import resolve_model_ref
from goinfer_cli.app import app
import engine
from tests.conftest import HAVE_KIT, KIT, needs_kit
from testdata import make_fixtures as mf
from testdata.fake_hub import FakeHub

SPLIT = ["tiny-Q4_K_M-00001-of-00002.gguf", "tiny-Q4_K_M-00002-of-00002.gguf"]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("hub-files")
    files = {"tiny-Q8_0.gguf": mf.write_llama_fixture(d / "tiny-Q8_0.gguf").read_bytes()}
    for p in mf.write_llama_split_fixture(d / "tiny-Q4_K_M.gguf"):
        files[p.name] = p.read_bytes()
    files["weird.gguf"] = mf.write_unsupported_arch_fixture(d / "weird.gguf").read_bytes()
    return files


@pytest.fixture
def hub(fixtures, tmp_path, monkeypatch):
    with FakeHub() as hub:
        hub.add("acme/tiny-GGUF", {"tiny-Q8_0.gguf": fixtures["tiny-Q8_0.gguf"], SPLIT[0]: fixtures[SPLIT[0]],
                                   SPLIT[1]: fixtures[SPLIT[1]], "README.md": b"# tiny\n"})
        hub.add("acme/broken-split-GGUF", {SPLIT[0]: fixtures[SPLIT[0]]})
        hub.add("acme/gated-GGUF", {"tiny-Q8_0.gguf": fixtures["tiny-Q8_0.gguf"]}, gated=True)
        hub.add("acme/private-GGUF", {"tiny-Q8_0.gguf": fixtures["tiny-Q8_0.gguf"]}, private=True)
        hub.add("acme/weird-GGUF", {"weird-Q8_0.gguf": fixtures["weird.gguf"]})
        hub.add("acme/tiny-st", {"config.json": json.dumps({"model_type": "llama"}).encode(),
                                 "tokenizer.json": b"{}", "model-00001-of-00002.safetensors": b"\x01" * 5000,
                                 "model-00002-of-00002.safetensors": b"\x02" * 3000,
                                 "model.safetensors.index.json": b"{}", "README.md": b"x"})
        if HAVE_KIT:  # the kit's qwen2 checkpoint directory, for the one test that pulls it
            hub.add("acme/qwen2-st", {p.name: p.read_bytes() for p in (KIT / "qwen2" / "hf").iterdir()})
        hub.add("acme/bert-st", {"config.json": json.dumps({"model_type": "bert"}).encode(),
                                 "model.safetensors": b"\x00" * 100})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("GOINFER_HOME", str(tmp_path / "home"))
        monkeypatch.setattr(hf_download, "RETRY_DELAYS", ())
        yield hub


def _cli(*args: str):
    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1"})


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _nothing_published(tmp_path: Path) -> bool:
    models = tmp_path / "home" / "models"
    return not models.exists() or not any(p.is_file() for p in models.rglob("*"))


def test_pull_a_quant_prints_the_path_and_resolves_it(hub, fixtures, tmp_path):
    r = _cli("pull", "hf:acme/tiny-GGUF:q8_0")
    assert r.exit_code == 0, r.output
    path = Path(r.stdout.strip())
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == fixtures["tiny-Q8_0.gguf"]
    assert resolve_model_ref("hf:acme/tiny-GGUF:Q8_0") == path
    assert not list((tmp_path / "home" / "staging").iterdir())  # the staging directory was renamed into place


def test_split_quant_is_pulled_whole_and_loads_as_one_model(hub, fixtures, tmp_path):
    from engine.loading.load import load_model

    path = hf.pull("hf:acme/tiny-GGUF:Q4_K_M")
    assert sorted(p.name for p in path.parent.glob("*.gguf")) == SPLIT
    model = load_model("hf:acme/tiny-GGUF:Q4_K_M")
    assert isinstance(model.weights._file, GGUFShards)
    (tmp_path / "single.gguf").write_bytes(fixtures["tiny-Q8_0.gguf"])
    single = GGUFFile(tmp_path / "single.gguf")
    split = open_gguf(path.parent / SPLIT[1])  # any shard opens the whole set
    assert set(split.entries) == set(single.entries)
    for name in single.entries:  # same seed: the split fixture holds the single fixture's tensors
        assert np.array_equal(split.tensor(name).raw, single.tensor(name).raw), name
    # Served as one model: greedy generation equals the single file's, token for token.
    import engine

    whole = load_model(tmp_path / "single.gguf", selftest=False)
    ids = model.tokenizer.encode("hello world")
    tokens = [[ev.token for ev in engine.generate(m, ids, max_tokens=6, temperature=0)] for m in (model, whole)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_repo_with_several_quants_lists_them(hub):
    r = _cli("pull", "hf:acme/tiny-GGUF")
    assert r.exit_code == 2
    assert r.stdout.split() == ["hf:acme/tiny-GGUF:Q4_K_M", "hf:acme/tiny-GGUF:Q8_0"]
    assert "name one" in r.stderr
    assert not hub.file_requests("GET")


@needs_kit
def test_a_pulled_safetensors_checkpoint_loads_and_answers(hub, tmp_path):
    # The kit's tiny Qwen2 directory (bf16 safetensors, tokenizer.json) served by the hub, pulled, then run.
    r = _cli("pull", "hf:acme/qwen2-st:safetensors", "--json")
    assert r.exit_code == 0, r.output
    directory = Path(json.loads(r.stdout)["path"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in directory.iterdir()}
    assert resolve_model_ref("hf:acme/qwen2-st:safetensors") == directory
    r = _cli("chat", "--model", "hf:acme/qwen2-st:safetensors", "--prompt", "hi", "--max", "4", "--no-selftest")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()  # random weights: some text, whatever it says


def test_a_broken_safetensors_set_is_pulled_but_refused_with_one_line(hub, tmp_path):
    r = _cli("pull", "hf:acme/tiny-st:safetensors", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    directory = Path(out["path"])
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json", "manifest.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json"]
    with pytest.raises(ModelLoadError, match="config.json lacks 'hidden_size'"):
        engine.load_model("hf:acme/tiny-st:safetensors", selftest=False)
    r = _cli("chat", "--model", "hf:acme/tiny-st:safetensors", "--prompt", "hi")
    assert r.exit_code != 0 and "config.json lacks" in r.stderr and "Traceback" not in r.output


def test_safetensors_of_an_unsupported_architecture_is_refused(hub, tmp_path):
    with pytest.raises(UnsupportedModel, match="'bert'"):
        hf.pull("hf:acme/bert-st:safetensors")
    assert not any("model.safetensors" in r[1] for r in hub.file_requests("GET"))
    assert _nothing_published(tmp_path)


def test_interrupted_download_resumes_with_range_on_the_next_run(hub, fixtures, tmp_path):
    data = fixtures["tiny-Q8_0.gguf"]
    hub.drop["tiny-Q8_0.gguf"] = 1
    with pytest.raises(FetchError, match="run the same pull again"):
        hf.pull("hf:acme/tiny-GGUF:Q8_0")
    assert _nothing_published(tmp_path)
    assert hf.cached_entry(hf.parse_hf_ref("hf:acme/tiny-GGUF:Q8_0")) is None
    partial = next((tmp_path / "home" / "staging").glob("hf--*/tiny-Q8_0.gguf"))
    kept = partial.stat().st_size
    assert 0 < kept < len(data)
    listing = json.loads(_cli("cache", "--json").stdout)
    assert [(e["name"], e["complete"]) for e in listing] == [("hf:acme/tiny-GGUF:Q8_0", False)]

    path = hf.pull("hf:acme/tiny-GGUF:Q8_0")
    assert ("GET", "/acme/tiny-GGUF/resolve/" + hub.repos["acme/tiny-GGUF"].sha + "/tiny-Q8_0.gguf",
            f"bytes={kept}-") in hub.requests
    assert _sha(path.read_bytes()) == _sha(data)


def test_gated_repo_is_refused_before_any_file_is_read(hub, tmp_path, monkeypatch):
    with pytest.raises(FetchError, match="gated"):
        hf.pull("hf:acme/gated-GGUF:Q8_0")
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_without_access")
    r = _cli("pull", "hf:acme/gated-GGUF:Q8_0")  # with a token the hub answers 403 GatedRepo
    assert r.exit_code == 2 and "gated" in r.stderr and "Traceback" not in r.output
    assert not hub.file_requests("GET")
    assert _nothing_published(tmp_path)


def test_private_repo_401_names_the_token(hub):
    r = _cli("pull", "hf:acme/private-GGUF:Q8_0")
    assert r.exit_code == 2 and "HF_TOKEN" in r.stderr
    assert not hub.file_requests("GET")


def test_unsupported_architecture_is_refused_before_weights_move(hub, fixtures, tmp_path):
    with pytest.raises(UnsupportedModel, match="not supported"):
        hf.pull("hf:acme/weird-GGUF:Q8_0")
    gets = hub.file_requests("GET")
    assert gets and all(r[2] is not None and r[2].startswith("bytes=0-") for r in gets)  # header probes only
    assert len(fixtures["weird.gguf"]) > hf.HEADER_PROBE  # so a probe is not the whole file
    assert _nothing_published(tmp_path)


def test_split_set_with_a_missing_shard_is_refused(hub, tmp_path):
    with pytest.raises(ModelNotFound, match="missing shard"):
        hf.pull("hf:acme/broken-split-GGUF:Q4_K_M")
    assert not hub.file_requests("GET")


def test_complete_pull_resolves_offline_and_without_the_hub(hub, monkeypatch):
    path = hf.pull("hf:acme/tiny-GGUF:Q8_0")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    assert resolve_model_ref("hf:acme/tiny-GGUF:Q8_0") == path
    assert resolve_model_ref("hf:acme/tiny-GGUF") == path  # the only cached pull of that repo
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_ref("hf:acme/tiny-GGUF:Q8_0", offline=True) == path
    with pytest.raises(ModelNotFound, match="offline"):
        resolve_model_ref("hf:acme/tiny-GGUF:Q4_K_M")


def test_cache_lists_and_removes(hub, tmp_path):
    hf.pull("hf:acme/tiny-GGUF:Q8_0")
    hf.pull("hf:acme/tiny-GGUF:Q4_K_M")
    r = _cli("cache", "--json")
    listing = json.loads(r.stdout)
    assert [(e["name"], e["complete"], e["kind"]) for e in listing] == [
        ("hf:acme/tiny-GGUF:Q4_K_M", True, "gguf"), ("hf:acme/tiny-GGUF:Q8_0", True, "gguf")]
    assert all(e["size"] > 1_000_000 for e in listing)
    r = _cli("cache")
    assert r.exit_code == 0 and "hf:acme/tiny-GGUF:Q8_0" in r.stdout and "complete" in r.stdout
    assert _cli("cache", "rm", "hf:acme/tiny-GGUF:Q8_0").exit_code == 0
    assert [e["name"] for e in json.loads(_cli("cache", "--json").stdout)] == ["hf:acme/tiny-GGUF:Q4_K_M"]
    r = _cli("cache", "rm", "hf:acme/tiny-GGUF:Q8_0")
    assert r.exit_code == 2 and "not in the cache" in r.stderr
    assert _cli("cache", "rm", "hf:acme/tiny-GGUF").exit_code == 0
    assert json.loads(_cli("cache", "--json").stdout) == []


def test_malformed_references_are_one_line_errors(hub):
    for ref in ("hf:nope", "hf:acme/tiny-GGUF:Q4_K_M:extra", "hf:acme/tiny-GGUF:../x.gguf"):
        with pytest.raises(ModelNotFound):
            resolve_model_ref(ref)


def test_local_split_set_missing_a_shard_is_refused(fixtures, tmp_path):
    (tmp_path / SPLIT[0]).write_bytes(fixtures[SPLIT[0]])
    with pytest.raises(ModelLoadError, match="missing shard"):
        open_gguf(tmp_path / SPLIT[0])


def test_cache_lists_and_removes_builtin_files(hub, tmp_path):
    from engine.store import builtin

    model = builtin.lookup("smollm2-135m")
    path = builtin.model_path(model)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not the whole file")  # wrong size: listed, but not complete
    listing = json.loads(_cli("cache", "--json").stdout)
    assert [(e["name"], e["kind"], e["complete"]) for e in listing] == [("smollm2-135m", "builtin", False)]
    assert _cli("cache", "rm", "smollm2").exit_code == 0  # aliases work
    assert not path.exists()


def test_a_listed_name_that_escapes_the_cache_is_never_planned(hub, fixtures, tmp_path):
    hub.add("acme/evil-GGUF", {"../../escape-Q8_0.gguf": fixtures["tiny-Q8_0.gguf"]})
    with pytest.raises(ModelNotFound, match="no .gguf file"):
        hf.pull("hf:acme/evil-GGUF:Q8_0")
    assert not hub.file_requests("GET") and not (tmp_path / "escape-Q8_0.gguf").exists()
