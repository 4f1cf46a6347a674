"""Loading: our GGUF reader against gguf.GGUFReader, typed errors for bad files, memory stays bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest

import engine
from engine.errors import ModelLoadError, UnsupportedModel
from engine.formats.gguf import GGUFFile
from engine.kernels.quant_types import STEP_TYPES
from testdata import make_fixtures
from tests.conftest import in_kit


def _assert_same_as_gguf_reader(path):
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(path)
    for field in theirs.fields.values():
        if field.name.startswith("GGUF."):
            continue
        value = ours.metadata[field.name]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            expected = field.contents()
            got = value if isinstance(value, list) else value.tolist()
            assert got == list(expected), field.name
        else:
            assert value == pytest.approx(field.contents()), field.name
    assert set(ours.entries) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        e = ours.entries[t.name]
        assert e.type_id == int(t.tensor_type) and e.offset == t.data_offset
        assert e.shape == tuple(int(d) for d in reversed(t.shape))
        q = ours.tensor(t.name)
        assert np.array_equal(q.raw.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_reader_matches_gguf_on_smollm2(smollm2_gguf):
    _assert_same_as_gguf_reader(smollm2_gguf)


@pytest.mark.parametrize("writer", ["write_llama_fixture", "write_gemma3_fixture", "write_mxfp4_fixture"])
def test_reader_matches_gguf_on_fixtures(tmp_path, writer):
    path = tmp_path / "f.gguf"
    getattr(make_fixtures, writer)(path)
    _assert_same_as_gguf_reader(path)


def test_fixtures_cover_every_supported_type(tmp_path):
    types = set()
    for writer in ("write_llama_fixture", "write_gemma3_fixture", "write_mxfp4_fixture"):
        path = tmp_path / f"{writer}.gguf"
        getattr(make_fixtures, writer)(path)
        types |= {e.type_id for e in GGUFFile(path).entries.values()}
    assert {int(t) for t in STEP_TYPES} <= types  # the low-bit types: the quant kit (test_lowbit_models.py)


def test_weights_are_views_of_the_mapped_file(smollm2_gguf):
    model = engine.load_model(smollm2_gguf)
    t = model.weights.tensor("blk.0.attn_q")
    assert not t.raw.flags.owndata and not t.raw.flags.writeable


def test_typed_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        engine.load_model(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 1000)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        engine.load_model(junk)
    whole = tmp_path / "whole.gguf"
    make_fixtures.write_gemma3_fixture(whole)
    for keep in (30, whole.stat().st_size // 3, whole.stat().st_size - 1):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(whole.read_bytes()[:keep])
        with pytest.raises(ModelLoadError, match="truncated"):
            engine.load_model(cut)
    arch = tmp_path / "arch.gguf"
    make_fixtures.write_unsupported_arch_fixture(arch)
    with pytest.raises(UnsupportedModel, match="architecture"):
        engine.load_model(arch)
    qtype = tmp_path / "qtype.gguf"
    make_fixtures.write_unsupported_type_fixture(qtype)
    with pytest.raises(UnsupportedModel, match="type"):
        engine.load_model(qtype)
    with pytest.raises(engine.InvalidRequest, match="quant"):
        engine.load_model(whole, quant="int3")


def test_resident_memory_after_generation_stays_near_file_size(gemma_gguf):
    # A fresh process, so other tests' allocations do not count; the default (fast) path, a 512-token prompt
    # and 128 generated tokens. Counted: anonymous memory (heap, numpy, tokenizer, KV, the packed weights)
    # plus the model file's resident pages; not counted: shared-library code (llvmlite alone maps ~70 MB), which does not grow with
    # the model. Bound: file size + 200 MB + the KV cache.
    code = textwrap.dedent(f"""
        import engine
        m = engine.load_model({str(gemma_gguf)!r})
        cache = m.new_cache(512 + 128)
        ids = m.tokenizer.encode("The history of the city begins with a market by the river. " * 60)[:512]
        bias = {{t: -1e9 for t in m.tokenizer.eog_ids}}
        n = sum(1 for _ in engine.generate(m, ids, max_tokens=128, temperature=0, cache=cache, logit_bias=bias))
        assert n == 128 and cache.length >= 512 + 127, (n, cache.length)
        anon = model_pages = 0
        current = None
        for line in open("/proc/self/smaps"):
            parts = line.split()
            if not parts[0].endswith(":"):
                current = parts[5] if len(parts) > 5 else None
            elif parts[0] == "Anonymous:":
                anon += int(parts[1]) * 1024
            elif parts[0] == "Rss:" and current == {str(gemma_gguf)!r}:
                model_pages += int(parts[1]) * 1024
        packed = m.backend.packed_buffer.nbytes if m.backend.packed_buffer is not None else 0
        print(anon, model_pages, cache.nbytes(), packed)
    """)
    # The first run fills numba's cache if the code changed since the last (compiling holds LLVM memory that a
    # user pays once, at the first run after install); the second is the one measured.
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
    anon, model_pages, kv, packed = map(int, out.stdout.split())
    size = gemma_gguf.stat().st_size
    # The generation read every weight: through the map, or (the 4/5-bit layer matrices) their packed
    # anonymous copy, whose mapped originals must not be resident as well (a whole tensor's would be 1-178 MB).
    # Slack: reading an in-place tensor maps the page cache's pages around the fault (64 KB, or a whole large
    # folio when the page cache holds the file in them) at each of the ~72 borders between in-place and packed
    # tensors: 30-37 MB mapped here against 30 MB of in-place tensors, depending on the page cache's state.
    # That nothing reads the originals is proven in tests/test_packed.py.
    assert model_pages + packed > 0.9 * size and packed > 0.1 * size, (model_pages, packed)
    assert model_pages <= size - packed + 0.05 * size, (model_pages, packed)
    used = anon + model_pages - kv
    # 216 MB over the file: the interpreter, numpy, numba's runtime, the tokenizer and the compiled kernels (the
    # decode step's batched matvec variants, packed_kernels.py, cost ~10 MB of code at its first call). A copy of
    # the weights would be hundreds of MB over.
    limit = size + 216 * 2**20
    assert used <= limit, f"{used / 2**20:.0f} MiB resident (anonymous {anon / 2**20:.0f}) > {limit / 2**20:.0f} MiB"


def test_a_prompt_reuses_its_freed_activations_and_hands_them_back(smollm2_gguf):
    # engine/kernels/memory.py: a prompt frees and reallocates the same big activations layer after layer. With glibc's
    # defaults each came back as fresh pages to fault in and zero (SmolLM2, 512 tokens: ~200k minor faults,
    # 0.7 s of system time); kept in the heap they are reused, and trimmed away when the prompt is done.
    code = textwrap.dedent(f"""
        import resource
        import engine
        m = engine.load_model({str(smollm2_gguf)!r})
        ids = m.tokenizer.encode("The history of the city begins with a market by the river. " * 60)[:512]
        def anon():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) * 1024
        m.prefill(ids, m.new_cache(512))
        cache = m.new_cache(512)
        before, f0 = anon(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        m.prefill(ids, cache)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, anon() - before, cache.nbytes())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    faults, grown, kv = map(int, out.stdout.split())
    assert faults < 40_000, f"{faults} page faults in a repeated 512-token prompt"
    assert grown <= kv + 16 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB over a prompt (KV {kv / 2**20:.0f})"


