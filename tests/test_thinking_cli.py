"""`goinfer chat` and `goinfer batch` with a thinking model: the reasoning dimmed on stderr (or a marker), only the
answer on stdout and in the conversation; --thinking and /think switch it; batch lines answer with the clean answer.

The model: the kit's tiny qwen3 checkpoint directory (random weights, greedy) with the real Qwen3.5 chat template,
whose prompt opens the thinking block, so every reply thinks; the engine's own split is the reference.
"""

from __future__ import annotations

import json
import shutil

import pytest

import engine
from engine.api.openai import parse_chat_request
from engine.thinking.plan import ThinkingSettings
from engine.requests.request import execute
from tests import reference_templates as ref
from tests.conftest import in_kit
from tests.test_cli import goinfer

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The kit's qwen3 directory with Qwen3.5's chat template (its prompt opens the block)."""
    path = tmp_path_factory.mktemp("thinker") / "qwen3-thinking"
    shutil.copytree(in_kit("qwen3", "hf"), path)
    config_path = path / "tokenizer_config.json"
    config_path.chmod(0o644)
    config = json.loads(config_path.read_text())
    config["chat_template"] = ref.reference_template("Qwen3.5-4B")
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def expected(thinker):
    model = engine.load_model(str(thinker), selftest=False)
    req = parse_chat_request({"messages": HELLO, "temperature": 0, "max_tokens": 20})
    return {mode: execute(model, req, thinking=ThinkingSettings(mode)).choices[0] for mode in ("template", "off")}


def test_chat_prints_the_reasoning_dimmed_and_answers_on_stdout(thinker, expected):
    r = goinfer("chat", "--model", str(thinker), "--prompt", "Hello", "--temp", "0", "--max", "20", "--no-selftest")
    assert r.returncode == 0, r.stderr
    want = expected["template"]
    assert want.reasoning and r.stdout == want.text + "\n"
    assert want.reasoning in r.stderr and "<think>" not in r.stdout + r.stderr


def test_hide_thinking_prints_a_marker_and_off_answers_directly(thinker, expected):
    r = goinfer("chat", "--model", str(thinker), "--prompt", "Hello", "--temp", "0", "--max", "20", "--no-selftest",
                "--hide-thinking")
    assert r.returncode == 0, r.stderr
    assert "(thinking…)" in r.stderr and expected["template"].reasoning not in r.stderr
    assert r.stdout == expected["template"].text + "\n"
    off = goinfer("chat", "--model", str(thinker), "--prompt", "Hello", "--temp", "0", "--max", "20",
                  "--no-selftest", "--thinking", "off")
    assert off.returncode == 0 and off.stdout == expected["off"].text + "\n" and not expected["off"].reasoning
    assert "(thinking" not in off.stderr


def test_the_repl_switches_thinking_with_slash_think(thinker, expected):
    r = goinfer("chat", "--model", str(thinker), "--temp", "0", "--max", "20", "--no-selftest",
                stdin="/think off\nHello\n/think maybe\n")
    assert r.returncode == 0, r.stderr
    assert expected["off"].text in r.stdout and "thinking: off" in r.stderr
    assert "invalid value for /think" in r.stderr


def test_bad_thinking_flags_are_one_line_errors(thinker):
    for flag, value in (("--thinking", "sometimes"), ("--reasoning-budget", "lots")):
        r = goinfer("chat", "--model", str(thinker), "--prompt", "Hi", flag, value)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and flag in r.stderr


def test_batch_lines_answer_with_the_clean_answer(tmp_path, thinker, expected):
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": HELLO, "temperature": 0, "max_tokens": 20}},
             {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": HELLO, "temperature": 0, "max_tokens": 20,
                       "chat_template_kwargs": {"enable_thinking": False}}}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = goinfer("batch", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", str(thinker), "--no-selftest")
    assert r.returncode == 0, r.stderr
    out = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]
           for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert (out["a"]["content"], out["a"]["reasoning_content"]) == (expected["template"].text,
                                                                     expected["template"].reasoning)
    assert out["b"]["content"] == expected["off"].text and "reasoning_content" not in out["b"]
