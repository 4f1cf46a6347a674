"""`goinfer chat` as a user runs it: a real process, real model, stdout/stderr/exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testdata import make_fixtures
from tests.conftest import in_kit

ROOT = Path(__file__).resolve().parents[1]


def goinfer(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "goinfer_cli.app", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def test_one_shot_prompt_answers_paris(smollm2_gguf):
    r = goinfer("chat", "--model", str(smollm2_gguf), "--prompt", "What is the capital of France? Answer in one sentence.", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "<|im_end|>" not in r.stdout and "<|im_start|>" not in r.stdout


def test_built_in_default_model_is_used_without_model_flag(smollm2_gguf):
    # conftest guarantees the default built-in model is in the cache, so this resolves offline.
    r = goinfer("chat", "--prompt", "What is the capital of France? Answer in one sentence.", "--temp", "0", "--max", "32")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_prompt_from_stdin(smollm2_gguf):
    r = goinfer("chat", "--model", str(smollm2_gguf), "--prompt", "-", "--temp", "0", "--max", "32",
                stdin="What is the capital of France? Answer in one sentence.")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_repl_reads_commands_and_turns_from_a_pipe(smollm2_gguf):
    script = "/temp 0\n/max 40\nWhat is the capital of France? Answer in one sentence.\n/reset\n/temp nope\n/quit\n"
    r = goinfer("chat", "--model", str(smollm2_gguf), stdin=script)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "conversation cleared" in r.stderr
    assert "invalid value for /temp" in r.stderr


def test_repl_help_lists_the_commands_and_each_says_what_it_changed(smollm2_gguf):
    """/help and /? list every command on a line of its own; a setting says its new value, /reset what it keeps,
    and a /retry reply is marked as one ("nothing to retry" is not)."""
    system = "Answer briefly, in plain words, and always be polite to whoever is asking the question."
    script = (f"/help\n/?\n/retry\n/temp 0.5\n/temp 0\n/seed 7\n/seed\n/max 12\n/reset\n/system {system}\n"
              "/reset\n/system\n/nope\nHello\n/retry\n/quit\n")
    r = goinfer("chat", "--model", str(smollm2_gguf), stdin=script)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    for command in ("/help", "/retry", "/undo", "/reset", "/system", "/temp", "/seed", "/max", "/think", "/effort",
                    "/verbose", "/quit"):
        listed = [ln for ln in lines if ln.split(" ")[0].rstrip(",") == command]
        assert len(listed) == 2 and len(listed[0].split()) > 2, (command, r.stderr)  # once per /help and /?
    assert [ln for ln in lines if "unknown command" in ln] == ["unknown command /nope; /help lists the commands"]
    for said in ("nothing to retry", "temperature: 0.5", "temperature: 0 (greedy)", "seed: 7",
                 "seed: none (a random one each reply)", "max tokens: 12", "conversation cleared; no system prompt set",
                 f"system prompt: {system[:59]}…; conversation cleared",  # a long prompt: its first 60 characters
                 f"conversation cleared; system prompt kept: {system[:59]}…",
                 "system prompt removed; conversation cleared"):
        assert said in lines, (said, r.stderr)
    assert lines.count("(retry)") == 1 and lines.index("(retry)") > lines.index("unknown command /nope; /help lists "
                                                                              "the commands")
    half = len(r.stdout) // 2  # greedy: the retried reply is the first again
    assert r.stdout.strip() and r.stdout[:half] == r.stdout[half:], r.stdout


def test_repl_retry_and_undo_resume_from_the_warm_cache(tmp_path):
    """/retry answers the last message again and /undo drops the last exchange; on a recurrent model (whose cache
    resumes only from snapshots) both start from the warm cache, not from nothing (chat -v prints what was
    reused). The replies are long enough that the conversation's own last snapshot lies past the retried prompt."""
    kit = in_kit("qwen3_5", "tiny-qwen3-5-a.Q8_0.gguf")
    system = "You are a careful assistant for a small bakery. Keep answers short and never invent prices. " * 4
    script = "What bread do you recommend?\n/retry\n/undo\n/undo\n/retry\nAnd for breakfast?\n/quit\n"
    r = goinfer("chat", "--model", str(kit), "--system", system, "--temp", "0", "--max", "80", "-v", stdin=script)
    assert r.returncode == 0, r.stderr
    timings = [ln for ln in r.stderr.splitlines() if ln.startswith("prompt ")]
    assert len(timings) == 3, r.stderr
    (n, _), (n_retry, reused_retry), (_, reused_next) = [
        (int(ln.split()[1]), int(ln.split("(")[1].split()[0])) for ln in timings]
    assert n_retry == n and reused_retry == (n - 1) // 64 * 64 > 0  # the retried prompt's own last tile
    assert reused_next > 0  # the snapshot before the undone message
    assert "removed the last exchange" in r.stderr and "nothing to undo" in r.stderr
    assert "nothing to retry" in r.stderr
    out = r.stdout  # three replies, each ended by a newline (a reply may hold newlines of its own)
    cuts = [i + 1 for i, c in enumerate(out) if c == "\n"]
    assert any(out[:k] == out[k : 2 * k] and len(out) > 2 * k for k in cuts), out  # greedy: the same reply again


