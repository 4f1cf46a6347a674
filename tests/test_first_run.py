"""A first run after install: kernels compiled for the model's own types, the decode step compiled in a background
process while `goinfer chat` answers without it (engine/kernels/cpu/step_compile.py, engine/loading/precompile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import engine
from engine.loading import precompile
from engine.kernels.cpu import backend as cpu_backend
from engine.kernels.cpu import exact, int8, packed, selftest, step_compile, verdicts
from engine.kernels.cpu.decode_step import decode_step

PROMPT = "What is the capital of France? Answer in one sentence."


def _reply(model) -> str:
    ids = model.tokenizer.encode(model.render_chat([{"role": "user", "content": PROMPT}]))
    return "".join(ev.text for ev in engine.generate(model, ids, max_tokens=16, temperature=0))


@pytest.fixture
def private_lock(monkeypatch, tmp_path):
    monkeypatch.setattr(step_compile, "lock_path", lambda: tmp_path / "step-compile.lock")


@pytest.fixture
def uncompiled_step(monkeypatch, private_lock):
    """The step as a fresh install has it: not in numba's cache until the background compile is done (here a
    stand-in process that runs until `finish(compiled)`, which says whether the cache then has the step).
    Records the commands that would have started."""
    state = {"compiled": False, "commands": [], "processes": []}
    real = step_compile.load_cached
    monkeypatch.setattr(step_compile, "load_cached", lambda disp, sig: state["compiled"] and real(disp, sig))
    monkeypatch.setattr(cpu_backend, "step_uncached", lambda: True)

    def spawn(command):
        state["commands"].append(command)
        process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        state["processes"].append(process)
        step_compile._running.append((process, time.monotonic()))
        return process

    def finish(compiled: bool):
        state["compiled"] = compiled
        for process in state["processes"]:
            process.stdin.close()
            process.wait()

    monkeypatch.setattr(step_compile, "spawn", spawn)
    state["finish"] = finish
    yield state
    finish(state["compiled"])
    step_compile._running.clear()


def test_a_first_chat_answers_while_the_step_compiles_elsewhere(uncompiled_step, smollm2_gguf):
    model = engine.load_model(smollm2_gguf, background_compile=True)
    # one compile started, before the self-test: the model's own load, as the foreground's
    assert uncompiled_step["commands"] == [[sys.executable, "-m", "engine.loading.precompile", str(smollm2_gguf),
                                            "auto"]]
    notes = []
    step_compile.announce_running(notes.append)  # what a one-shot says as it returns, the compile still running
    assert len(notes) == 1 and "still compiling in the background" in notes[0] and "4 min at most" in notes[0]
    assert not model.backend.has_decode_step
    first = _reply(model)  # token by token through the prompt pass
    assert not model.backend.has_decode_step
    assert first == _reply(engine.load_model(smollm2_gguf)) == "The capital of France is Paris."  # as later runs
    uncompiled_step["finish"](True)  # the compile is done: the next poll takes the step up
    deadline = time.monotonic() + 10
    while not model.backend.has_decode_step and time.monotonic() < deadline:
        time.sleep(0.05)
    assert model.backend.has_decode_step
    assert _reply(model) == first


def test_a_compile_that_ends_without_the_step_leaves_decoding_as_it_was(uncompiled_step, smollm2_gguf):
    model = engine.load_model(smollm2_gguf, background_compile=True, selftest=False)
    uncompiled_step["finish"](False)
    time.sleep(2 * step_compile.POLL_SECONDS)
    assert not model.backend.has_decode_step  # the compile ended, the cache has no step: it gives up
    assert _reply(model) == "The capital of France is Paris."


def test_later_runs_find_the_step_in_the_cache(monkeypatch, private_lock, smollm2_gguf):
    started = []
    monkeypatch.setattr(step_compile, "spawn", started.append)
    model = engine.load_model(smollm2_gguf, background_compile=True, selftest=False)
    assert model.backend.has_decode_step and started == []


def test_the_step_signature_is_the_one_a_decode_compiles(smollm2_gguf):
    model = engine.load_model(smollm2_gguf, selftest=False)
    cache = model.new_cache(8)
    model.prefill([1, 2, 3], cache)
    model.decode([4], [cache])
    sig = model.backend.step.signature([model.new_cache(1)])
    assert sig in decode_step.overloads
    assert step_compile.load_cached(decode_step, sig)


def test_a_second_background_compile_leaves_while_one_runs(monkeypatch, private_lock):
    loads = []
    monkeypatch.setattr(precompile, "load_model", lambda *args, **kwargs: loads.append(args))
    monkeypatch.setattr(os, "nice", lambda n: 0)  # not this test process
    with step_compile.hold_lock() as mine:
        assert mine and step_compile._compiling_elsewhere()
        assert precompile.main(["model.gguf", "auto"]) == 0
    assert loads == [] and not step_compile._compiling_elsewhere()


def test_the_background_compile_runs(smollm2_gguf, tmp_path):
    # (numba's cache is warm here: this checks the child's own code path, whose errors no one would see)
    env = dict(os.environ, TMPDIR=str(tmp_path))  # its own lock file
    done = subprocess.run([sys.executable, "-m", "engine.loading.precompile", str(smollm2_gguf), "auto"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(tmp_path.glob("goinfer-*-step-compile.lock"))


def test_a_load_compiles_the_kernels_it_runs_on_its_own_types_only(monkeypatch, smollm2_gguf):
    monkeypatch.setattr(selftest, "_STATE", selftest.SelfTest())
    monkeypatch.setattr(selftest, "KERNELS", dict(selftest._cpu_kernels()))
    monkeypatch.delenv("GOINFER_NO_SELFTEST", raising=False)
    plain = (int8._matvec_of, exact._dequantize_rows_serial, exact._dequantize_rows, exact._gather_rows)
    packs = (packed._groups_chunk, packed._dequantize_groups)
    for made in plain + packs:
        made.cache_clear()
    model = engine.load_model(smollm2_gguf)
    # every matrix (Q4_1, the Q8_0 embedding/head) is packed: its packed kernels are checked, per type
    assert {(r.kernel, r.type) for r in selftest.report_results()} == {("packed_q8", "Q4_1"), ("packed_q8", "Q8_0")}
    assert [made.cache_info().currsize for made in packs] == [2, 2]  # one variant each
    assert [made.cache_info().currsize for made in plain] == [0, 0, 0, 0]  # not even compiled
    assert _reply(model) == "The capital of France is Paris."


@pytest.fixture
def own_verdicts(monkeypatch, tmp_path):
    """A process that has not run the self-test, with the shipped kernels and its own verdict file."""
    monkeypatch.setattr(selftest, "_STATE", selftest.SelfTest())
    monkeypatch.delenv("GOINFER_NO_SELFTEST", raising=False)
    monkeypatch.setattr(verdicts, "path", lambda: tmp_path / verdicts.FILE_NAME)
    return tmp_path / verdicts.FILE_NAME


def _no_kernel_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(selftest, "fixed_weight", refuse)


def test_later_loads_take_the_self_test_verdicts_this_machine_reached(own_verdicts, monkeypatch, smollm2_gguf):
    engine.load_model(smollm2_gguf)
    first = selftest.report()
    assert first["status"] == "ok" and own_verdicts.exists()
    assert set(verdicts.load()) >= {"packed_q8/Q4_1", "packed_q8/Q8_0"}
    monkeypatch.setattr(selftest, "_STATE", selftest.SelfTest())  # the next process
    _no_kernel_runs(monkeypatch)
    engine.load_model(smollm2_gguf)
    assert selftest.report()["status"] == "ok"
    assert selftest.report()["kernels_checked"] == first["kernels_checked"]
    # check --hardware runs the kernels whatever is remembered
    with pytest.raises(AssertionError, match="a kernel ran"):
        selftest.run_selftest(force=True)


def test_a_remembered_failure_steps_its_type_down(own_verdicts, monkeypatch, smollm2_gguf, capsys):
    engine.load_model(smollm2_gguf)
    verdicts.remember({"packed_q8/Q4_1": 0.5})
    monkeypatch.setattr(selftest, "_STATE", selftest.SelfTest())
    _no_kernel_runs(monkeypatch)
    model = engine.load_model(smollm2_gguf)
    assert selftest.report()["stepped_down"] == {"Q4_1": "reference"}
    assert "WARN kernel self-test" in capsys.readouterr().err and model.backend.step is None


def test_verdicts_of_other_sources_or_another_cpu_are_not_taken(own_verdicts, monkeypatch, smollm2_gguf):
    engine.load_model(smollm2_gguf)
    monkeypatch.setattr(verdicts, "_fingerprint", "another machine")
    assert verdicts.load() == {}
    own_verdicts.write_text("{not json")
    assert verdicts.load() == {}