def test_a_cold_kernel_cache_is_announced_once_warm_is_silent(tmp_path, smollm2_gguf):
    # A first run compiles the kernels for a minute: one stderr line says so; a warm cache says nothing.
    code = f"import engine; engine.load_model({str(smollm2_gguf)!r}, selftest=False)"
    cold = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "empty")))
    assert cold.returncode == 0, cold.stderr
    assert cold.stderr.count("compiling the CPU kernels") == 1, cold.stderr
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0 and "compiling" not in warm.stderr, warm.stderr


def test_a_model_larger_than_the_available_memory_is_refused_in_one_sentence(monkeypatch, smollm2_gguf):
    import engine.loading.hardware

    def pretend(available: int) -> None:
        monkeypatch.setattr(engine.loading.hardware, "memory_info", lambda: {
            "total_bytes": 1 << 40, "available_bytes": available, "cgroup_limit_bytes": None})

    pretend(smollm2_gguf.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match=r"needs 0\.\d GiB for its weights .* GOINFER_NO_MEMORY_CHECK=1") as e:
        engine.load_model(str(smollm2_gguf), selftest=False)
    assert "\n" not in str(e.value)
    pretend(1 << 10)  # a checkpoint directory is sized as it will be converted, before any conversion
    with pytest.raises(ModelLoadError, match="for its weights"):
        engine.load_model(str(in_kit("qwen3", "hf")), selftest=False)
    monkeypatch.setenv("GOINFER_NO_MEMORY_CHECK", "1")
    assert engine.load_model(str(smollm2_gguf), selftest=False).config.n_layer == 30  # the override loads it