def test_repl_session_file_resumes_the_conversation(tmp_path, smollm2_gguf):
    saved = tmp_path / "talk.kvsession"
    first = goinfer("chat", "--model", str(smollm2_gguf), "--session", str(saved), "--temp", "0", "--max", "24",
                    stdin="My name is Ada. Remember it.\nWhat is the capital of France?\n")
    assert first.returncode == 0, first.stderr
    assert saved.is_file() and saved.stat().st_size > 0
    again = goinfer("chat", "--model", str(smollm2_gguf), "--session", str(saved), "--temp", "0", "--max", "24",
                    stdin="What is my name?\n")
    assert again.returncode == 0, again.stderr
    assert "resumed 4 messages" in again.stderr
    # the file follows the conversation: an undone exchange stays undone, a cleared conversation is gone
    undone = goinfer("chat", "--model", str(smollm2_gguf), "--session", str(saved), "--temp", "0", "--max", "8",
                     stdin="/undo\n/undo\n")
    assert undone.returncode == 0, undone.stderr
    assert "resumed 6 messages" in undone.stderr and undone.stderr.count("removed the last exchange") == 2
    after = goinfer("chat", "--model", str(smollm2_gguf), "--session", str(saved), stdin="/reset\n")
    assert "resumed 2 messages" in after.stderr and not saved.exists()
    saved = tmp_path / "again.kvsession"
    first = goinfer("chat", "--model", str(smollm2_gguf), "--session", str(saved), "--temp", "0", "--max", "24",
                    stdin="My name is Ada. Remember it.\nWhat is the capital of France?\n")
    # a damaged file: one warning line, a new conversation, the file left as it was
    saved.write_bytes(saved.read_bytes()[:1000])
    damaged = goinfer("chat", "--model", str(smollm2_gguf), "--session", str(saved), "--temp", "0", "--max", "8",
                      stdin="Hello.\n")
    assert damaged.returncode == 0, damaged.stderr
    warnings = [ln for ln in damaged.stderr.splitlines() if "skipped session file" in ln]
    assert len(warnings) == 1 and "Traceback" not in damaged.stderr
    assert saved.stat().st_size == 1000
    _one_error_line(goinfer("chat", "--model", str(smollm2_gguf), "--session", str(saved), "--prompt", "hi"),
                    "--session")


def test_repl_text_is_never_read_as_markup():
    # user text in a command or an error message once ended the REPL with Rich's MarkupError
    r = goinfer("chat", "--max", "2", stdin="/[/x]\n/temp [bold]\n/system [/red]\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert "unknown command /[/x]" in r.stderr and "invalid value for /temp: '[bold]'" in r.stderr
    assert "Traceback" not in r.stderr


def _one_error_line(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert r.stdout == ""


def test_missing_file(tmp_path):
    _one_error_line(goinfer("chat", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi"), "no such file")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model\n" * 10)
    _one_error_line(goinfer("chat", "--model", str(bad), "--prompt", "hi"), "not a GGUF file")


def test_truncated_gguf(tmp_path):
    whole = tmp_path / "whole.gguf"
    make_fixtures.write_llama_fixture(whole)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    _one_error_line(goinfer("chat", "--model", str(cut), "--prompt", "hi"), "truncated")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "arch.gguf"
    make_fixtures.write_unsupported_arch_fixture(path)
    r = goinfer("chat", "--model", str(path), "--prompt", "hi")
    _one_error_line(r, "architecture", "not supported")


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "type.gguf"
    make_fixtures.write_unsupported_type_fixture(path)
    _one_error_line(goinfer("chat", "--model", str(path), "--prompt", "hi"), "type", "not support")


def test_unknown_model_name():
    _one_error_line(goinfer("chat", "--model", "no-such-model", "--prompt", "hi"), "no-such-model")


def test_bad_flag_value(smollm2_gguf):
    _one_error_line(goinfer("chat", "--model", str(smollm2_gguf), "--prompt", "hi", "--temp", "-1"), "--temp")


@pytest.mark.parametrize("writer", ["write_llama_fixture", "write_gemma3_fixture"])
def test_tiny_fixtures_generate_text(tmp_path, writer):
    path = tmp_path / "tiny.gguf"
    getattr(make_fixtures, writer)(path)
    r = goinfer("chat", "--model", str(path), "--prompt", "hello", "--temp", "0", "--max", "8")
    assert r.returncode == 0, r.stderr


def test_version_prints_the_installed_version():
    from importlib import metadata

    r = goinfer("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"goinfer {metadata.version('goinfer')}")
    assert r.stdout.rstrip().endswith(f", Python {sys.version.split()[0]}")
    if (ROOT / ".git").exists():  # a checkout: its commit beside the version, "goinfer 0.1.0 (a1b2c3d), Python ..."
        assert " (" in r.stdout.split(",")[0], r.stdout


def test_chat_sampling_penalties_reach_the_sampler(smollm2_gguf):
    from engine import load_model
    from engine.api.openai import parse_chat_request
    from engine.requests.request import execute

    ask = "List three colours, then list them again."
    r = goinfer("chat", "--model", str(smollm2_gguf), "--prompt", ask, "--temp", "0", "--max", "24",
                "--repeat-penalty", "1.5", "--frequency-penalty", "0.5", "--no-selftest")
    assert r.returncode == 0, r.stderr
    model = load_model(str(smollm2_gguf), selftest=False)
    body = {"messages": [{"role": "user", "content": ask}], "temperature": 0, "max_tokens": 24}
    penalised = execute(model, parse_chat_request({**body, "repetition_penalty": 1.5, "frequency_penalty": 0.5}))
    plain = execute(model, parse_chat_request(body))
    assert r.stdout == penalised.choices[0].text + "\n" and r.stdout != plain.choices[0].text + "\n"
    for flag, value in (("--min-p", "1.5"), ("--repeat-penalty", "0"), ("--presence-penalty", "3")):
        bad = goinfer("chat", "--model", str(smollm2_gguf), "--prompt", "hi", flag, value)
        assert bad.returncode == 2 and flag in bad.stderr and bad.stderr.strip().count("\n") == 0


def test_chat_ctx_bounds_the_conversation(smollm2_gguf):
    long = "Tell me about the sea. " * 20
    r = goinfer("chat", "--model", str(smollm2_gguf), "--prompt", long, "--ctx", "32", "--no-selftest")
    assert r.returncode != 0 and "context window is 32" in r.stderr and r.stderr.strip().count("\n") == 0
    r = goinfer("chat", "--model", str(smollm2_gguf), "--prompt", "Hi", "--ctx", "48", "--max", "200", "--temp", "0",
                "--no-selftest")
    assert r.returncode == 0 and r.stdout.strip()
    from engine import load_model

    tok = load_model(str(smollm2_gguf), selftest=False).tokenizer
    assert len(tok.encode(r.stdout.strip(), add_bos=False)) < 48  # the reply stopped where the window ends
    assert goinfer("chat", "--model", str(smollm2_gguf), "--ctx", "8", "--prompt", "x").returncode == 2
